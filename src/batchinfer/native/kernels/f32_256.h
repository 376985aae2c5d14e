/* The float32 tile in 256-bit vectors, shared by the AVX2 and AVX-512 levels: a one-row
 * float32 product waits on memory, and on Zen 4 (which splits each 512-bit operation in two)
 * the 512-bit form streamed slower, at one row and at four (docs/architecture.md). Included
 * by avx2.h and avx512.h after common.h. */
#ifndef BI_KERNELS_F32_256_H
#define BI_KERNELS_F32_256_H
#include <immintrin.h>
#include "common.h"

/* Horizontal sum of 8 floats. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The lanes of a float32 row's last `left` (< 8) elements. */
static inline __m256i tail_mask8(int left) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lanes);
}

/* A float32 tile (4 outputs) for `rows` (1..4) rows, one output after another: each weight
 * row is read once, front to back, for every input row, so the tile streams through memory in
 * order (the hardware prefetcher follows one stream better than four rows read side by side;
 * docs/architecture.md has the figures). Two chains per input row cover FMA latency. */
static inline __attribute__((always_inline)) void
f32_tile(const bi_linear *l, int tile, const float *x, int64_t ldx, const int rows,
         float *y, int64_t ldy, int accumulate) {
    const int k = l->k;
    const float *bias = l->bias ? l->bias + tile * TILE_F32 : NULL;
    for (int j = 0; j < TILE_F32; j++) {
        const float *w = (const float *)l->weight + ((int64_t)tile * TILE_F32 + j) * k;
        __m256 acc[ROW_TILE][2];
        for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        int i = 0;
        for (; i + 16 <= k; i += 16) {
            const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
            for (int r = 0; r < rows; r++) {
                acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + i), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * ldx + i + 8),
                                            acc[r][1]);
            }
        }
        for (; i < k; i += 8) {
            const __m256i m = tail_mask8(k - i < 8 ? k - i : 8);
            const __m256 wv = _mm256_maskload_ps(w + i, m);
            for (int r = 0; r < rows; r++)
                acc[r][0] = _mm256_fmadd_ps(wv, _mm256_maskload_ps(x + r * ldx + i, m),
                                            acc[r][0]);
        }
        for (int r = 0; r < rows; r++)
            finish(y + r * ldy + tile * TILE_F32, j,
                   hsum8(_mm256_add_ps(acc[r][0], acc[r][1])), bias, accumulate);
    }
}

#endif
