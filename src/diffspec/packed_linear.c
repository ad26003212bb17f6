/* Linear layers over weights held in the blocks they were quantized to (packed_linear.py).
 *
 * A weight row is cut in blocks of 32 along the input dimension. Block b of row n holds a scale
 * d[n, b], an offset m[n, b] (Q4_1: both from the GGUF's float16 fields) and 32 integer codes q:
 *   Q4 (4-bit codes 0..15, two a byte: byte j holds code j in its low nibble, code j + 16 in its high)
 *       w = (d * q) + m
 *   Q8 (signed 8-bit codes, no offset)
 *       w = d * q
 * each operation rounded to float32 on its own (this file is compiled with -ffp-contract=off; with
 * GGUF's float16 scales d * q is exact in float32 anyway): the very values GGUF's reference dequantizer
 * (gguf-py, numpy float32) writes into the float32 model.
 * So the layer computes with the float32 model's own weights; only the order in which a dot product
 * is summed is this kernel's.
 *
 * y[r, n] = sum_k w[n, k] * x[r, k]: every (r, n) is summed in the same order whatever the number of
 * rows R (lanes of the vector width over k, fused multiply-adds, then one fixed horizontal sum), so a
 * row's output is bitwise the same in a one-row step and in a wide verify pass. */

#include <stddef.h>
#include <stdint.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define BLOCK 32
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
/* 16 lanes: a block is two vectors; 8 rows share a block's decoding (16 accumulators of 32 registers) */
#define ISA "avx512f"
#define LANES 16
#define ROW_GROUP 8
typedef __m512 vec;
INLINE vec vzero(void) { return _mm512_setzero_ps(); }
INLINE vec vload(const float *p) { return _mm512_loadu_ps(p); }
INLINE vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
INLINE float vsum(vec v) { return _mm512_reduce_add_ps(v); }

INLINE void decode_q4(const uint8_t *qb, float d, float m, vec *w) {
    /* the block's 16 possible weights, (d * code) + m for code 0..15, then looked up by code */
    const vec codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const vec table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d), codes), _mm512_set1_ps(m));
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qb));
    w[0] = _mm512_permutexvar_ps(c, table); /* low nibbles: permutexvar reads an index's low 4 bits */
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), table);
}

INLINE void decode_q8(const int8_t *qb, float d, vec *w) {
    const vec vd = _mm512_set1_ps(d);
    for (int j = 0; j < 2; j++)
        w[j] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + 16 * j)))));
}

#elif defined(__AVX2__) && defined(__FMA__)
/* 8 lanes: a block is four vectors; 4 rows share a block's decoding (8 accumulators of 16 registers) */
#define ISA "avx2"
#define LANES 8
#define ROW_GROUP 4
typedef __m256 vec;
INLINE vec vzero(void) { return _mm256_setzero_ps(); }
INLINE vec vload(const float *p) { return _mm256_loadu_ps(p); }
INLINE vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
INLINE float vsum(vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE void decode_q4(const uint8_t *qb, float d, float m, vec *w) {
    const vec vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    const __m256i low = _mm256_set1_epi32(15);
    const __m256i c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qb));
    const __m256i c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 8)));
    w[0] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(c0, low))), vm);
    w[1] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(c1, low))), vm);
    w[2] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4))), vm);
    w[3] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4))), vm);
}

INLINE void decode_q8(const int8_t *qb, float d, vec *w) {
    const vec vd = _mm256_set1_ps(d);
    for (int j = 0; j < 4; j++)
        w[j] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 8 * j)))));
}

#else
/* no vector extension: "vectors" of one lane, the same order of operations */
#define ISA "scalar"
#define LANES 1
#define ROW_GROUP 4
typedef float vec;
INLINE vec vzero(void) { return 0.0f; }
INLINE vec vload(const float *p) { return *p; }
INLINE vec vfma(vec a, vec b, vec c) { return a * b + c; } /* not fused under -ffp-contract=off: still one fixed order */
INLINE vec vadd(vec a, vec b) { return a + b; }
INLINE float vsum(vec v) { return v; }

INLINE void decode_q4(const uint8_t *qb, float d, float m, vec *w) {
    for (int j = 0; j < BLOCK; j++) {
        const float t = d * (float)(j < 16 ? qb[j] & 15 : qb[j - 16] >> 4);
        w[j] = t + m;
    }
}

INLINE void decode_q8(const int8_t *qb, float d, vec *w) {
    for (int j = 0; j < BLOCK; j++) w[j] = d * (float)qb[j];
}
#endif

#define VECS (BLOCK / LANES)
/* Passes wider than ROW_GROUP take two weight rows at a time, PAIR_GROUP rows of x a time, sharing every load of x
 * (1.3-1.4x faster at 17-25 rows on an AVX-512 EPYC; slower for narrow passes over short rows, which keep one weight
 * row; narrow passes over long rows take pairs too: TAKES_PAIRS below). AVX2's 16 registers do not hold a pair's
 * accumulators: 0 there, one weight row always. */
#ifndef PAIR_GROUP
#if defined(__AVX512F__)
#define PAIR_GROUP 6 /* 6 rows x 2 weight rows x 2 chains: 24 accumulators of 32 registers */
#else
#define PAIR_GROUP 0
#endif
#endif
#define PAIR_GROUP_MAX (PAIR_GROUP > ROW_GROUP ? PAIR_GROUP : ROW_GROUP)
/* A narrower pass takes pairs too when its group of x rows would not stay in the L1 cache (32 KiB a core; 24 KiB
 * leaves room for the codes streaming past), so every weight row read them from L2 again: the 576 x 1536 down
 * product at 6-8 rows, 88 -> 73 and 137 -> 102 us on an AVX-512 EPYC (`benchmarks/results/issue19_engine/
 * pair_l1/`); narrow passes over short rows keep one weight row, where pairs measured slower. */
#define PAIR_X_BYTES 24576
#define TAKES_PAIRS(R, K) (PAIR_GROUP && ((R) > ROW_GROUP || ((R) > 4 && (K) * 4 * ((R) < ROW_GROUP ? (R) : ROW_GROUP) > PAIR_X_BYTES)))

const char *diffspec_packed_isa(void) { return ISA; }

/* Whether a pass of R rows of K inputs takes weight rows in pairs (for the tests: the rule is not visible otherwise) */
int diffspec_takes_pairs(int64_t R, int64_t K) { return TAKES_PAIRS(R, K) ? 1 : 0; }

/* G rows of x (a compile-time count once inlined, so the accumulators stay in registers) through WR weight rows
 * (1 or 2: two rows share every load of x) of a Q4 (Q4 = 1: codes K/2 bytes a row, offsets m) or Q8 weight.
 * Each (row of x, weight row) keeps two accumulators, the even and the odd vectors of every block, added at the
 * end, then summed across lanes: the same operations in the same order for an output whatever G and WR are. */
INLINE void rows(const int Q4, const int G, const int WR, const float *x, int64_t K, const void *qrow,
                 const float *drow, const float *mrow, float *y, int64_t N) {
    const int64_t nb = K / BLOCK, row_bytes = Q4 ? K / 2 : K, block_bytes = Q4 ? BLOCK / 2 : BLOCK;
    vec acc[PAIR_GROUP_MAX][2][2], w[2][VECS];
    for (int i = 0; i < G; i++)
        for (int r = 0; r < WR; r++) acc[i][r][0] = acc[i][r][1] = vzero();
    for (int64_t b = 0; b < nb; b++) {
        for (int r = 0; r < WR; r++) {
            const void *qb = (const uint8_t *)qrow + r * row_bytes + b * block_bytes;
            if (Q4) decode_q4((const uint8_t *)qb, drow[r * nb + b], mrow[r * nb + b], w[r]);
            else decode_q8((const int8_t *)qb, drow[r * nb + b], w[r]);
        }
        for (int i = 0; i < G; i++)
            for (int j = 0; j < VECS; j++) {
                const vec xv = vload(x + i * K + b * BLOCK + j * LANES);
                for (int r = 0; r < WR; r++) acc[i][r][j & 1] = vfma(w[r][j], xv, acc[i][r][j & 1]);
            }
    }
    for (int i = 0; i < G; i++)
        for (int r = 0; r < WR; r++) y[i * N + r] = vsum(vadd(acc[i][r][0], acc[i][r][1]));
}

#define CASES_1_4(CALL, WR) case 1: CALL(1, WR); break; case 2: CALL(2, WR); break; case 3: CALL(3, WR); break; case 4: CALL(4, WR); break;
#define CASES_5_8(CALL, WR) case 5: CALL(5, WR); break; case 6: CALL(6, WR); break; case 7: CALL(7, WR); break; case 8: CALL(8, WR); break;
#if ROW_GROUP == 8
#define DISPATCH_ONE(CALL) switch (g) { CASES_1_4(CALL, 1) CASES_5_8(CALL, 1) }
#else
#define DISPATCH_ONE(CALL) switch (g) { CASES_1_4(CALL, 1) }
#endif
#if PAIR_GROUP == 6
#define DISPATCH_PAIR(CALL) switch (g) { CASES_1_4(CALL, 2) case 5: CALL(5, 2); break; case 6: CALL(6, 2); break; }
#elif PAIR_GROUP == 0
#define DISPATCH_PAIR(CALL) { /* never taken */ }
#else
#error "PAIR_GROUP must be 0 or 6"
#endif

/* Weight rows are read once a pass (three times the L3 for SmolLM2), so each is asked for PACKED_PREFETCH rows
 * ahead with a non-temporal hint (locality 0: prefetchnta on x86), as q8_linear.c does: the codes stream past
 * without pushing out of the caches what the pass and the torch operations between passes reuse. 0: none. */
#ifndef PACKED_PREFETCH
#define PACKED_PREFETCH 8
#endif
/* every line of a row's codes (bytes), scales d and offsets m (nb each; m may be NULL) */
INLINE void prefetch_rows(const uint8_t *q, int64_t bytes, const float *d, const float *m, int64_t nb) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(q + b, 0, 0);
    __builtin_prefetch(q + bytes - 1, 0, 0);
    for (int64_t b = 0; b < nb; b += 16) {
        __builtin_prefetch(d + b, 0, 0);
        if (m) __builtin_prefetch(m + b, 0, 0);
    }
    __builtin_prefetch(d + nb - 1, 0, 0);
    if (m) __builtin_prefetch(m + nb - 1, 0, 0);
}
/* weight row `ahead` = n + PACKED_PREFETCH of N (rows of row_bytes bytes, nb scales each) */
INLINE void prefetch_ahead(int64_t n, int64_t N, const void *q, int64_t row_bytes, const float *d, const float *m,
                           int64_t nb) {
    const int64_t ahead = n + PACKED_PREFETCH;
    if (PACKED_PREFETCH > 0 && ahead < N)
        prefetch_rows((const uint8_t *)q + ahead * row_bytes, row_bytes, d + ahead * nb, m ? m + ahead * nb : NULL, nb);
}

/* y[R, N] = x[R, K] @ W^T for a Q4 weight (K a multiple of 32; every array contiguous); W's rows (or pairs of
 * rows, where TAKES_PAIRS) split among `threads` OpenMP threads (torch's
 * count, passed on each call). Either way an output is computed by the same operations. */
#define LINEAR_BODY(CALL, PREFETCH)                                                    \
    if (TAKES_PAIRS(R, K)) {                                                                             \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                               \
        for (int64_t p = 0; p < (N + 1) / 2; p++) {                                                      \
            const int64_t n = 2 * p;                                                                     \
            const int pair = n + 1 < N;                                                                  \
            const int64_t group = pair ? PAIR_GROUP : ROW_GROUP;                                         \
            PREFETCH(n); PREFETCH(n + 1);                                                                \
            for (int64_t r0 = 0; r0 < R; r0 += group) {                                                  \
                const int64_t g = R - r0 < group ? R - r0 : group;                                       \
                if (pair) DISPATCH_PAIR(CALL) else DISPATCH_ONE(CALL)                                    \
            }                                                                                            \
        }                                                                                                \
    } else {                                                                                             \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                               \
        for (int64_t n = 0; n < N; n++) {                                                                \
            PREFETCH(n);                                                                                 \
            for (int64_t r0 = 0; r0 < R; r0 += ROW_GROUP) {                                              \
                const int64_t g = R - r0 < ROW_GROUP ? R - r0 : ROW_GROUP;                               \
                DISPATCH_ONE(CALL)                                                                       \
            }                                                                                            \
        }                                                                                                \
    }

void diffspec_q4_linear(const float *x, int64_t R, int64_t K, const uint8_t *q, const float *d,
                        const float *m, int64_t N, float *y, int threads) {
#define Q4(G, WR) rows(1, G, WR, x + r0 * K, K, q + n * (K / 2), d + n * (K / BLOCK), m + n * (K / BLOCK), y + r0 * N + n, N)
#define AHEAD(n) prefetch_ahead(n, N, q, K / 2, d, m, K / BLOCK)
    LINEAR_BODY(Q4, AHEAD)
#undef AHEAD
#undef Q4
}

void diffspec_q8_linear(const float *x, int64_t R, int64_t K, const int8_t *q, const float *d,
                        int64_t N, float *y, int threads) {
#define Q8(G, WR) rows(0, G, WR, x + r0 * K, K, q + n * K, d + n * (K / BLOCK), NULL, y + r0 * N + n, N)
#define AHEAD(n) prefetch_ahead(n, N, q, K, d, NULL, K / BLOCK)
    LINEAR_BODY(Q8, AHEAD)
#undef AHEAD
#undef Q8
}

/* out[r] = the index of row r's largest value, as torch.argmax gives it: the first of equal values (0.0 and -0.0
 * are equal), the first NaN where the row holds one. The greedy choice read from a pass's logits: torch's
 * index-tracking loop took ~45-90 us a 49152-wide row on an AVX-512 EPYC. Two passes over the row: its largest value
 * (and whether it holds a NaN), then the first index that equals it. */
static int64_t argmax_row(const float *x, int64_t V) {
    int64_t i = 0;
    float best = -__builtin_inff();
    int nan = 0;
#if defined(__AVX512F__)
    __m512 vbest = _mm512_set1_ps(-__builtin_inff());
    __mmask16 unordered = 0;
    for (; i + 16 <= V; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vbest = _mm512_max_ps(vbest, v);
    }
    nan = unordered != 0;
    best = _mm512_reduce_max_ps(vbest);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 vbest = _mm256_set1_ps(-__builtin_inff()), unordered = _mm256_setzero_ps();
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vbest = _mm256_max_ps(vbest, v);
    }
    nan = _mm256_movemask_ps(unordered) != 0;
    float lanes[8];
    _mm256_storeu_ps(lanes, vbest);
    for (int j = 0; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
#endif
    for (; i < V; i++) {
        if (x[i] != x[i]) nan = 1;
        else if (x[i] > best) best = x[i];
    }
    int64_t j = 0;
#if defined(__AVX512F__)
    if (!nan) {
        const __m512 vb = _mm512_set1_ps(best);
        for (; j + 16 <= V; j += 16) {
            const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), vb, _CMP_EQ_OQ);
            if (eq) return j + __builtin_ctz((unsigned)eq);
        }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (!nan) {
        const __m256 vb = _mm256_set1_ps(best);
        for (; j + 8 <= V; j += 8) {
            const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), vb, _CMP_EQ_OQ));
            if (eq) return j + __builtin_ctz((unsigned)eq);
        }
    }
#endif
    for (; j < V; j++)
        if (nan ? x[j] != x[j] : x[j] == best) return j;
    return 0; /* V == 0 */
}

void diffspec_argmax_rows(const float *x, int64_t R, int64_t V, int64_t *out) {
    for (int64_t r = 0; r < R; r++) out[r] = argmax_row(x + r * V, V);
}
