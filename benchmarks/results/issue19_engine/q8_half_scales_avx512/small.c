#include "new_q8.c"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    int threads = atoi(argv[1]);
    int64_t shapes[][2] = {{576, 576}, {960, 576}, {3072, 576}, {576, 1536}, {49152, 576}};
    for (int s = 0; s < 5; s++) {
        int64_t N = shapes[s][0], K = shapes[s][1], nb = K / 32;
        uint8_t *codes = malloc(N * K / 2 + 64); uint16_t *sc = calloc(N * nb + 32, 2), *off = calloc(N * nb + 32, 2);
        float *x = malloc(K * 4), *y = malloc(N * 4); for (int i = 0; i < K; i++) x[i] = i % 7;
        uint8_t *xq = malloc(diffspec_q8_xrow_bytes(K)); diffspec_q8_quantize(x, 1, K, xq, threads);
        int reps = N > 10000 ? 50 : 2000;
        for (int w = 0; w < 100; w++) diffspec_q8act_linear(xq, 1, K, codes, sc, off, N, y, threads);
        double t0 = now();
        for (int r = 0; r < reps; r++) diffspec_q8act_linear(xq, 1, K, codes, sc, off, N, y, threads);
        double dt = (now() - t0) / reps;
        printf("threads %d N=%5ld K=%4ld: %.2f us  (%.1f GB/s of %ld KB)\n", threads, (long)N, (long)K, dt * 1e6, N * (K / 2 + 4 * nb) / dt / 1e9, (long)(N * (K / 2 + 4 * nb) / 1024));
    }
}
