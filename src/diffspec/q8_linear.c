/* Linear layers over GGUF codes with the activations quantized to 8 bits, as llama.cpp computes them
 * (q8_linear.py; the target's --kernels q8).
 *
 * packed_linear.c decodes every weight into float32 and multiplies in float32, so a wide verify pass is bound by
 * float32 multiply-adds (~70% of the measured peak at 30 rows). Here each row of x is cut in blocks of 32 and
 * quantized per block to signed 8-bit codes, x ~ dx * xq (dx = max|x| / 127, xq = round(x * (1 / dx))); each block's
 * dot product with a weight block is then an integer sum (AVX-512 VNNI: 64 byte products an instruction):
 *   Q4_1 weight  w = dw * q + m   :  sum_k w_k x_k ~ (dw * dx) * sum_k q_k xq_k  +  m * (dx * sum_k xq_k)
 *   Q8_0 weight  w = dw * q       :  sum_k w_k x_k ~ (dw * dx) * sum_k q_k xq_k
 * The integer sums are exact; only x's rounding to 8 bits (a relative ~0.4% a value) separates the result from
 * the float32 one: a different target arithmetic (llama.cpp's), not a faster order of the same one. So it is an
 * option of the target, used by every pass (plain decoding too), never chosen per width.
 *
 * Exactness that speculation rests on. Each row of x is quantized alone, and every output (r, n) is computed by
 * the same operations in the same order whatever the number of rows: 16 float lanes, each accumulated in turn
 * over the weight's blocks (lane = one block of a group of 16, or a quarter of a block of a trailing pair), then
 * the lanes summed in one fixed tree. The AVX-512 VNNI, AVX2 and scalar builds run those same float operations
 * lane by lane (explicit fused multiply-adds), and the integer sums are exact on every build: the three builds
 * give bitwise the same outputs (tested).
 *
 * Layouts (q8_linear.py writes the weights'; q8_quantize the activations'). A row's nb blocks are G = nb / 16
 * groups of 16 blocks, then P = ceil((nb % 16) / 2) pairs of blocks (an odd block paired with a zero block).
 *   weights, per row: a group is 4 (Q4) or 8 (Q8) chunks of 64 bytes; chunk c holds, for each of the group's 16
 *     blocks in turn, 4 bytes: Q4: byte u = code (4c + u) | code (16 + 4c + u) << 4; Q8: code (4c + u) + 128.
 *     A pair is 32 (Q4) or 64 (Q8) bytes: Q4: block A's 16 bytes then B's (as in the GGUF: byte j = code j |
 *     code j + 16 << 4); Q8: A's codes 0-15, B's 0-15, A's 16-31, B's 16-31 (each + 128).
 *     Scales dw and offsets m: nb float16 a row (GGUF's own fields: a Q8_0 block's d, a Q4_1 block's d and m), read
 *     into float32 exactly. Half the bytes of float32, and no padding: with the codes, a row streams what the GGUF
 *     holds (SmolLM2's Q4_1 rows of 576: 360 bytes, not 544), which is what a one-row step is bound by.
 *   activations, per row (XROW_BYTES): a group is 8 chunks of 64 bytes, chunk c = positions 4c .. 4c + 3 of each
 *     block; a pair is A's 0-15, B's 0-15, A's 16-31, B's 16-31; then float dx[S], float sx[S] (dx * sum xq),
 *     int32 corr[16 * (G + P)] (128 * the sum of the xq a lane reads: a Q8 weight's + 128 taken back),
 *     S = 16 * (G + ceil(P / 8)). */

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define QBLOCK 32
#define QLANES 16
#define QINLINE static inline __attribute__((always_inline))

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define Q8_ISA "avx512vnni"
#elif defined(__AVX2__) && defined(__FMA__)
#define Q8_ISA "avx2"
#else
#define Q8_ISA "scalar"
#endif

const char *diffspec_q8_isa(void) { return Q8_ISA; }

/* sizes of the layouts above */
QINLINE int64_t q8_groups(int64_t K) { return K / QBLOCK / 16; }
QINLINE int64_t q8_pairs(int64_t K) { return ((K / QBLOCK) % 16 + 1) / 2; }
QINLINE int64_t q8_scale_count(int64_t K) { return 16 * (q8_groups(K) + (q8_pairs(K) + 7) / 8); }
QINLINE int64_t q8_code_bytes(int64_t K) { return (q8_groups(K) * 16 + 2 * q8_pairs(K)) * QBLOCK; }
int64_t diffspec_q8_scale_count(int64_t K) { return q8_scale_count(K); }
int64_t diffspec_q8_xrow_bytes(int64_t K) {
    return q8_code_bytes(K) + 2 * 4 * q8_scale_count(K) + 4 * 16 * (q8_groups(K) + q8_pairs(K));
}

/* 1 / d, or 0 where d is 0 or so small that 1 / d overflows (a block of values under ~4e-37: its codes are 0) */
QINLINE float q8_inverse(float d) {
    const float inv = 1.0f / d;
    return d > 0.0f && inv <= FLT_MAX ? inv : 0.0f;
}

/* x [R, K] float32 -> xq [R, xrow_bytes]: each block of 32 to codes round(x * (1 / dx)) (to nearest, ties to even),
 * dx = max|x| / 127 (a block of zeros: dx 0, codes 0): the same values on every build (rows among `threads`). */
void diffspec_q8_quantize(const float *x, int64_t R, int64_t K, uint8_t *out, int threads) {
    const int64_t nb = K / QBLOCK, G = q8_groups(K), S = q8_scale_count(K), xrow = diffspec_q8_xrow_bytes(K);
    const int64_t code_bytes = q8_code_bytes(K);
#pragma omp parallel for schedule(static) num_threads(threads) if (R * K >= 8192)
    for (int64_t r = 0; r < R; r++) {
        uint8_t *row = out + r * xrow;
        int8_t *codes = (int8_t *)row;
        float *dx = (float *)(row + code_bytes), *sx = dx + S;
        int32_t *corr = (int32_t *)(sx + S);
        memset(row, 0, (size_t)xrow);
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * K + b * QBLOCK;
            int8_t q[QBLOCK];
            int32_t total = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
            /* the same operations as the plain C below: max |x|, one division, x * id rounded to nearest even */
            const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
            const float d = amax / 127.0f, id = q8_inverse(d);
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(q1));
            total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(__AVX2__) && defined(__FMA__)
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 v[4], vmax = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_loadu_ps(xb + 8 * j);
                vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v[j]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            const float d = amax / 127.0f, id = q8_inverse(d);
            int32_t qi[QBLOCK];
            for (int j = 0; j < 4; j++)
                _mm256_storeu_si256((__m256i *)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(id))));
            for (int j = 0; j < QBLOCK; j++) {
                q[j] = (int8_t)qi[j];
                total += qi[j];
            }
#else
            float amax = 0.0f;
            for (int j = 0; j < QBLOCK; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float d = amax / 127.0f, id = q8_inverse(d);
            for (int j = 0; j < QBLOCK; j++) {
                q[j] = (int8_t)nearbyintf(xb[j] * id);
                total += q[j];
            }
#endif
            dx[b] = d;
            sx[b] = d * (float)total;
            if (b < 16 * G) {  /* in a group: chunk c of the group holds positions 4c..4c+3 of each block */
                const int64_t g = b / 16, t = b % 16;
                for (int c = 0; c < 8; c++) memcpy(codes + g * 512 + c * 64 + t * 4, q + 4 * c, 4);
                corr[g * 16 + t] = 128 * total;
            } else {           /* in a pair: A 0-15, B 0-15, A 16-31, B 16-31; lanes 0-3 A, 4-7 B, 8-11 A, 12-15 B */
                const int64_t p = (b - 16 * G) / 2, side = (b - 16 * G) % 2;
                int8_t *pc = codes + G * 512 + p * 64;
                for (int j = 0; j < 16; j++) {
                    pc[side * 16 + j] = q[j];
                    pc[32 + side * 16 + j] = q[16 + j];
                }
                for (int l = 0; l < 4; l++) {
                    int32_t s0 = 0, s1 = 0;
                    for (int u = 0; u < 4; u++) {
                        s0 += q[4 * l + u];
                        s1 += q[16 + 4 * l + u];
                    }
                    corr[(G + p) * 16 + side * 4 + l] = 128 * s0;
                    corr[(G + p) * 16 + 8 + side * 4 + l] = 128 * s1;
                }
            }
        }
    }
}

/* IEEE binary16 -> float32, exactly (every half is a float): the plain C of F16C's conversion */
QINLINE float q8_half(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 31u, mantissa = h & 1023u;
    union { uint32_t u; float f; } v;
    if (exponent == 31) {
        v.u = sign | 0x7f800000u | (mantissa << 13);             /* infinity, NaN */
    } else if (exponent) {
        v.u = sign | ((exponent + 112) << 23) | (mantissa << 13);  /* normal: rebias 15 -> 127 */
    } else {
        v.f = (float)mantissa * 0x1p-24f;                         /* zero, subnormal: mantissa * 2^-24, exact */
        v.u |= sign;
    }
    return v.f;
}

/* block b's scale (or offset) of a row of nb, 0 for the zero block closing an odd pair (b == nb) */
QINLINE float q8_half_at(const uint16_t *h, int64_t b, int64_t nb) { return b < nb ? q8_half(h[b]) : 0.0f; }

/* The 16 lanes' fixed summation tree (the same on every build). */
QINLINE float q8_lane_sum(const float *a) {
    float s8[8], s4[4];
    for (int i = 0; i < 8; i++) s8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* the lane of a pair's scale: lanes 0-3 and 8-11 read block A (index 2p), 4-7 and 12-15 block B */
QINLINE int q8_pair_lane_block(int p, int lane) { return 2 * (p % 8) + ((lane / 4) & 1); }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
typedef __m512 f16v;
/* One output per x row of the group: weight row (codes wq, scales dw, offsets m or NULL) against G quantized rows. */
QINLINE void q8_rows(const int Q4, const int G, const uint8_t *wq, const uint16_t *dw, const uint16_t *m,
                     const uint8_t *xq, int64_t xrow, int64_t K, float *y, int64_t N) {
    const int64_t NG = q8_groups(K), NP = q8_pairs(K), S = q8_scale_count(K), code_bytes = q8_code_bytes(K);
    const int64_t wgroup = Q4 ? 256 : 512, wpair = Q4 ? 32 : 64;
    __m512 acc[8];
    for (int i = 0; i < G; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t g = 0; g < NG; g++) {
        __m512i w[8];
        for (int c = 0; c < (Q4 ? 4 : 8); c++) {
            const __m512i v = _mm512_loadu_si512((const void *)(wq + g * wgroup + c * 64));
            if (Q4) {
                w[c] = _mm512_and_si512(v, low);
                w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            } else {
                w[c] = v;
            }
        }
        const __m512 dwv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dw + g * 16)));
        const __m512 mv = Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + g * 16))) : _mm512_setzero_ps();
        for (int i = 0; i < G; i++) {
            const uint8_t *xr = xq + i * xrow;
            __m512i s = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();  /* two chains: half the latency */
            for (int c = 0; c < 8; c += 2) {
                s = _mm512_dpbusd_epi32(s, w[c], _mm512_loadu_si512((const void *)(xr + g * 512 + c * 64)));
                s2 = _mm512_dpbusd_epi32(s2, w[c + 1], _mm512_loadu_si512((const void *)(xr + g * 512 + c * 64 + 64)));
            }
            s = _mm512_add_epi32(s, s2);
            const float *dx = (const float *)(xr + code_bytes), *sx = dx + S;
            if (!Q4) s = _mm512_sub_epi32(s, _mm512_loadu_si512((const void *)((const int32_t *)(sx + S) + g * 16)));
            const __m512 scale = _mm512_mul_ps(dwv, _mm512_loadu_ps(dx + g * 16));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[i]);
            if (Q4) acc[i] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(sx + g * 16), acc[i]);
        }
    }
    if (NP) {  /* the trailing pairs (at most 8): their blocks' scales are one vector, lanes picked per pair */
        const int64_t sbase = 16 * NG;
        /* the row's last nb - 16 NG halves, zeros past them (the odd pair's zero block; no read past the row) */
        const __mmask32 real = (__mmask32)((1u << (K / QBLOCK - sbase)) - 1u);
        const __m512 dwt = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(real, dw + sbase)));
        const __m512 mt = Q4 ? _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(real, m + sbase)))
                             : _mm512_setzero_ps();
        for (int64_t p = 0; p < NP; p++) {
            __m512i w;
            if (Q4) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wq + NG * wgroup + p * wpair));
                const __m256i l4 = _mm256_set1_epi8(15);
                w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, l4)),
                                       _mm256_and_si256(_mm256_srli_epi16(v, 4), l4), 1);
            } else {
                w = _mm512_loadu_si512((const void *)(wq + NG * wgroup + p * wpair));
            }
            /* lanes 0-3 and 8-11 read block A = 2p, lanes 4-7 and 12-15 block B = 2p + 1 */
            const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(2 * (int)p),
                                                 _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1));
            const __m512 dwv = _mm512_permutexvar_ps(idx, dwt), mv = _mm512_permutexvar_ps(idx, mt);
            for (int i = 0; i < G; i++) {
                const uint8_t *xr = xq + i * xrow;
                __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w,
                                                _mm512_loadu_si512((const void *)(xr + NG * 512 + p * 64)));
                const float *dx = (const float *)(xr + code_bytes), *sx = dx + S;
                if (!Q4) s = _mm512_sub_epi32(s, _mm512_loadu_si512((const void *)((const int32_t *)(sx + S) + (NG + p) * 16)));
                const __m512 scale = _mm512_mul_ps(dwv, _mm512_permutexvar_ps(idx, _mm512_loadu_ps(dx + sbase)));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[i]);
                /* a pair's offsets: each block's m * sx once, on its first lane (0 or 4; the others add m * 0) */
                if (Q4) acc[i] = _mm512_fmadd_ps(mv, _mm512_maskz_permutexvar_ps(0x0011, idx, _mm512_loadu_ps(sx + sbase)), acc[i]);
            }
        }
    }
    for (int i = 0; i < G; i++) {  /* q8_lane_sum's tree in registers */
        const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc[i]), _mm512_extractf32x8_ps(acc[i], 1));
        const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
        const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));   /* s4[0] + s4[2], s4[1] + s4[3] */
        y[i * N] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
    }
}
#define Q8_ROW_GROUP 8

#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2: the 16 lanes as two vectors of 8 (lanes 0-7, 8-15), up to 4 rows sharing each unpacked chunk of weights.
 * Byte products through maddubs (unsigned x signed, pairs summed to 16 bits) and madd (to 32 bits): exact for Q4
 * codes (|pair| <= 2 * 15 * 127); a Q8 weight goes as |w| times x with w's sign (|pair| <= 2 * 128 * 127), so its
 * sums are the signed ones directly (the VNNI build subtracts the + 128 instead: the same integers). */
QINLINE __m256i q8_dot_u(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

/* 8 float16 scales as float32 (F16C where the build has it: the same values) */
QINLINE __m256 q8_half8(const uint16_t *h) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
#else
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = q8_half(h[i]);
    return _mm256_loadu_ps(f);
#endif
}

QINLINE void q8_rows(const int Q4, const int G, const uint8_t *wq, const uint16_t *dw, const uint16_t *m,
                     const uint8_t *xq, int64_t xrow, int64_t K, float *y, int64_t N) {
    const int64_t NG = q8_groups(K), NP = q8_pairs(K), S = q8_scale_count(K), code_bytes = q8_code_bytes(K);
    const int64_t wgroup = Q4 ? 256 : 512, wpair = Q4 ? 32 : 64;
    const __m256i l4 = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[8][2];
    for (int i = 0; i < G; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < NG; g++) {
        __m256i s[8][2];
        for (int i = 0; i < G; i++) s[i][0] = s[i][1] = _mm256_setzero_si256();
        for (int c = 0; c < (Q4 ? 4 : 8); c++) {
            const uint8_t *wc = wq + g * wgroup + c * 64;
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)wc), v1 = _mm256_loadu_si256((const __m256i *)(wc + 32));
            if (Q4) {
                const __m256i lo0 = _mm256_and_si256(v0, l4), lo1 = _mm256_and_si256(v1, l4);
                const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), l4);
                const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), l4);
                for (int i = 0; i < G; i++) {
                    const uint8_t *xr = xq + i * xrow + g * 512;
                    s[i][0] = _mm256_add_epi32(s[i][0], q8_dot_u(lo0, _mm256_loadu_si256((const __m256i *)(xr + c * 64))));
                    s[i][1] = _mm256_add_epi32(s[i][1], q8_dot_u(lo1, _mm256_loadu_si256((const __m256i *)(xr + c * 64 + 32))));
                    s[i][0] = _mm256_add_epi32(s[i][0], q8_dot_u(hi0, _mm256_loadu_si256((const __m256i *)(xr + (c + 4) * 64))));
                    s[i][1] = _mm256_add_epi32(s[i][1], q8_dot_u(hi1, _mm256_loadu_si256((const __m256i *)(xr + (c + 4) * 64 + 32))));
                }
            } else {
                const __m256i w0 = _mm256_xor_si256(v0, flip), w1 = _mm256_xor_si256(v1, flip);  /* signed codes */
                const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);      /* |w| */
                for (int i = 0; i < G; i++) {
                    const uint8_t *xr = xq + i * xrow + g * 512;
                    s[i][0] = _mm256_add_epi32(s[i][0], q8_dot_u(a0, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xr + c * 64)), w0)));
                    s[i][1] = _mm256_add_epi32(s[i][1], q8_dot_u(a1, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xr + c * 64 + 32)), w1)));
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 dwv = q8_half8(dw + g * 16 + 8 * h);
            const __m256 mv = Q4 ? q8_half8(m + g * 16 + 8 * h) : _mm256_setzero_ps();
            for (int i = 0; i < G; i++) {
                const float *dx = (const float *)(xq + i * xrow + code_bytes), *sx = dx + S;
                const __m256 scale = _mm256_mul_ps(dwv, _mm256_loadu_ps(dx + g * 16 + 8 * h));
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][h]), scale, acc[i][h]);
                if (Q4) acc[i][h] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(sx + g * 16 + 8 * h), acc[i][h]);
            }
        }
    }
    const int64_t sbase = 16 * NG, nb = K / QBLOCK;
    for (int64_t p = 0; p < NP; p++) {  /* lanes 0-3 (and 8-11) read block A = 2p, lanes 4-7 (and 12-15) block B */
        const uint8_t *wp = wq + NG * wgroup + p * wpair;
        const int64_t A = sbase + 2 * p, B = A + 1;  /* B == nb: the zero block closing an odd pair */
        __m256i w0, w1;
        if (Q4) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)wp);
            w0 = _mm256_and_si256(v, l4);
            w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), l4);
        } else {
            w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)wp), flip);
            w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wp + 32)), flip);
        }
        const __m256 dwv = _mm256_set_m128(_mm_set1_ps(q8_half_at(dw, B, nb)), _mm_set1_ps(q8_half(dw[A])));
        const __m256 mv = Q4 ? _mm256_set_m128(_mm_set1_ps(q8_half_at(m, B, nb)), _mm_set1_ps(q8_half(m[A])))
                             : _mm256_setzero_ps();
        for (int i = 0; i < G; i++) {
            const uint8_t *xp = xq + i * xrow + NG * 512 + p * 64;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)xp), x1 = _mm256_loadu_si256((const __m256i *)(xp + 32));
            const __m256i s0 = Q4 ? q8_dot_u(w0, x0) : q8_dot_u(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0));
            const __m256i s1 = Q4 ? q8_dot_u(w1, x1) : q8_dot_u(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1));
            const float *dx = (const float *)(xq + i * xrow + code_bytes), *sx = dx + S;
            const __m256 scale = _mm256_mul_ps(dwv, _mm256_set_m128(_mm_set1_ps(dx[B]), _mm_set1_ps(dx[A])));
            acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), scale, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), scale, acc[i][1]);
            if (Q4) {  /* each block's m * sx once, on its first lane (0 or 4); m * 0 on the others, as the VNNI build */
                acc[i][0] = _mm256_fmadd_ps(mv, _mm256_setr_ps(sx[A], 0, 0, 0, sx[B], 0, 0, 0), acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(mv, _mm256_setzero_ps(), acc[i][1]);
            }
        }
    }
    for (int i = 0; i < G; i++) {  /* q8_lane_sum's tree in registers */
        const __m256 s8 = _mm256_add_ps(acc[i][0], acc[i][1]);
        const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
        const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        y[i * N] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
    }
}
#define Q8_ROW_GROUP 4

#else
/* Plain C: the same 16 lanes, one x row at a time; integer sums exact, the float operations lane by lane. */
QINLINE int32_t q8_dot4(const uint8_t *w, const int8_t *x, int signed_w) {
    int32_t s = 0;
    for (int u = 0; u < 4; u++) s += (signed_w ? (int32_t)(int8_t)(w[u] ^ 0x80) : (int32_t)w[u]) * (int32_t)x[u];
    return s;
}

QINLINE void q8_rows(const int Q4, const int G, const uint8_t *wq, const uint16_t *dw, const uint16_t *m,
                     const uint8_t *xq, int64_t xrow, int64_t K, float *y, int64_t N) {
    const int64_t NG = q8_groups(K), NP = q8_pairs(K), S = q8_scale_count(K), code_bytes = q8_code_bytes(K);
    const int64_t wgroup = Q4 ? 256 : 512, wpair = Q4 ? 32 : 64;
    for (int i = 0; i < G; i++) {
        const uint8_t *xr = xq + i * xrow;
        const float *dx = (const float *)(xr + code_bytes), *sx = dx + S;
        float acc[16] = {0};
        int32_t s[16];
        for (int64_t g = 0; g < NG; g++) {
            const uint8_t *wg = wq + g * wgroup;
            const int8_t *xg = (const int8_t *)(xr + g * 512);
            for (int t = 0; t < 16; t++) {
                s[t] = 0;
                for (int c = 0; c < 8; c++) {
                    uint8_t wb[4];
                    for (int u = 0; u < 4; u++) {
                        const uint8_t byte = wg[(Q4 ? (c % 4) : c) * 64 + t * 4 + u];
                        wb[u] = Q4 ? (c < 4 ? byte & 15 : byte >> 4) : byte;
                    }
                    s[t] += q8_dot4(wb, xg + c * 64 + t * 4, !Q4);
                }
            }
            for (int t = 0; t < 16; t++) {
                const float scale = q8_half(dw[g * 16 + t]) * dx[g * 16 + t];
                acc[t] = fmaf((float)s[t], scale, acc[t]);
                if (Q4) acc[t] = fmaf(q8_half(m[g * 16 + t]), sx[g * 16 + t], acc[t]);
            }
        }
        for (int64_t p = 0; p < NP; p++) {
            const uint8_t *wp = wq + NG * wgroup + p * wpair;
            const int8_t *xp = (const int8_t *)(xr + NG * 512 + p * 64);
            for (int l = 0; l < 16; l++) {
                /* lane l reads bytes 4l..4l+3 of the pair's 64 (A 0-15, B 0-15, A 16-31, B 16-31) */
                uint8_t wb[4];
                for (int u = 0; u < 4; u++) {
                    const int e = 4 * l + u;
                    if (Q4) {
                        const int half = e / 32, side = (e % 32) / 16, j = e % 16;  /* code j (+16 if half) of A/B */
                        const uint8_t byte = wp[side * 16 + j];
                        wb[u] = half ? byte >> 4 : byte & 15;
                    } else {
                        wb[u] = wp[e];
                    }
                }
                s[l] = q8_dot4(wb, xp + 4 * l, !Q4);
            }
            const int64_t sbase = 16 * (NG + p / 8), nb = K / QBLOCK;
            for (int l = 0; l < 16; l++) {
                const int blk = q8_pair_lane_block((int)p, l);
                const float scale = q8_half_at(dw, sbase + blk, nb) * dx[sbase + blk];
                acc[l] = fmaf((float)s[l], scale, acc[l]);
                if (Q4) acc[l] = fmaf(q8_half_at(m, sbase + blk, nb), (l == 0 || l == 4) ? sx[sbase + blk] : 0.0f, acc[l]);
            }
        }
        y[i * N] = q8_lane_sum(acc);
    }
}
#define Q8_ROW_GROUP 1
#endif

/* y[R, N] = x @ W^T with x given quantized (diffspec_q8_quantize, xrow bytes a row) and W in this file's layout
 * (Q4 = 1: codes, float16 scales, offsets; Q4 = 0: Q8 codes, float16 scales); W's rows split among `threads`
 * OpenMP threads. */
#define Q8_CASES(Q4V) switch (g) { \
    case 1: q8_rows(Q4V, 1, W, D, M, xq + r0 * xrow, xrow, K, Y, N); break; \
    case 2: q8_rows(Q4V, 2, W, D, M, xq + r0 * xrow, xrow, K, Y, N); break; \
    case 3: q8_rows(Q4V, 3, W, D, M, xq + r0 * xrow, xrow, K, Y, N); break; \
    case 4: q8_rows(Q4V, 4, W, D, M, xq + r0 * xrow, xrow, K, Y, N); break; \
    case 5: q8_rows(Q4V, 5, W, D, M, xq + r0 * xrow, xrow, K, Y, N); break; \
    case 6: q8_rows(Q4V, 6, W, D, M, xq + r0 * xrow, xrow, K, Y, N); break; \
    case 7: q8_rows(Q4V, 7, W, D, M, xq + r0 * xrow, xrow, K, Y, N); break; \
    case 8: q8_rows(Q4V, 8, W, D, M, xq + r0 * xrow, xrow, K, Y, N); break; }

/* Weight rows in tiles of Q8_TILE (a tile's codes stay in the core's L2 while every group of x rows passes over it;
 * a group's quantized rows stay in L1 while the tile's rows pass over them); tiles split among the threads. The
 * tiling only orders whole outputs: each (row, weight row) output is still one q8_rows call, the same operations. */
#define Q8_TILE 32
/* Weight rows are read once a pass and not again until the next pass (96 MB for SmolLM2, three times the L3), so the
 * kernel asks for each row Q8_PREFETCH rows ahead with a non-temporal hint: the codes stream past without pushing
 * out of the caches what the pass and the torch operations between passes reuse (the KV cache, the activations,
 * the operations' own code and data). 0: no prefetch. */
#ifndef Q8_PREFETCH
#define Q8_PREFETCH 8
#endif
QINLINE void q8_prefetch_row(const uint8_t *codes, int64_t row_bytes, const uint16_t *scales, const uint16_t *offsets,
                             int64_t nb) {
    /* every line the row's codes, scales and offsets touch (a row need not start on a line); locality 0: prefetchnta
     * on x86 (a hint: no build changes what the kernel computes) */
    const char *s = (const char *)scales, *o = (const char *)offsets;
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(codes + b, 0, 0);
    __builtin_prefetch(codes + row_bytes - 1, 0, 0);
    for (int64_t b = 0; b < 2 * nb; b += 64) {
        __builtin_prefetch(s + b, 0, 0);
        if (o) __builtin_prefetch(o + b, 0, 0);
    }
    __builtin_prefetch(s + 2 * nb - 1, 0, 0);
    if (o) __builtin_prefetch(o + 2 * nb - 1, 0, 0);
}

void diffspec_q8act_linear(const uint8_t *xq, int64_t R, int64_t K, const uint8_t *codes, const uint16_t *scales,
                           const uint16_t *offsets, int64_t N, float *y, int threads) {
    const int64_t xrow = diffspec_q8_xrow_bytes(K), nb = K / QBLOCK;
    const int64_t row_bytes = offsets ? q8_code_bytes(K) / 2 : q8_code_bytes(K);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t tile = 0; tile < (N + Q8_TILE - 1) / Q8_TILE; tile++) {
        const int64_t n_end = (tile + 1) * Q8_TILE < N ? (tile + 1) * Q8_TILE : N;
        for (int64_t r0 = 0; r0 < R; r0 += Q8_ROW_GROUP) {
            const int64_t g = R - r0 < Q8_ROW_GROUP ? R - r0 : Q8_ROW_GROUP;
            for (int64_t n = tile * Q8_TILE; n < n_end; n++) {
                const uint8_t *W = codes + n * row_bytes;
                const uint16_t *D = scales + n * nb, *M = offsets ? offsets + n * nb : NULL;
                float *Y = y + r0 * N + n;
                if (Q8_PREFETCH > 0 && r0 == 0 && n + Q8_PREFETCH < N)
                    q8_prefetch_row(codes + (n + Q8_PREFETCH) * row_bytes, row_bytes, scales + (n + Q8_PREFETCH) * nb,
                                    offsets ? offsets + (n + Q8_PREFETCH) * nb : NULL, nb);
                if (offsets) { Q8_CASES(1) } else { Q8_CASES(0) }
            }
        }
    }
}
