#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main() {
    const size_t n = 160u << 20; uint8_t *a = aligned_alloc(64, n); for (size_t i = 0; i < n; i++) a[i] = i;
    for (int rep = 0; rep < 8; rep++) {
        double t0 = now(); __m512i acc[2];
#pragma omp parallel num_threads(2)
        { __m512i s = _mm512_setzero_si512(), s2 = s, s3 = s, s4 = s;
#pragma omp for schedule(static)
          for (size_t i = 0; i < n; i += 256) { s = _mm512_add_epi32(s, _mm512_load_si512(a + i)); s2 = _mm512_add_epi32(s2, _mm512_load_si512(a + i + 64));
             s3 = _mm512_add_epi32(s3, _mm512_load_si512(a + i + 128)); s4 = _mm512_add_epi32(s4, _mm512_load_si512(a + i + 192)); }
          acc[0] = _mm512_add_epi32(_mm512_add_epi32(s, s2), _mm512_add_epi32(s3, s4)); }
        double dt = now() - t0;
        printf("%.2f ms  %.1f GB/s %d\n", dt * 1e3, n / dt / 1e9, _mm512_reduce_add_epi32(acc[0]) & 1);
    }
}
