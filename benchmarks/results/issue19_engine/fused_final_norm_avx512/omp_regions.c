#include <omp.h>
#include <stdint.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
volatile float sink[64];
/* 150 parallel regions of a tiny loop, against one region with 150 worksharing loops (implicit barriers) */
double regions(int reps, int threads) {
    double t0 = now();
    for (int r = 0; r < reps; r++)
        for (int k = 0; k < 150; k++) {
#pragma omp parallel for schedule(static) num_threads(threads)
            for (int i = 0; i < 32; i++) sink[i] += 1.0f;
        }
    return (now() - t0) / reps;
}
double one_region(int reps, int threads) {
    double t0 = now();
    for (int r = 0; r < reps; r++) {
#pragma omp parallel num_threads(threads)
        for (int k = 0; k < 150; k++) {
#pragma omp for schedule(static)
            for (int i = 0; i < 32; i++) sink[i] += 1.0f;
        }
    }
    return (now() - t0) / reps;
}
