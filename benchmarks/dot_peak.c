/* The 16-bit integer dot product's peak on this CPU, and what the float work around it costs.
 *
 *     cc -O2 -march=native -fopenmp benchmarks/dot_peak.c -o /tmp/dot_peak && /tmp/dot_peak
 *
 * Needs AVX-512 VNNI. Every thread (OMP_NUM_THREADS, default: every core) runs twelve
 * independent chains of 512-bit `vpdpwssd` (32 multiply-adds each), alone and then with other
 * instructions beside each twelve: four float multiply-adds, eight float adds, four int-to-float
 * conversions, four integer adds (to a float's bits, as the held-weight kernels apply a
 * power-of-two scale). Prints the dot products' G multiply-adds a second, best of three: the
 * first line is the peak the many-row kernels are measured against; a slower line is an
 * instruction that takes issue slots of the dot product's vector units.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

#define CHAINS 12
#define ITERATIONS (200000000L / 16)

static inline __attribute__((always_inline)) double run(const int mode) {
    double best = 0;
    for (int round = 0; round < 3; round++) {
        const double start = omp_get_wtime();
        long sink = 0;
#pragma omp parallel reduction(+ : sink)
        {
            __m512i a[CHAINS];
            __m512 f[8];
            for (int i = 0; i < CHAINS; i++) a[i] = _mm512_set1_epi32(i);
            for (int i = 0; i < 8; i++) f[i] = _mm512_set1_ps((float)i);
            __m512i w = _mm512_set1_epi16(3);
            const __m512i x = _mm512_set1_epi16(5);
            const __m512 one = _mm512_set1_ps(1.0001f);
            for (long it = 0; it < ITERATIONS; it++) {
#pragma GCC unroll 12
                for (int i = 0; i < CHAINS; i++) a[i] = _mm512_dpwssd_epi32(a[i], w, x);
                if (mode == 1)
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++) f[i] = _mm512_fmadd_ps(f[i], one, one);
                if (mode == 2)
#pragma GCC unroll 8
                    for (int i = 0; i < 8; i++) f[i] = _mm512_add_ps(f[i], one);
                if (mode == 3)
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++) f[i] = _mm512_cvtepi32_ps(a[i]);
                if (mode == 4)
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++)
                        f[i] = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(f[i]), w));
                __asm__("" : "+v"(w));  /* keeps the loop from being folded */
            }
            __m512i s = a[0];
            for (int i = 1; i < CHAINS; i++) s = _mm512_add_epi32(s, a[i]);
            __m512 t = f[0];
            for (int i = 1; i < 8; i++) t = _mm512_add_ps(t, f[i]);
            sink += _mm512_reduce_add_epi32(s) + (long)_mm512_reduce_add_ps(t);
        }
        const double seconds = omp_get_wtime() - start;
        const double threads = omp_get_max_threads();
        const double gmacs = threads * ITERATIONS * CHAINS * 32.0 / seconds / 1e9;
        if (gmacs > best) best = gmacs;
        if (sink == 42) printf(" ");
    }
    return best;
}

int main(void) {
    static const char *names[] = {"vpdpwssd alone", "+ 4 float multiply-adds",
                                  "+ 8 float adds", "+ 4 int-to-float conversions",
                                  "+ 4 integer adds"};
    printf("%d threads; G multiply-adds a second of %d vpdpwssd chains:\n",
           omp_get_max_threads(), CHAINS);
    const double peak[5] = {run(0), run(1), run(2), run(3), run(4)};  /* constants: unrolled */
    for (int mode = 0; mode < 5; mode++) printf("  %-30s %6.1f\n", names[mode], peak[mode]);
    return 0;
}
