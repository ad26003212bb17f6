/* old (float32 scales, padded) and new (float16, unpadded) q8 kernels in one process, interleaved call by call: SmolLM2's
 * 30 layers (Q4_1 q/k/v, o, gate/up, down) + the Q8_0 head, weights streamed from memory; median of 31 passes per R */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
int64_t old_scale_count(int64_t), old_xrow_bytes(int64_t), diffspec_q8_xrow_bytes(int64_t);
void old_quantize(const float *, int64_t, int64_t, uint8_t *, int), diffspec_q8_quantize(const float *, int64_t, int64_t, uint8_t *, int);
void old_act(const uint8_t *, int64_t, int64_t, const uint8_t *, const float *, const float *, int64_t, float *, int);
void diffspec_q8act_linear(const uint8_t *, int64_t, int64_t, const uint8_t *, const uint16_t *, const uint16_t *, int64_t, float *, int);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
static int64_t code_bytes(int64_t K, int q4) { int64_t nb = K / 32, G = nb / 16, P = (nb % 16 + 1) / 2; return (G * 16 + 2 * P) * 32 / (q4 ? 2 : 1); }
typedef struct { int64_t N, K; int q4; uint8_t *codes; float *sc, *off; uint16_t *hsc, *hoff; } Lin;
int main(void) {
    const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    Lin lin[121]; int nl = 0;
    for (int l = 0; l < 30; l++) for (int s = 0; s < 4; s++) { lin[nl].N = shapes[s][0]; lin[nl].K = shapes[s][1]; lin[nl].q4 = 1; nl++; }
    lin[nl].N = 49152; lin[nl].K = 576; lin[nl].q4 = 0; nl++;
    srand(1);
    for (int i = 0; i < nl; i++) {
        const int64_t N = lin[i].N, K = lin[i].K, S = old_scale_count(K), nb = K / 32, cb = code_bytes(K, lin[i].q4);
        lin[i].codes = malloc(N * cb); for (int64_t j = 0; j < N * cb; j++) lin[i].codes[j] = rand();
        lin[i].sc = calloc(N * S, 4); lin[i].off = calloc(N * S, 4); lin[i].hsc = calloc(N * nb, 2); lin[i].hoff = calloc(N * nb, 2);
    }
    const int Rs[] = {1, 2, 3, 4, 8, 16};
    float *x = malloc(16 * 1536 * 4), *y = malloc(16 * 49152 * 4);
    for (int i = 0; i < 16 * 1536; i++) x[i] = (rand() % 2000 - 1000) * 1e-3f;
    uint8_t *xq = malloc(16 * old_xrow_bytes(1536) + 16 * old_xrow_bytes(576));
    double t[2][6][31];
    for (int rep = 0; rep < 33; rep++)
        for (int ri = 0; ri < 6; ri++)
            for (int v = 0; v < 2; v++) {
                const int64_t R = Rs[ri];
                double t0 = now();
                for (int i = 0; i < nl; i++) {
                    const Lin *L = &lin[i];
                    if (v == 0) { old_quantize(x, R, L->K, xq, 2); old_act(xq, R, L->K, L->codes, L->sc, L->q4 ? L->off : NULL, L->N, y, 2); }
                    else { diffspec_q8_quantize(x, R, L->K, xq, 2); diffspec_q8act_linear(xq, R, L->K, L->codes, L->hsc, L->q4 ? L->hoff : NULL, L->N, y, 2); }
                }
                if (rep >= 2) t[v][ri][rep - 2] = now() - t0;
            }
    for (int ri = 0; ri < 6; ri++) {
        qsort(t[0][ri], 31, 8, cmp); qsort(t[1][ri], 31, 8, cmp);
        printf("R=%2d  float32 scales %.3f ms   float16 %.3f ms   new/old %.3f\n", Rs[ri], t[0][ri][15] * 1e3, t[1][ri][15] * 1e3, t[1][ri][15] / t[0][ri][15]);
    }
}
