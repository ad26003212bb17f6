/* does a pass's weight stream evict an 8 MB working set from L3? time to re-read it after one pass of the linears */
#include KERNEL
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
typedef struct { int64_t N, K; int q4; uint8_t *codes; uint16_t *sc, *off; } Lin;
int main(void) {
    const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    Lin lin[121]; int nl = 0;
    for (int l = 0; l < 30; l++) for (int s = 0; s < 4; s++) { lin[nl].N = shapes[s][0]; lin[nl].K = shapes[s][1]; lin[nl].q4 = 1; nl++; }
    lin[nl].N = 49152; lin[nl].K = 576; lin[nl].q4 = 0; nl++;
    for (int i = 0; i < nl; i++) { int64_t N = lin[i].N, K = lin[i].K, nb = K / 32, cb = q8_code_bytes(K) / (lin[i].q4 ? 2 : 1);
        lin[i].codes = malloc(N * cb); for (int64_t j = 0; j < N * cb; j++) lin[i].codes[j] = rand();
        lin[i].sc = calloc(N * nb + 32, 2); lin[i].off = calloc(N * nb + 32, 2); }
    float *x = malloc(1536 * 4), *y = malloc(49152 * 4); for (int i = 0; i < 1536; i++) x[i] = i % 5;
    uint8_t *xq = malloc(diffspec_q8_xrow_bytes(1536));
    const size_t WS = 8u << 20; float *ws = malloc(WS); for (size_t i = 0; i < WS / 4; i++) ws[i] = 1;
    double tp[21], tr[21], th[21]; volatile float sink = 0;
    for (int rep = 0; rep < 23; rep++) {
        float s = 0; for (size_t i = 0; i < WS / 4; i += 16) s += ws[i];   /* warm the working set */
        double t0 = now();
        for (int i = 0; i < nl; i++) { diffspec_q8_quantize(x, 1, lin[i].K, xq, 2);
            diffspec_q8act_linear(xq, 1, lin[i].K, lin[i].codes, lin[i].sc, lin[i].q4 ? lin[i].off : NULL, lin[i].N, y, 2); }
        double t1 = now();
        for (size_t i = 0; i < WS / 4; i += 16) s += ws[i];               /* after the pass */
        double t2 = now();
        for (size_t i = 0; i < WS / 4; i += 16) s += ws[i];               /* hot */
        double t3 = now(); sink += s;
        if (rep >= 2) { tp[rep - 2] = t1 - t0; tr[rep - 2] = t2 - t1; th[rep - 2] = t3 - t2; }
    }
    qsort(tp, 21, 8, cmp); qsort(tr, 21, 8, cmp); qsort(th, 21, 8, cmp);
    printf("pass %.3f ms | re-read 8 MB after it %.3f ms, hot %.3f ms\n", tp[10] * 1e3, tr[10] * 1e3, th[10] * 1e3);
}
