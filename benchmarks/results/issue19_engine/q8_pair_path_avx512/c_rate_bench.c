/* q8act_linear's rate with no Python around it: random codes and scales (the arithmetic does not depend on them),
 * x quantized once, the product timed over many calls; median of 9 batches. */
#include "q8_linear.c"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 2;
    const int64_t Ks[] = {512, 576, 1024, 1536}, Rs[] = {1, 3, 8, 16, 64};
    const int64_t N = 3072;
    for (int q4 = 0; q4 < 2; q4++)
    for (int ki = 0; ki < 4; ki++) {
        const int64_t K = Ks[ki], S = q8_scale_count(K), cb = q8_code_bytes(K), row_bytes = q4 ? cb / 2 : cb;
        uint8_t *codes = malloc(N * row_bytes); float *sc = malloc(N * S * 4), *off = malloc(N * S * 4);
        for (int64_t i = 0; i < N * row_bytes; i++) codes[i] = rand() & 255;
        for (int64_t i = 0; i < N * S; i++) { sc[i] = 1e-3f * (rand() % 100); off[i] = 1e-3f * (rand() % 50); }
        for (int ri = 0; ri < 5; ri++) {
            const int64_t R = Rs[ri];
            float *x = malloc(R * K * 4), *y = malloc(R * N * 4);
            for (int64_t i = 0; i < R * K; i++) x[i] = (rand() % 2000 - 1000) * 1e-3f;
            uint8_t *xq = malloc(R * diffspec_q8_xrow_bytes(K));
            diffspec_q8_quantize(x, R, K, xq, threads);
            const int reps = R >= 16 ? 50 : 200;
            double t[9];
            for (int w = 0; w < 20; w++) diffspec_q8act_linear(xq, R, K, codes, sc, q4 ? off : NULL, N, y, threads);
            for (int b = 0; b < 9; b++) {
                double t0 = now();
                for (int r = 0; r < reps; r++) diffspec_q8act_linear(xq, R, K, codes, sc, q4 ? off : NULL, N, y, threads);
                t[b] = (now() - t0) / reps;
            }
            qsort(t, 9, sizeof(double), cmp);
            printf("%s K=%4ld N=%ld R=%2ld: %.4f ms  %6.1f GMAC/s\n", q4 ? "q4_1" : "q8_0", (long)K, (long)N, (long)R,
                   t[4] * 1e3, R * K * N / t[4] / 1e9);
            free(x); free(y); free(xq);
        }
        free(codes); free(sc); free(off);
    }
    return 0;
}
