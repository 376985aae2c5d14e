/* The order a float32 matrix-vector product reads its weights in, against a plain sum.
 *
 *     cc -O3 -march=native -fopenmp benchmarks/stream_order.c -o /tmp/stream_order
 *     /tmp/stream_order 0     # 4 KiB pages
 *     /tmp/stream_order 1     # the buffer marked for transparent huge pages (madvise)
 *
 * A 538 MB matrix of 576-wide rows (SmolLM2-135M's float32 weights are 513 MiB), two threads
 * each taking half, fastest of 5 passes, three rounds:
 *   sum           a plain sum of the buffer (what benchmarks' "memory floor" times)
 *   four-rows     four rows side by side, 8 floats of each in turn, software prefetch two
 *                 tiles ahead (the float32 tile before kernels/f32_256.h)
 *   row-by-row    one row after another, front to back (the tile since)
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define K 576
static int n_rows;
static float *weights, x[K] __attribute__((aligned(64))), *y;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static float hsum(__m256 v) {
    float r[8];
    _mm256_storeu_ps(r, v);
    return r[0] + r[1] + r[2] + r[3] + r[4] + r[5] + r[6] + r[7];
}

static void four_rows(int t0, int t1) {
    for (int t = t0; t < t1; t++) {
        const float *w = weights + (long)t * 4 * K, *ahead = w + 2L * 4 * K;
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                       _mm256_setzero_ps()};
        for (int i = 0; i < K; i += 8) {
            const __m256 xv = _mm256_load_ps(x + i);
            for (int j = 0; j < 4; j++) {
                if ((i & 15) == 0) _mm_prefetch((const char *)(ahead + j * K + i), _MM_HINT_T0);
                a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w + j * K + i), xv, a[j]);
            }
        }
        for (int j = 0; j < 4; j++) y[t * 4 + j] = hsum(a[j]);
    }
}

static void row_by_row(int r0, int r1) {
    for (int r = r0; r < r1; r++) {
        const float *w = weights + (long)r * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (int i = 0; i < K; i += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_load_ps(x + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_load_ps(x + i + 8), a1);
        }
        y[r] = hsum(_mm256_add_ps(a0, a1));
    }
}

static float sum(long a, long b) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;
    for (long i = a; i < b; i += 16) {
        s0 = _mm256_add_ps(s0, _mm256_loadu_ps(weights + i));
        s1 = _mm256_add_ps(s1, _mm256_loadu_ps(weights + i + 8));
    }
    return hsum(_mm256_add_ps(s0, s1));
}

int main(int argc, char **argv) {
    const int huge = argc > 1 && atoi(argv[1]);
    n_rows = 16 * 14592;
    const long n = (long)n_rows * K;
    const size_t bytes = n * sizeof(float);
    if (huge) {
        char *p = mmap(NULL, bytes + (2 << 20), PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return 1;
        p = (char *)(((unsigned long)p + (2 << 20) - 1) & ~((2UL << 20) - 1));
        madvise(p, bytes, MADV_HUGEPAGE);
        weights = (float *)p;
    } else {
        weights = aligned_alloc(64, bytes);
    }
    y = malloc(sizeof(float) * n_rows);
    if (!weights || !y) return 1;
    for (long i = 0; i < n; i++) weights[i] = 0.001f * (i % 7);
    for (int i = 0; i < K; i++) x[i] = 1.f;
    const char *names[] = {"sum", "four-rows", "row-by-row"};
    volatile float sink = 0.f;
    for (int round = 0; round < 3; round++) {
        for (int v = 0; v < 3; v++) {
            double best = 1e9;
            for (int pass = 0; pass < 5; pass++) {
                const double t0 = now();
#pragma omp parallel num_threads(2)
                {
                    const int id = omp_get_thread_num();
                    if (v == 0) {
                        const float s = sum(n / 2 * id, n / 2 * (id + 1));
#pragma omp atomic
                        sink += s;
                    } else if (v == 1) {
                        four_rows(n_rows / 8 * id, n_rows / 8 * (id + 1));
                    } else {
                        row_by_row(n_rows / 2 * id, n_rows / 2 * (id + 1));
                    }
                }
                const double t = now() - t0;
                best = t < best ? t : best;
            }
            printf("%-11s %6.2f ms %5.1f GB/s\n", names[v], best * 1e3, bytes / best / 1e9);
        }
    }
    return 0;
}
