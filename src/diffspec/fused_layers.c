/* The decoder layers of a Llama-architecture target in one call (fused_layers.py), over weights held as GGUF codes.
 *
 * llama_pass.py runs each decoder layer as ~20 torch operations; on a one-row step of SmolLM2-135M those calls,
 * not the arithmetic, are most of the time outside the matmuls (each a few microseconds on a CPU, 30 layers).
 * This file runs every layer of a pass in one call: RMSNorm, the q/k/v product, rotary embeddings, the cache
 * write, attention, the output product and residual, RMSNorm, the gate/up product, SiLU times up, the down
 * product and residual, with the matmuls through packed_linear.c's kernel (included below, so its code and its
 * order of summation are the very same).
 *
 * Exactness. Every row of a pass is computed by the same operations in the same order whatever the number of
 * rows n: the matmul kernel sums each output alone (packed_linear.c), and the rest is per row (RMSNorm, rotary
 * embeddings, SiLU) or per (row, head) (attention: row i reads positions 0 .. start + i). So a row's result is
 * bitwise the same in a one-row step and in a verify pass, which is what keeps speculative output equal to plain
 * decoding. Against transformers' operations, RMSNorm's and attention's sums and the exponential (a polynomial
 * here, ~1 ulp) differ in the last bits; the README measures what that does to greedy choices.
 *
 * Compiled with -ffp-contract=off (packed_linear.py's FLAGS): no multiply-add is fused where the source writes a
 * multiply and an add, so the rotary embeddings and the residual adds are transformers' own roundings. */

#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <string.h>
#include "packed_linear.c"
#include "q8_linear.c"

#define MAX_HEAD_DIM 256 /* fused_layers.py takes heads of at most this many dimensions */

/* exp(x), its argument clamped to [-87, 88] (softmax shifted by its max; SiLU): Cody-Waite range reduction and a
 * degree-6 polynomial, ~1 ulp; a plain loop of it vectorizes (no libm call). */
INLINE float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float k = rintf(x * 1.44269504088896341f);
    float r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } scale = { .i = ((int32_t)k + 127) << 23 };
    return p * scale.f;
}

/* A sum of squares, and below a sum, in one fixed order whatever the addresses (the vector lanes in turn, then
 * the tail, then one horizontal sum): no loop whose split into vectors a compiler could choose by alignment. */
INLINE float sum_of_squares(const float *x, int64_t D) {
    vec acc = vzero();
    int64_t j = 0;
    for (; j + LANES <= D; j += LANES) {
        const vec v = vload(x + j);
        acc = vfma(v, v, acc);
    }
    float tail = 0.0f;
    for (; j < D; j++) tail += x[j] * x[j];
    return vsum(acc) + tail;
}

INLINE float sum_of(const float *x, int64_t m) {
    vec acc = vzero();
    int64_t j = 0;
    for (; j + LANES <= m; j += LANES) acc = vadd(vload(x + j), acc);
    float tail = 0.0f;
    for (; j < m; j++) tail += x[j];
    return vsum(acc) + tail;
}

INLINE void rms_norm(const float *x, const float *w, int64_t D, float eps, float *y) {
    const float inv = 1.0f / sqrtf(sum_of_squares(x, D) / (float)D + eps);
    for (int64_t j = 0; j < D; j++) y[j] = w[j] * (x[j] * inv);
}

/* x @ W^T through the packed kernel: Q4 where offsets are given, else Q8; with xq (a buffer of R rows of
 * q8_linear.c's quantized activations) the weights are in q8_linear.c's layout (scales and offsets float16) and x
 * is quantized first */
INLINE void linear(const float *x, int64_t R, int64_t K, const void *codes, const float *scales,
                   const float *offsets, int64_t N, float *y, int threads, uint8_t *xq) {
    if (xq) {
        diffspec_q8_quantize(x, R, K, xq, threads);
        diffspec_q8act_linear(xq, R, K, (const uint8_t *)codes, (const uint16_t *)(const void *)scales,
                              (const uint16_t *)(const void *)offsets, N, y, threads);
    } else if (offsets) {
        diffspec_q4_linear(x, R, K, (const uint8_t *)codes, scales, offsets, N, y, threads);
    } else {
        diffspec_q8_linear(x, R, K, (const int8_t *)codes, scales, N, y, threads);
    }
}

/* rotary embeddings of one head's row in place: (x * cos) + (rotate_half(x) * sin), rotate_half(x) = [-x2, x1] */
INLINE void rotate(float *x, const float *cos, const float *sin, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t j = 0; j < half; j++) {
        const float x1 = x[j], x2 = x[j + half];
        const float a = x1 * cos[j], b = -x2 * sin[j];
        const float c = x2 * cos[j + half], d = x1 * sin[j + half];
        x[j] = a + b;
        x[j + half] = c + d;
    }
}

/* A few more vector operations beside packed_linear.c's (same widths). vclamp_exp is exp_poly's clamps (min/max with
 * the bound first keep a NaN as its ternaries do), vrint is rintf (rounding in the current mode), vpow2 is 2^k for an
 * integral k in [-126, 127] (its exponent bits, as exp_poly's union). */
#if defined(__AVX512F__)
INLINE vec vset1(float a) { return _mm512_set1_ps(a); }
INLINE vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
INLINE vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
INLINE vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
INLINE vec vneg(vec a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN))); }
INLINE void vstore(float *p, vec a) { _mm512_storeu_ps(p, a); }
INLINE vec vclamp_exp(vec x) { return _mm512_max_ps(_mm512_set1_ps(-87.0f), _mm512_min_ps(_mm512_set1_ps(88.0f), x)); }
INLINE vec vrint(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_CUR_DIRECTION); }
INLINE vec vpow2(vec k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__) && defined(__FMA__)
INLINE vec vset1(float a) { return _mm256_set1_ps(a); }
INLINE vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
INLINE vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
INLINE vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
INLINE vec vneg(vec a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
INLINE void vstore(float *p, vec a) { _mm256_storeu_ps(p, a); }
INLINE vec vclamp_exp(vec x) { return _mm256_max_ps(_mm256_set1_ps(-87.0f), _mm256_min_ps(_mm256_set1_ps(88.0f), x)); }
INLINE vec vrint(vec x) { return _mm256_round_ps(x, _MM_FROUND_CUR_DIRECTION); }
INLINE vec vpow2(vec k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23));
}
#else
INLINE vec vset1(float a) { return a; }
INLINE vec vmul(vec a, vec b) { return a * b; }
INLINE vec vsub(vec a, vec b) { return a - b; }
INLINE vec vdiv(vec a, vec b) { return a / b; }
INLINE vec vneg(vec a) { return -a; }
INLINE void vstore(float *p, vec a) { *p = a; }
INLINE vec vclamp_exp(vec x) { return x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x); }
INLINE vec vrint(vec x) { return rintf(x); }
INLINE vec vpow2(vec k) {
    union { float f; int32_t i; } scale = { .i = ((int32_t)k + 127) << 23 };
    return scale.f;
}
#endif

/* exp_poly on a vector: lane by lane the very operations of exp_poly above (the same multiplies and adds in the same
 * order, none fused), so every lane is bitwise exp_poly of it. GCC does not vectorize exp_poly's loops itself on AVX2
 * (its clamps are control flow to it): SiLU and softmax ran one value at a time. */
INLINE vec vexp_poly(vec x) {
    x = vclamp_exp(x);
    const vec k = vrint(vmul(x, vset1(1.44269504088896341f)));
    vec r = vsub(x, vmul(k, vset1(0.693359375f)));
    r = vsub(r, vmul(k, vset1(-2.12194440e-4f)));
    vec p = vset1(1.9875691500e-4f);
    p = vadd(vmul(p, r), vset1(1.3981999507e-3f));
    p = vadd(vmul(p, r), vset1(8.3334519073e-3f));
    p = vadd(vmul(p, r), vset1(4.1665795894e-2f));
    p = vadd(vmul(p, r), vset1(1.6666665459e-1f));
    p = vadd(vmul(p, r), vset1(5.0000001201e-1f));
    p = vadd(vadd(vmul(vmul(p, r), r), r), vset1(1.0f));
    return vmul(p, vpow2(k));
}

/* a[j] = (gate[j] / (1 + exp_poly(-gate[j]))) * up[j]: SiLU(gate) times up, each value as the scalar loop computes it */
INLINE void silu_times(const float *restrict gate, const float *restrict up, float *restrict a, int64_t F) {
    const vec one = vset1(1.0f);
    int64_t j = 0;
    for (; j + LANES <= F; j += LANES) {
        const vec x = vload(gate + j);
        vstore(a + j, vmul(vdiv(x, vadd(one, vexp_poly(vneg(x)))), vload(up + j)));
    }
    for (; j < F; j++) {
        const float x = gate[j];
        a[j] = (x / (1.0f + exp_poly(-x))) * up[j];
    }
}

/* For the tests: exp_poly and SiLU-times-up over n values as the pass computes them (the vector code where whole
 * vectors fit, the scalar code on the tail: softmax_weights' and silu_times' loops) beside the scalar code on
 * every value; every pair must agree bitwise on every build. */
void diffspec_fused_elementwise_check(const float *x, const float *up, int64_t n, float *exp_pass, float *exp_scalar,
                                      float *silu_pass, float *silu_scalar) {
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) vstore(exp_pass + j, vexp_poly(vload(x + j)));
    for (; j < n; j++) exp_pass[j] = exp_poly(x[j]);
    for (j = 0; j < n; j++) exp_scalar[j] = exp_poly(x[j]);
    silu_times(x, up, silu_pass, n);
    for (j = 0; j < n; j++) silu_scalar[j] = (x[j] / (1.0f + exp_poly(-x[j]))) * up[j];
}

/* softmax over scores[0 .. last] in place (shifted by the max): returns 1 / the sum of the exponentials */
INLINE float softmax_weights(float *restrict scores, int64_t last, float top) {
    const vec vtop = vset1(top);
    int64_t p = 0;
    for (; p + LANES <= last + 1; p += LANES) vstore(scores + p, vexp_poly(vsub(vload(scores + p), vtop)));
    for (; p <= last; p++) scores[p] = exp_poly(scores[p] - top);
    return 1.0f / sum_of(scores, last + 1);
}

/* Keys and values held as IEEE float16 (the target's cache under --kernels q8, as llama.cpp's default cache):
 * written rounded to nearest, ties to even, read back exactly (every half is a float). The conversions below give
 * the same values on every build: to_half in plain C is the hardware's rounding (tested against torch's), and
 * the vector forms are used where the build has them. */
INLINE uint16_t to_half(float f) {
    union { float f; uint32_t u; } v = { f };
    const uint32_t sign = (v.u >> 16) & 0x8000u, x = v.u & 0x7fffffffu;
    if (x > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((x >> 13) & 0x3ffu));  /* NaN: quiet, payload kept */
    if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                       /* >= 65520 (or inf): inf */
    if (x < 0x38800000u) {                                                         /* under 2^-14: subnormal */
        if (x < 0x33000000u) return (uint16_t)sign;                                /* under 2^-25: zero */
        const uint32_t e = x >> 23, m = (x & 0x7fffffu) | 0x800000u, shift = 126 - e;  /* value / 2^-24 = m >> shift */
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = x - 0x38000000u;  /* exponent 127 -> 15 bias */
    const uint32_t rem = r & 0x1fffu;
    r >>= 13;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;  /* (a carry moves into the exponent: still right) */
    return (uint16_t)(sign | r);
}

/* hd floats -> float16 at dst */
INLINE void store_half_row(uint16_t *restrict dst, const float *restrict x, int64_t hd) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= hd; j += 16)
        _mm256_storeu_si256((__m256i *)(dst + j), _mm512_cvtps_ph(_mm512_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  /* (where immintrin.h is included) */
    for (; j + 8 <= hd; j += 8)
        _mm_storeu_si128((__m128i *)(dst + j), _mm256_cvtps_ph(_mm256_loadu_ps(x + j), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; j < hd; j++) dst[j] = to_half(x[j]);
}

/* a vector of keys or values at element idx: float32, or float16 read exactly */
INLINE vec kv_load(const void *base, int64_t idx, const int HALF) {
    if (!HALF) return vload((const float *)base + idx);
    const uint16_t *h = (const uint16_t *)base + idx;
#if defined(__AVX512F__)
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#elif defined(__AVX2__) && defined(__FMA__)
    return q8_half8(h);
#else
    return q8_half(*h);
#endif
}

INLINE float kv_at(const void *base, int64_t idx, const int HALF) {
    return HALF ? q8_half(((const uint16_t *)base)[idx]) : ((const float *)base)[idx];
}

/* For the tests: to_half and store_half_row (this build's vector form) over x [n] */
void diffspec_half_round_check(const float *x, int64_t n, uint16_t *scalar, uint16_t *vector) {
    for (int64_t j = 0; j < n; j++) scalar[j] = to_half(x[j]);
    store_half_row(vector, x, n);
}

/* LANES vectors' horizontal sums as one vector: lane i is bitwise vsum(a[i]) (the same additions of the same pairs
 * in the same tree: lanes j and j + LANES/2 first, then halves again), found by transposing as it adds: LANES - 1
 * vector additions and two shuffles each, not LANES horizontal sums of log2(LANES) dependent steps. */
#if defined(__AVX512F__)
#define SCORE_BLOCK 16
#define SCORE_BLOCK_NV 8 /* heads of up to 8 vectors: 16 accumulators + the query + 2 of 32 registers */
#define VMAX_KEEP(s, t) _mm512_max_ps(s, t)
INLINE vec vsum_lanes(const vec *a) {
    /* vsum (GCC's _mm512_reduce_add_ps): t8 = hi 256 + lo 256; t4 = hi 128 + lo 128 of t8; t2[i] = t4[i] + t4[i + 2];
     * the sum t2[0] + t2[1]. Level 1: pairs of vectors to [a's t8 | b's t8]; level 2 to four t4s a vector; level 3
     * (within 128-bit lanes) to eight t2s; level 4 to the sixteen sums, vector q + 4r's in lane 4q + r. */
    vec l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; i++)
        l1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                              _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    for (int i = 0; i < 4; i++)  /* [A 0-7 | B 0-7], [C | D] -> [A 4-7 + A 0-3 | B | C | D] */
        l2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                              _mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)));
    for (int i = 0; i < 2; i++)  /* per 128-bit lane [X0 X1 Y0 Y1] + [X2 X3 Y2 Y3]: X of the first, Y of the second */
        l3[i] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const vec s = _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define SCORE_BLOCK 8
#define SCORE_BLOCK_NV 4 /* 8 accumulators + the query + 2 of 16 registers (8-vector heads would spill) */
#define VMAX_KEEP(s, t) _mm256_max_ps(s, t)
INLINE vec vsum_lanes(const vec *a) {
    /* vsum: t4 = lo 128 + hi 128; t2 = t4 + movehl(t4) (lanes i, i + 2); the sum t2[0] + t2[1] */
    vec l1[4], l2[2];
    for (int i = 0; i < 4; i++)  /* [A lo | B lo] + [A hi | B hi] */
        l1[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                              _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)  /* per 128-bit lane [X0 X1 Y0 Y1] + [X2 X3 Y2 Y3] */
        l2[i] = _mm256_add_ps(_mm256_shuffle_ps(l1[2 * i], l1[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(l1[2 * i], l1[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const vec s = _mm256_add_ps(_mm256_shuffle_ps(l2[0], l2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm256_shuffle_ps(l2[0], l2[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#else
#define SCORE_BLOCK 0  /* one lane: vsum is the value itself */
#endif
/* 0: scores four positions at a time, each by vsum (an A/B build; the same values) */
#ifndef ATTEND_TRANSPOSED
#define ATTEND_TRANSPOSED 1
#endif

/* One query row of one head over positions 0 .. last: softmax(q . k * scale) . v -> out[hd], with hd = NV vectors
 * (a compile-time count once inlined: the query and the output stay in registers). Each score is one chain of
 * multiply-adds over the vectors then a fixed horizontal sum (vsum's tree; SCORE_BLOCK positions a step through
 * vsum_lanes where the head is at most SCORE_BLOCK_NV vectors wide, the same values); the output sums the positions in order. */
INLINE void attend_vectors(const int NV, const int HALF, const float *restrict q, const void *restrict keys,
                           const void *restrict values, int64_t last, float scale, float *restrict scores,
                           float *restrict out) {
    vec qv[16], o[16];  /* (sized by the widest NV, not NV: an array of runtime size stayed in memory) */
    for (int c = 0; c < NV; c++) qv[c] = vload(q + c * LANES);
    float top = -INFINITY;
    int64_t p = 0;
#if SCORE_BLOCK
    if (ATTEND_TRANSPOSED && NV <= SCORE_BLOCK_NV) {  /* SCORE_BLOCK positions' scores a step, summed by vsum_lanes */
        const int64_t w = NV * LANES;
        const vec vscale = vset1(scale);
        vec vtop = vset1(-INFINITY);
        for (; p + SCORE_BLOCK <= last + 1; p += SCORE_BLOCK) {
            vec a[SCORE_BLOCK];
            for (int r = 0; r < SCORE_BLOCK; r++) {
                a[r] = vmul(qv[0], kv_load(keys, (p + r) * w, HALF));
                for (int c = 1; c < NV; c++) a[r] = vfma(qv[c], kv_load(keys, (p + r) * w + c * LANES, HALF), a[r]);
            }
            const vec sv = vmul(vsum_lanes(a), vscale);
            vstore(scores + p, sv);
            vtop = VMAX_KEEP(sv, vtop);  /* lane by lane sv > top ? sv : top (a NaN score keeps top) */
        }
        float tops[SCORE_BLOCK];
        vstore(tops, vtop);
        for (int r = 0; r < SCORE_BLOCK; r++) top = tops[r] > top ? tops[r] : top;
    }
#endif
    for (; p + 4 <= last + 1; p += 4) {  /* four positions side by side: four independent chains, each score the same */
        const int64_t k = p * NV * LANES, w = NV * LANES;
        vec a0 = vmul(qv[0], kv_load(keys, k, HALF)), a1 = vmul(qv[0], kv_load(keys, k + w, HALF));
        vec a2 = vmul(qv[0], kv_load(keys, k + 2 * w, HALF)), a3 = vmul(qv[0], kv_load(keys, k + 3 * w, HALF));
        for (int c = 1; c < NV; c++) {
            a0 = vfma(qv[c], kv_load(keys, k + c * LANES, HALF), a0);
            a1 = vfma(qv[c], kv_load(keys, k + w + c * LANES, HALF), a1);
            a2 = vfma(qv[c], kv_load(keys, k + 2 * w + c * LANES, HALF), a2);
            a3 = vfma(qv[c], kv_load(keys, k + 3 * w + c * LANES, HALF), a3);
        }
        const float s0 = vsum(a0) * scale, s1 = vsum(a1) * scale, s2 = vsum(a2) * scale, s3 = vsum(a3) * scale;
        scores[p] = s0, scores[p + 1] = s1, scores[p + 2] = s2, scores[p + 3] = s3;
        top = s0 > top ? s0 : top;
        top = s1 > top ? s1 : top;
        top = s2 > top ? s2 : top;
        top = s3 > top ? s3 : top;
    }
    for (; p <= last; p++) {
        const int64_t k = p * NV * LANES;
        vec acc = vmul(qv[0], kv_load(keys, k, HALF));
        for (int c = 1; c < NV; c++) acc = vfma(qv[c], kv_load(keys, k + c * LANES, HALF), acc);
        const float s = vsum(acc) * scale;
        scores[p] = s;
        top = s > top ? s : top;
    }
    const float inv = softmax_weights(scores, last, top);
    for (int c = 0; c < NV; c++) o[c] = vzero();
    for (p = 0; p <= last; p++) {
        const vec w = vset1(scores[p]);
        const int64_t v = p * NV * LANES;
        for (int c = 0; c < NV; c++) o[c] = vfma(w, kv_load(values, v + c * LANES, HALF), o[c]);
    }
    const vec vinv = vset1(inv);
    for (int c = 0; c < NV; c++) vstore(out + c * LANES, vmul(o[c], vinv));
}

/* The same for any head width (one model always takes the same one of the two: rows stay invariant). */
static void attend_any(const float *restrict q, const void *restrict keys, const void *restrict values,
                       int64_t last, int64_t hd, float scale, float *restrict scores, float *restrict out, int half) {
    float top = -INFINITY;
    for (int64_t p = 0; p <= last; p++) {
        float s = 0.0f;
        for (int64_t j = 0; j < hd; j++) s += q[j] * kv_at(keys, p * hd + j, half);
        s *= scale;
        scores[p] = s;
        top = s > top ? s : top;
    }
    const float inv = softmax_weights(scores, last, top);
    float acc[MAX_HEAD_DIM];
    for (int64_t j = 0; j < hd; j++) acc[j] = 0.0f;
    for (int64_t p = 0; p <= last; p++) {
        const float w = scores[p];
        for (int64_t j = 0; j < hd; j++) acc[j] += w * kv_at(values, p * hd + j, half);
    }
    for (int64_t j = 0; j < hd; j++) out[j] = acc[j] * inv;
}

/* keys and values float32 (half 0) or float16 (half 1), [positions, hd] of one head */
static void attend(const float *restrict q, const void *restrict keys, const void *restrict values, int64_t last,
                   int64_t hd, float scale, float *restrict scores, float *restrict out, int half) {
#define NV_CASE(NV) case NV: \
    half ? attend_vectors(NV, 1, q, keys, values, last, scale, scores, out) \
         : attend_vectors(NV, 0, q, keys, values, last, scale, scores, out); \
    return;
    if (hd % LANES == 0) switch (hd / LANES) { NV_CASE(1) NV_CASE(2) NV_CASE(4) NV_CASE(8) NV_CASE(16) }
#undef NV_CASE
    attend_any(q, keys, values, last, hd, scale, scores, out, half);
}

/* What one layer holds: a table of LAYER_FIELDS addresses per layer (fused_layers.py builds it). */
enum { IN_NORM, QKV_CODES, QKV_SCALES, QKV_OFFSETS, O_CODES, O_SCALES, O_OFFSETS, POST_NORM, GU_CODES, GU_SCALES,
       GU_OFFSETS, DOWN_CODES, DOWN_SCALES, DOWN_OFFSETS, K_CACHE, V_CACHE, CAPACITY, LAYER_FIELDS };

int64_t diffspec_fused_layer_fields(void) { return LAYER_FIELDS; }
int64_t diffspec_fused_max_head_dim(void) { return MAX_HEAD_DIM; }

/* Every decoder layer over n rows at positions start .. start + n - 1.
 * h [n, D]: the embeddings in, the last layer's output out (before the final norm). cos, sin [n, hd]: the rotary
 * tables of those positions. Each layer's cache: keys and values [KV, capacity, hd], rows written at start + i.
 * hidden [L, n, D] (or NULL): each layer's output. work: at least fused_work_floats(...) floats. */
INLINE int64_t xq_floats(int64_t n, int64_t D, int64_t H, int64_t hd, int64_t F) {  /* the quantized rows' buffer */
    /* the largest of the three inputs' rows (a row's bytes do not grow with its width: 480 inputs, 15 blocks in 8
     * pairs, take more than 512, one group) */
    int64_t row = diffspec_q8_xrow_bytes(D);
    row = diffspec_q8_xrow_bytes(H * hd) > row ? diffspec_q8_xrow_bytes(H * hd) : row;
    row = diffspec_q8_xrow_bytes(F) > row ? diffspec_q8_xrow_bytes(F) : row;
    return (n * row + 63) / 4 + 16;
}

int64_t diffspec_fused_work_floats(int64_t n, int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t F,
                                   int64_t positions, int threads) {
    return n * D + n * (H + 2 * KV) * hd + n * H * hd + n * 2 * F + n * F + (int64_t)threads * positions
           + xq_floats(n, D, H, hd, F);
}

/* One decoder layer over n rows at positions start .. start + n - 1 (t: its table row). h [n, D]: the residual
 * stream, updated in place. xn, qkv, att, gu, act, scores, xq: diffspec_fused_work_floats' parts.
 * qk_norm: NULL (the target: Llama), or (H + KV) rows of hd floats, each query head's then each key head's RMSNorm
 * weight, applied to that head's row before the rotary embedding (Qwen3's, and the conditioned drafter's).
 * block: 0, row i attends to positions 0 .. start + i (causal: the target); 1, every row to 0 .. start + n - 1 (a
 * drafter's block: its rows see each other). With qk_norm NULL and block 0 this is the target's layer exactly as
 * before the drafter's pass shared it (the same operations in the same order). */
INLINE void decoder_layer(const int64_t *t, int64_t n, int64_t start, int64_t D, int64_t H, int64_t KV, int64_t hd,
                          int64_t F, float eps, float scale, const float *cos, const float *sin, float *h, float *xn,
                          float *qkv, float *att, float *gu, float *act, float *scores, uint8_t *xq, int threads,
                          const float *qk_norm, int block, int kv_half) {
    const int64_t QKV = (H + 2 * KV) * hd, group = H / KV, positions = start + n;
    const int64_t cap = t[CAPACITY];
    float *kc = (float *)t[K_CACHE], *vc = (float *)t[V_CACHE];
    uint16_t *kh = (uint16_t *)t[K_CACHE], *vh = (uint16_t *)t[V_CACHE];  /* (kv_half: the cache holds float16) */
    for (int64_t i = 0; i < n; i++) rms_norm(h + i * D, (const float *)t[IN_NORM], D, eps, xn + i * D);
    linear(xn, n, D, (const void *)t[QKV_CODES], (const float *)t[QKV_SCALES], (const float *)t[QKV_OFFSETS], QKV,
           qkv, threads, xq);
    for (int64_t i = 0; i < n; i++) {
        float *row = qkv + i * QKV;
        for (int64_t j = 0; j < H + KV; j++) {
            if (qk_norm) rms_norm(row + j * hd, qk_norm + j * hd, hd, eps, row + j * hd);
            rotate(row + j * hd, cos + i * hd, sin + i * hd, hd);
        }
        for (int64_t g = 0; g < KV; g++) {
            if (kv_half) {
                store_half_row(kh + (g * cap + start + i) * hd, row + (H + g) * hd, hd);
                store_half_row(vh + (g * cap + start + i) * hd, row + (H + KV + g) * hd, hd);
            } else {
                memcpy(kc + (g * cap + start + i) * hd, row + (H + g) * hd, hd * sizeof(float));
                memcpy(vc + (g * cap + start + i) * hd, row + (H + KV + g) * hd, hd * sizeof(float));
            }
        }
    }
    /* (row, head) pairs among the threads: each computed alone, by the same code, whichever thread runs it */
#pragma omp parallel for schedule(static) num_threads(threads) if (n * H * positions > 1024)
    for (int64_t ji = 0; ji < n * H; ji++) {  /* a head's rows in turn: its keys and values stay in cache */
        const int64_t j = ji / n, i = ji % n, g = j / group;
        float *sc = scores;
#ifdef _OPENMP
        sc += (int64_t)omp_get_thread_num() * positions;
#endif
        const void *keys = kv_half ? (const void *)(kh + g * cap * hd) : (const void *)(kc + g * cap * hd);
        const void *values = kv_half ? (const void *)(vh + g * cap * hd) : (const void *)(vc + g * cap * hd);
        attend(qkv + i * QKV + j * hd, keys, values, block ? positions - 1 : start + i, hd, scale, sc,
               att + (i * H + j) * hd, kv_half);
    }
    linear(att, n, H * hd, (const void *)t[O_CODES], (const float *)t[O_SCALES], (const float *)t[O_OFFSETS], D,
           xn, threads, xq);
    for (int64_t e = 0; e < n * D; e++) h[e] = h[e] + xn[e];
    for (int64_t i = 0; i < n; i++) rms_norm(h + i * D, (const float *)t[POST_NORM], D, eps, xn + i * D);
    linear(xn, n, D, (const void *)t[GU_CODES], (const float *)t[GU_SCALES], (const float *)t[GU_OFFSETS], 2 * F,
           gu, threads, xq);
    for (int64_t i = 0; i < n; i++) silu_times(gu + i * 2 * F, gu + i * 2 * F + F, act + i * F, F);
    linear(act, n, F, (const void *)t[DOWN_CODES], (const float *)t[DOWN_SCALES], (const float *)t[DOWN_OFFSETS],
           D, xn, threads, xq);
    for (int64_t e = 0; e < n * D; e++) h[e] = h[e] + xn[e];
}

/* the work buffer's parts, in diffspec_fused_work_floats' order; xq 64-byte aligned where q8 (else NULL) */
#define WORK_PARTS(n, D, H, KV, hd, F, positions, threads, q8)                                                    \
    float *xn = work, *qkv = xn + (n) * (D), *att = qkv + (n) * ((H) + 2 * (KV)) * (hd), *gu = att + (n) * (H) * (hd), \
          *act = gu + (n) * 2 * (F), *scores = act + (n) * (F);                                                      \
    uint8_t *xq = (q8) ? (uint8_t *)(((uintptr_t)(scores + (int64_t)(threads) * (positions)) + 63) & ~(uintptr_t)63) \
                       : NULL;

void diffspec_fused_layers(int64_t L, const int64_t *table, int64_t n, int64_t start, int64_t D, int64_t H,
                           int64_t KV, int64_t hd, int64_t F, float eps, float scale, const float *cos,
                           const float *sin, float *h, float *hidden, float *work, int threads, int q8,
                           const float *final_norm, float final_eps, float *normed, int kv_half) {
    /* q8: the table's codes are q8_linear.c's layout; the activations are quantized into xq. final_norm (or NULL):
     * the model's final RMSNorm weight [D]: its rows of h go to normed [n, D] (the same rms_norm as the layers'; a
     * torch call for it cost ~0.2 ms a step, its code out of cache after the weights stream through). kv_half: the
     * caches hold float16 keys and values (written rounded to nearest even, read exactly) */
    WORK_PARTS(n, D, H, KV, hd, F, start + n, threads, q8)
    for (int64_t l = 0; l < L; l++) {
        decoder_layer(table + l * LAYER_FIELDS, n, start, D, H, KV, hd, F, eps, scale, cos, sin, h, xn, qkv, att, gu,
                      act, scores, xq, threads, NULL, 0, kv_half);
        if (hidden) memcpy(hidden + l * n * D, h, n * D * sizeof(float));
    }
    if (final_norm)
        for (int64_t i = 0; i < n; i++) rms_norm(h + i * D, final_norm, D, final_eps, normed + i * D);
}

/* The conditioned drafter's block (drafters/conditioned_fused.py): its layers over the block's n rows at positions
 * start .., every row attending to the context's keys and values (positions 0 .. start - 1, already in the caches)
 * and to the whole block; the block's own keys and values are written at start .. start + n - 1 (scratch: the
 * caller does not advance its length). qk_norms: L addresses, each layer's (H + KV) x hd q/k norm weights. Then
 * the final norm: h [n, D] holds the block's states in, its normed output out. work: diffspec_fused_work_floats. */
void diffspec_block_layers(int64_t L, const int64_t *table, const int64_t *qk_norms, int64_t n, int64_t start,
                           int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t F, float eps, float scale,
                           const float *cos, const float *sin, const float *final_norm, float *h, float *work,
                           int threads, int q8) {
    WORK_PARTS(n, D, H, KV, hd, F, start + n, threads, q8)
    for (int64_t l = 0; l < L; l++)
        decoder_layer(table + l * LAYER_FIELDS, n, start, D, H, KV, hd, F, eps, scale, cos, sin, h, xn, qkv, att, gu,
                      act, scores, xq, threads, (const float *)qk_norms[l], 1, 0);
    for (int64_t i = 0; i < n; i++) {
        rms_norm(h + i * D, final_norm, D, eps, xn + i * D);
        memcpy(h + i * D, xn + i * D, D * sizeof(float));
    }
}

/* What the context's call needs: m rows of the features' width FI, of the hidden width D, and of 2 KV hd. */
int64_t diffspec_block_context_work_floats(int64_t m, int64_t FI, int64_t D, int64_t KV, int64_t hd) {
    int64_t row = diffspec_q8_xrow_bytes(FI);
    row = diffspec_q8_xrow_bytes(D) > row ? diffspec_q8_xrow_bytes(D) : row;
    return m * D + m * 2 * KV * hd + (m * row + 63) / 4 + 16;
}

/* The target's features of m positions start .. -> the drafter's context keys and values in every layer's cache
 * (conditioned_pass.context_into_cache's arithmetic): ctx = RMSNorm(features @ fc^T) with hidden_norm; per layer,
 * [k, v] = ctx @ kv^T, k normed per key head (k_norms[l]: hd floats) and rotated, both written at their positions.
 * kv_codes / kv_scales: L addresses each, the layer's key and value rows (q8_linear.c's layout where q8). */
void diffspec_block_context(int64_t L, const int64_t *table, const int64_t *kv_codes, const int64_t *kv_scales,
                            const int64_t *k_norms, int64_t m, int64_t start, int64_t FI, int64_t D, int64_t KV,
                            int64_t hd, const void *fc_codes, const float *fc_scales, const float *hidden_norm,
                            float eps, const float *cos, const float *sin, const float *features, float *work,
                            int threads, int q8) {
    float *ctx = work, *kv = ctx + m * D;
    uint8_t *xq = q8 ? (uint8_t *)(((uintptr_t)(kv + m * 2 * KV * hd) + 63) & ~(uintptr_t)63) : NULL;
    linear(features, m, FI, fc_codes, fc_scales, NULL, D, ctx, threads, xq);
    for (int64_t i = 0; i < m; i++) rms_norm(ctx + i * D, hidden_norm, D, eps, ctx + i * D);
    for (int64_t l = 0; l < L; l++) {
        const int64_t *t = table + l * LAYER_FIELDS;
        const int64_t cap = t[CAPACITY];
        float *kc = (float *)t[K_CACHE], *vc = (float *)t[V_CACHE];
        linear(ctx, m, D, (const void *)kv_codes[l], (const float *)kv_scales[l], NULL, 2 * KV * hd, kv, threads, xq);
        for (int64_t i = 0; i < m; i++) {
            float *row = kv + i * 2 * KV * hd;
            for (int64_t g = 0; g < KV; g++) {
                rms_norm(row + g * hd, (const float *)k_norms[l], hd, eps, row + g * hd);
                rotate(row + g * hd, cos + i * hd, sin + i * hd, hd);
                memcpy(kc + (g * cap + start + i) * hd, row + g * hd, hd * sizeof(float));
                memcpy(vc + (g * cap + start + i) * hd, row + (KV + g) * hd, hd * sizeof(float));
            }
        }
    }
}

/* make-data's batched decode step (training/batch_step.py, on a CPU): one query row per (row b, head j) over
 * positions first[b] .. last of row b's keys and values, each [B, KV, cap, hd] (heads j of a group share key/value
 * head j / (H / KV)). q [B, H, hd] (not yet scaled), out [B, H, hd], scores: threads * (last + 1) floats.
 * torch's matmul/SDPA read the shared keys at a third of the memory's speed here (a 64-row step of SmolLM2: ~4 ms
 * a layer for 35 MB); this reads each row's keys and values once from memory for the heads that share them. */
void diffspec_batch_attend(int64_t B, int64_t H, int64_t KV, int64_t hd, int64_t cap, const int64_t *first,
                           int64_t last, float scale, const float *q, const float *keys, const float *values,
                           float *out, float *scores, int threads) {
    const int64_t group = H / KV, positions = last + 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t bj = 0; bj < B * H; bj++) {  /* a row's heads in turn: the heads of a group read the same keys */
        const int64_t b = bj / H, j = bj % H, g = j / group, f = first[b];
        float *sc = scores;
#ifdef _OPENMP
        sc += (int64_t)omp_get_thread_num() * positions;
#endif
        const int64_t base = ((b * KV + g) * cap + f) * hd;
        attend(q + bj * hd, keys + base, values + base, last - f, hd, scale, sc, out + bj * hd, 0);
    }
}
