/* y[R, N] = x[R, K] @ W^T for bfloat16 x and W, float32 sums (bf16_linear.py): the drafters' linear layers.
 *
 * W is held in tiles of 16 output rows: tile t, input pair p holds (W[16t + l, 2p], W[16t + l, 2p + 1]) for
 * lanes l = 0..15, 64 bytes, so a tile streams from memory in order and each vector of it feeds 16 outputs.
 * A row of x contributes a broadcast pair (x[r, 2p], x[r, 2p + 1]) per step; nothing is summed across lanes.
 * Every product of two bfloat16 values is exact in float32; each output is summed over p in order, the odd
 * product of a pair added before the even one (the order Intel documents for AVX512-BF16's VDPBF16PS, which
 * computes this where the CPU has it; elsewhere float32 FMAs, whose single rounding equals an add's since the
 * product is exact). The order does not depend on R, so a row's output is the same in any pass. VDPBF16PS
 * also flushes subnormals to zero, which the other builds do not: builds may differ there.
 */

#include <stddef.h>
#include <stdint.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))
#define TILE 16
#define MAX_GROUP 8 /* the dispatch instantiates G up to 8; a build's ROW_GROUP caps what runs */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define ISA "avx512bf16"
#elif defined(__AVX512F__)
#define ISA "avx512f"
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA "avx2"
#else
#define ISA "scalar"
#endif

const char *diffspec_bf16_isa(void) { return ISA; }

#if defined(__AVX512F__)
/* two tiles (32 outputs) by G rows: 2G accumulators */
#define ROW_GROUP 8
#if defined(__AVX512BF16__)
INLINE __m512 dot_pair(__m512 acc, __m512i w, __m512i xx) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)xx);
}
#else
INLINE __m512 dot_pair(__m512 acc, __m512i w, __m512i xx) {
    /* the pair's odd element is the lane's high half, the even one its low half (shifted up: a bf16 is the
     * high half of its float32) */
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high)), _mm512_castsi512_ps(_mm512_and_si512(xx, high)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(xx, 16)), acc);
}
#endif

INLINE void tiles(const int G, const int T, const uint16_t *x, int64_t K, const uint16_t *w, int64_t tile_stride,
                  float *y, int64_t N) {
    __m512 acc[MAX_GROUP][2];
    for (int i = 0; i < G; i++)
        for (int t = 0; t < T; t++) acc[i][t] = _mm512_setzero_ps();
    const int64_t pairs = K / 2;
    const uint32_t *xp = (const uint32_t *)x;
    for (int64_t p = 0; p < pairs; p++) {
        __m512i wv[2];
        for (int t = 0; t < T; t++) wv[t] = _mm512_loadu_si512((const void *)(w + t * tile_stride + p * 2 * TILE));
        for (int i = 0; i < G; i++) {
            const __m512i xx = _mm512_set1_epi32((int)xp[i * pairs + p]);
            for (int t = 0; t < T; t++) acc[i][t] = dot_pair(acc[i][t], wv[t], xx);
        }
    }
    for (int i = 0; i < G; i++)
        for (int t = 0; t < T; t++) _mm512_storeu_ps(y + i * N + t * TILE, acc[i][t]);
}
#define TILES_AT_ONCE 2

#elif defined(__AVX2__) && defined(__FMA__)
/* one tile (two 8-lane halves) by G rows: 2G accumulators of 16 registers */
#define ROW_GROUP 4
INLINE void tiles(const int G, const int T, const uint16_t *x, int64_t K, const uint16_t *w, int64_t tile_stride,
                  float *y, int64_t N) {
    (void)T; (void)tile_stride;
    __m256 acc[MAX_GROUP][2];
    for (int i = 0; i < G; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const int64_t pairs = K / 2;
    const uint32_t *xp = (const uint32_t *)x;
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000);
    for (int64_t p = 0; p < pairs; p++) {
        __m256 w_odd[2], w_even[2];
        for (int h = 0; h < 2; h++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + p * 2 * TILE + h * TILE));
            w_odd[h] = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
            w_even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
        }
        for (int i = 0; i < G; i++) {
            const uint32_t pair = xp[i * pairs + p];
            const __m256 x_odd = _mm256_castsi256_ps(_mm256_set1_epi32((int)(pair & 0xFFFF0000u)));
            const __m256 x_even = _mm256_castsi256_ps(_mm256_set1_epi32((int)(pair << 16)));
            for (int h = 0; h < 2; h++) {
                acc[i][h] = _mm256_fmadd_ps(w_odd[h], x_odd, acc[i][h]);
                acc[i][h] = _mm256_fmadd_ps(w_even[h], x_even, acc[i][h]);
            }
        }
    }
    for (int i = 0; i < G; i++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + i * N + h * 8, acc[i][h]);
}
#define TILES_AT_ONCE 1

#else
#define ROW_GROUP 4
#include <string.h>
INLINE float widen(uint16_t half) {
    const uint32_t bits = (uint32_t)half << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
/* GCC 12's loop vectorizer at -O3 miscompiled this loop (a pair's even product counted twice; seen with
 * tests/test_bf16_linear.py): scalar it stays */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((noinline, optimize("no-tree-loop-vectorize")))
#endif
static void tiles(const int G, const int T, const uint16_t *x, int64_t K, const uint16_t *w, int64_t tile_stride,
                  float *y, int64_t N) {
    (void)T; (void)tile_stride;
    const int64_t pairs = K / 2;
    for (int i = 0; i < G; i++) {
        float acc[TILE];
        for (int l = 0; l < TILE; l++) acc[l] = 0.0f;
        for (int64_t p = 0; p < pairs; p++) {
            const float x_odd = widen(x[i * K + 2 * p + 1]), x_even = widen(x[i * K + 2 * p]);
            for (int l = 0; l < TILE; l++) {
                const uint16_t *wp = w + p * 2 * TILE + 2 * l;
                acc[l] = widen(wp[1]) * x_odd + acc[l]; /* -ffp-contract=off: not fused (equal anyway: exact products) */
                acc[l] = widen(wp[0]) * x_even + acc[l];
            }
        }
        for (int l = 0; l < TILE; l++) y[i * N + l] = acc[l];
    }
}
#define TILES_AT_ONCE 1
#endif

#define CASES(CALL, T) switch (g) { case 1: CALL(1, T); break; case 2: CALL(2, T); break; case 3: CALL(3, T); break; \
    case 4: CALL(4, T); break; case 5: CALL(5, T); break; case 6: CALL(6, T); break; case 7: CALL(7, T); break;   \
    case 8: CALL(8, T); break; }

/* x [R, K] bf16 (K even), w: the tiles, [N/16, K/2, 16, 2] bf16 (N a multiple of 16), y [R, N] float32. Tiles
 * (in pairs where the vector width allows) split among `threads` OpenMP threads. */
void diffspec_bf16_linear(const uint16_t *x, int64_t R, int64_t K, const uint16_t *w, int64_t N, float *y,
                          int threads) {
    const int64_t ntiles = N / TILE, stride = K * TILE, steps = (ntiles + TILES_AT_ONCE - 1) / TILES_AT_ONCE;
#define CALL(G, T) tiles(G, T, x + r0 * K, K, w + t0 * stride, stride, y + r0 * N + t0 * TILE, N)
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t s = 0; s < steps; s++) {
        const int64_t t0 = s * TILES_AT_ONCE;
        const int both = TILES_AT_ONCE == 2 && t0 + 1 < ntiles;
        for (int64_t r0 = 0; r0 < R; r0 += ROW_GROUP) {
            const int64_t g = R - r0 < ROW_GROUP ? R - r0 : ROW_GROUP;
            if (both) { CASES(CALL, 2) } else { CASES(CALL, 1) }
        }
    }
#undef CALL
}
