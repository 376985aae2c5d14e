/* AVX2 + FMA + F16C (x86-64-v3, no AVX-512): the AVX-512 kernels' arithmetic in 256-bit
 * registers (the 16-bit integer products by `vpmaddwd`, the 8-bit ones by `vpmaddubsw`). */
#include <immintrin.h>
#include "common.h"
#include "f32_256.h"

#define BI_ISA_NAME "avx2"
#define BI_HELD16 1
#define BI_FIXED_KV 1
#define BI_PACKED_FAST 1
#define BI_SOFTMAX_FAST 1
#define BI_GELU_FAST 1
#define BI_ACT8 1

/* Horizontal maximum of 8 floats (hsum8, the sum: f32_256.h). */
static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* A group of 32 inputs loaded into v[0..4): returns its largest |x|; `*sum`: its float sum. */
static inline __attribute__((always_inline)) float
load_group(const float *x, __m256 v[4], float *sum) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + 8 * i);
    *sum = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    return hmax8(_mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
        _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
}

/* v * inv rounded to nearest (the default mode): qi[i] holds inputs 8i..8i+7 in 32-bit
 * lanes. */
static inline __attribute__((always_inline)) void
round_group(const __m256 v[4], float inv, __m256i qi[4]) {
    const __m256 by = _mm256_set1_ps(inv);
    for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], by));
}

/* Groups [0, groups) of one row into 16-bit integers, scales and sums. */
static void quantize_groups(const float *x, int groups, int16_t *q, float *scale, float *sum) {
    for (int g = 0; g < groups; g++) {
        __m256 v[4];
        __m256i qi[4];
        float inv;
        scale[g] = input_scale16(load_group(x + g * GROUP, v, sum + g), &inv);
        round_group(v, inv, qi);
        /* narrow with saturation; packs works within 128-bit lanes: put them back in order */
        const __m256i a = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xd8);
        const __m256i b = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xd8);
        _mm256_storeu_si256((__m256i *)(q + g * GROUP), a);
        _mm256_storeu_si256((__m256i *)(q + g * GROUP + 16), b);
    }
}

/* The same arithmetic in 256-bit registers: a 16-output tile is two halves of 8 outputs (one
 * per 32-bit lane), each run over every group in turn, so that a half's accumulators, two
 * chains of multiply-adds per row and the unpacked weights fit AVX2's sixteen registers. */
/* Integer adds are associative: left alone, the compiler turns a chain of multiply-adds into
 * all the products first, summed as a tree, and spills them; this keeps each a chain. */
#define KEEP_CHAINS(a, b) __asm__("" : "+x"(a), "+x"(b))

/* y[0..8) = v (+ bias[0..8)) (+ y[0..8) when accumulating). */
static inline void finish8(float *y, __m256 v, const float *bias, int accumulate) {
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
    if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(y));
    _mm256_storeu_ps(y, v);
}

/* Outputs [8h, 8h + 8) of a 16-output tile, of `rows` (1..4) input rows, over every group:
 * a chunk's bytes 16h..16h+15 hold those outputs' weight pairs, widened to 16 bits and
 * multiplied against an input pair broadcast to every lane (`vpmaddwd`). */
static inline __attribute__((always_inline)) void
quant_half(const bi_linear *l, int tile, int h, const bi_input *in, int rows, float *y,
           int64_t ldy, int accumulate) {
    const int groups = num_groups(l), k = l->k;
    const int q4 = l->kind == BI_Q4;
    const int64_t chunk_bytes = q4 ? 8 * 32 : 16 * 32;
    const uint8_t *w = (const uint8_t *)l->weight + (int64_t)tile * groups * chunk_bytes + 16 * h;
    const float *sc = l->scale + (int64_t)tile * groups * TILE_Q + 8 * h;
    const float *off = q4 ? l->offset + (int64_t)tile * groups * TILE_Q + 8 * h : NULL;
    const __m256i low = _mm256_set1_epi16(0x0f);
    __m256 acc[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *wg = w + g * chunk_bytes;
        __m256i d[ROW_TILE], e[ROW_TILE];
        for (int r = 0; r < ROW_TILE; r++) d[r] = e[r] = _mm256_setzero_si256();
        if (q4) {
            for (int i = 0; i < 8; i++) {  /* pairs i and i + 8 of the group */
                const __m256i v = _mm256_cvtepu8_epi16(
                    _mm_loadu_si128((const __m128i *)(wg + 32 * i)));
                const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_srli_epi16(v, 4);
                for (int r = 0; r < rows; r++) {
                    const int32_t *xp = (const int32_t *)(in->q + (int64_t)r * k + g * GROUP);
                    d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(lo, _mm256_set1_epi32(xp[i])));
                    e[r] = _mm256_add_epi32(e[r],
                                            _mm256_madd_epi16(hi, _mm256_set1_epi32(xp[i + 8])));
                    KEEP_CHAINS(d[r], e[r]);
                }
            }
        } else {
            for (int p = 0; p < 16; p += 2) {
                const __m256i v0 = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(wg + 32 * p)));
                const __m256i v1 = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(wg + 32 * p + 32)));
                for (int r = 0; r < rows; r++) {
                    const int32_t *xp = (const int32_t *)(in->q + (int64_t)r * k + g * GROUP);
                    d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(v0, _mm256_set1_epi32(xp[p])));
                    e[r] = _mm256_add_epi32(e[r],
                                            _mm256_madd_epi16(v1, _mm256_set1_epi32(xp[p + 1])));
                    KEEP_CHAINS(d[r], e[r]);
                }
            }
        }
        const __m256 s = _mm256_loadu_ps(sc + g * TILE_Q);
        for (int r = 0; r < rows; r++) {
            const int64_t at = (int64_t)r * groups + g;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(d[r], e[r])),
                                     _mm256_mul_ps(s, _mm256_set1_ps(in->scale[at])), acc[r]);
            if (q4)
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(off + g * TILE_Q),
                                         _mm256_set1_ps(in->sum[at]), acc[r]);
        }
    }
    const float *bias = l->bias ? l->bias + tile * TILE_Q + 8 * h : NULL;
    for (int r = 0; r < rows; r++)
        finish8(y + r * ldy + tile * TILE_Q + 8 * h, acc[r], bias, accumulate);
}

/* Both halves of a tile for one row (`rows` 1; two would spill) in one pass: an input pair's
 * broadcast serves both, and each group's 32-byte chunks are read whole. */
static inline __attribute__((always_inline)) void
quant_pair(const bi_linear *l, int tile, const bi_input *in, const int rows, float *y,
           int64_t ldy, int accumulate) {
    const int groups = num_groups(l), k = l->k;
    const int q4 = l->kind == BI_Q4;
    const int64_t chunk_bytes = q4 ? 8 * 32 : 16 * 32;
    const uint8_t *w = (const uint8_t *)l->weight + (int64_t)tile * groups * chunk_bytes;
    const float *sc = l->scale + (int64_t)tile * groups * TILE_Q;
    const float *off = q4 ? l->offset + (int64_t)tile * groups * TILE_Q : NULL;
    const __m256i low = _mm256_set1_epi16(0x0f);
    __m256 acc[2][2];
    for (int r = 0; r < 2; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *wg = w + g * chunk_bytes;
        __m256i d[2][2], e[2][2];  /* [row][half] */
        for (int r = 0; r < 2; r++) d[r][0] = d[r][1] = e[r][0] = e[r][1] = _mm256_setzero_si256();
        for (int i = 0; i < (q4 ? 8 : 16); i += q4 ? 1 : 2) {
            __m256i a[2], b[2];  /* per half: the pairs of the two chains */
            for (int h = 0; h < 2; h++) {
                if (q4) {  /* pairs i and i + 8 */
                    const __m256i v = _mm256_cvtepu8_epi16(
                        _mm_loadu_si128((const __m128i *)(wg + 32 * i + 16 * h)));
                    a[h] = _mm256_and_si256(v, low);
                    b[h] = _mm256_srli_epi16(v, 4);
                } else {  /* pairs i and i + 1 */
                    a[h] = _mm256_cvtepi8_epi16(
                        _mm_loadu_si128((const __m128i *)(wg + 32 * i + 16 * h)));
                    b[h] = _mm256_cvtepi8_epi16(
                        _mm_loadu_si128((const __m128i *)(wg + 32 * i + 32 + 16 * h)));
                }
            }
            for (int r = 0; r < rows; r++) {
                const int32_t *xp = (const int32_t *)(in->q + (int64_t)r * k + g * GROUP);
                const __m256i xa = _mm256_set1_epi32(xp[i]);
                const __m256i xb = _mm256_set1_epi32(xp[q4 ? i + 8 : i + 1]);
                for (int h = 0; h < 2; h++) {
                    d[r][h] = _mm256_add_epi32(d[r][h], _mm256_madd_epi16(a[h], xa));
                    e[r][h] = _mm256_add_epi32(e[r][h], _mm256_madd_epi16(b[h], xb));
                    KEEP_CHAINS(d[r][h], e[r][h]);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 s = _mm256_loadu_ps(sc + g * TILE_Q + 8 * h);
            for (int r = 0; r < rows; r++) {
                const int64_t at = (int64_t)r * groups + g;
                acc[r][h] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_add_epi32(d[r][h], e[r][h])),
                    _mm256_mul_ps(s, _mm256_set1_ps(in->scale[at])), acc[r][h]);
                if (q4)
                    acc[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(off + g * TILE_Q + 8 * h),
                                                _mm256_set1_ps(in->sum[at]), acc[r][h]);
            }
        }
    }
    const float *bias = l->bias ? l->bias + tile * TILE_Q : NULL;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++)
            finish8(y + r * ldy + tile * TILE_Q + 8 * h, acc[r][h], bias ? bias + 8 * h : NULL,
                    accumulate);
}

static inline __attribute__((always_inline)) void
quant_tile(const bi_linear *l, int tile, const bi_input *in, const int rows, float *y,
           int64_t ldy, int accumulate) {
    if (rows == 1) {
        quant_pair(l, tile, in, 1, y, ldy, accumulate);
        return;
    }
    quant_half(l, tile, 0, in, rows, y, ldy, accumulate);
    quant_half(l, tile, 1, in, rows, y, ldy, accumulate);
}


/* One group's weights of T tiles, unpacked to 16 bits in input-pair order: `wb[t][p][h]`
 * holds outputs 8h..8h+7 of tile t, their weights for inputs 2p and 2p + 1 (one 32-bit lane
 * each). */
static inline __attribute__((always_inline)) void
unpack_group16(const bi_linear *l, const int Q4, int tile, const int T, int g, __m256i *wb) {
    const __m256i low = _mm256_set1_epi16(0x0f);
    for (int t = 0; t < T; t++) {
        const uint8_t *wg = group_bytes(l, Q4, tile + t, g);
        __m256i *w = wb + 32 * t;
        for (int h = 0; h < 2; h++) {
            if (Q4) {  /* chunk i: pair i in the low nibbles, pair i + 8 in the high ones */
                for (int i = 0; i < 8; i++) {
                    const __m256i v = _mm256_cvtepu8_epi16(
                        _mm_loadu_si128((const __m128i *)(wg + 32 * i + 16 * h)));
                    _mm256_store_si256(w + 2 * i + h, _mm256_and_si256(v, low));
                    _mm256_store_si256(w + 2 * (i + 8) + h, _mm256_srli_epi16(v, 4));
                }
            } else {
                for (int p = 0; p < 16; p++)
                    _mm256_store_si256(w + 2 * p + h, _mm256_cvtepi8_epi16(
                        _mm_loadu_si128((const __m128i *)(wg + 32 * p + 16 * h))));
            }
        }
    }
}

/* a[0..8) += dot * s * xs (+ q4's offsets times the group's input sum). */
static inline __attribute__((always_inline)) void
scale_into8(const int Q4, __m256i dot, const float *s, const float *off, __m256 xs, __m256 xsum,
            float *a) {
    __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_loadu_ps(s), xs),
                               _mm256_load_ps(a));
    if (Q4) v = _mm256_fmadd_ps(_mm256_loadu_ps(off), xsum, v);
    _mm256_store_ps(a, v);
}

/* y += the held kernels' sums `acc` (rows of HELD_TILES * TILE_Q) of tiles [tile, tile + T). */
static inline void finish_held(const bi_linear *l, int tile, int T, const float *acc, int rows,
                               float *y, int64_t ldy, int accumulate) {
    for (int t = 0; t < T; t++) {
        const float *bias = l->bias ? l->bias + (tile + t) * TILE_Q : NULL;
        for (int r = 0; r < rows; r++)
            for (int h = 0; h < 2; h++)
                finish8(y + r * ldy + (tile + t) * TILE_Q + 8 * h,
                        _mm256_load_ps(acc + (r * HELD_TILES + t) * TILE_Q + 8 * h),
                        bias ? bias + 8 * h : NULL, accumulate);
    }
}

/* R (1..4) rows x one tile of one group: a chain of multiply-adds per (row, half), a pair of
 * inputs broadcast against both halves' weights; then each row's `acc` (HELD_TILES * TILE_Q
 * floats apart, this tile's 16 first) += the products, scaled (and q4's offsets times the
 * group's input sum). */
static inline __attribute__((always_inline)) void
rows_tile16(const __m256i *w, const int Q4, const bi_input *in, int k, int groups, int g,
            int r0, const int R, const float *s, const float *off, float *acc) {
    __asm__("" : "+r"(w));  /* see the AVX-512 rows_tiles16_4x4 */
    __m256i d[HELD_ROWS][2];
    const int32_t *xp[HELD_ROWS];
    for (int r = 0; r < R; r++) {
        xp[r] = (const int32_t *)(in->q + (int64_t)(r0 + r) * k + g * GROUP);
        d[r][0] = d[r][1] = _mm256_setzero_si256();
    }
#pragma GCC unroll 16
    for (int p = 0; p < 16; p++) {
        const __m256i w0 = _mm256_load_si256(w + 2 * p), w1 = _mm256_load_si256(w + 2 * p + 1);
        for (int r = 0; r < R; r++) {
            const __m256i x = _mm256_set1_epi32(xp[r][p]);
            d[r][0] = _mm256_add_epi32(d[r][0], _mm256_madd_epi16(w0, x));
            d[r][1] = _mm256_add_epi32(d[r][1], _mm256_madd_epi16(w1, x));
            KEEP_CHAINS(d[r][0], d[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        const int64_t at = (int64_t)(r0 + r) * groups + g;
        const __m256 xs = _mm256_set1_ps(in->scale[at]), xsum = _mm256_set1_ps(in->sum[at]);
        for (int h = 0; h < 2; h++)
            scale_into8(Q4, d[r][h], s + 8 * h, Q4 ? off + 8 * h : NULL, xs, xsum,
                        acc + (r0 + r) * HELD_TILES * TILE_Q + 8 * h);
    }
}

/* Tiles [tile, tile + T) for up to BLOCK_ROWS rows, group by group: the group's weights are
 * unpacked once (into L1) and serve every row, HELD_ROWS rows and a tile at a time. */
static inline __attribute__((always_inline)) void
held_tiles16_kind(const bi_linear *l, const int Q4, int tile, const int T, const bi_input *in,
                  int rows, float *y, int64_t ldy, int accumulate) {
    const int groups = num_groups(l), k = l->k;
    __m256i wb[HELD_TILES * 32];
    float acc[BLOCK_ROWS * HELD_TILES * TILE_Q] __attribute__((aligned(32)));
    memset(acc, 0, sizeof(float) * rows * HELD_TILES * TILE_Q);
    for (int g = 0; g < groups; g++) {
        unpack_group16(l, Q4, tile, T, g, wb);
        for (int t = 0; t < T; t++) {
            const int64_t at = ((int64_t)(tile + t) * groups + g) * TILE_Q;
            const float *s = l->scale + at, *off = Q4 ? l->offset + at : NULL;
            const __m256i *w = wb + 32 * t;
            float *a = acc + t * TILE_Q;
#define ROWS16(R0, R) rows_tile16(w, Q4, in, k, groups, g, R0, R, s, off, a)
            FOR_HELD_ROWS(rows, ROWS16);
#undef ROWS16
        }
    }
    finish_held(l, tile, T, acc, rows, y, ldy, accumulate);
}

/* ---- 8-bit activations (opt-in, many rows; see the AVX-512 file) ----------------------
 *
 * `vpmaddubsw` multiplies 32 unsigned bytes by 32 signed ones and adds neighbours into 16-bit
 * lanes; `vpmaddwd` by ones adds those pairs into 32-bit lanes: four inputs against four
 * weights of 8 outputs, one output per 32-bit lane, as one `vpdpbusd` does for 16 outputs.
 * The held weights are the unsigned operand, the inputs (signed, -127..127) the other:
 *   q4: weights 0..15, so a 16-bit lane holds at most 2 x 15 x 127 = 3,810 and a group's
 *       eight four-input steps add up in 16 bits (at most 30,480) before one `vpmaddwd`
 *       widens them: one multiply and one add per 32 products;
 *   q8: weights -127..127 held as |w| and w, each input taking the weight's sign
 *       (`vpsignb`, llama.cpp's way for Q8_0 x Q8_0); a lane holds up to 2 x 128 x 127, so
 *       each step widens at once: two multiplies, a sign and an add per 32 products, as many
 *       multiplies as the 16-bit inputs' `vpmaddwd` takes (the saving is the held weights'
 *       size: half the bytes read from L1).
 * The inputs' rounding is the AVX-512 one (largest |x| / 127, nearest), so the two levels
 * compute the same integers. */

/* Groups of one row into int8, scales and float sums; `flip` (the AVX-512 form's unsigned
 * inputs for q8) is not needed here: the inputs stay signed. */
static void quantize_groups8(const float *x, int groups, int8_t *q, float *scale, float *sum,
                             int flip) {
    (void)flip;
    /* packs work within 128-bit lanes: the 32-bit groups of four come out as 0 2 4 6 1 3 5 7 */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int g = 0; g < groups; g++) {
        __m256 v[4];
        __m256i qi[4];
        const float top = load_group(x + g * GROUP, v, sum + g);
        round_group(v, top > TINY_GROUP ? 127.f / top : 0.f, qi);
        scale[g] = top / 127.f;
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                                 _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256((__m256i *)(q + g * GROUP), _mm256_permutevar8x32_epi32(bytes, order));
    }
}

/* One group's weights of T tiles as four-input lanes: `wb[t][m][h]` holds outputs 8h..8h+7
 * of tile t, their weights for inputs 4m..4m+3 (q4: 0..15; q8: |w|, with w itself in
 * `ws[t][m][h]` for its signs). Chunks 2m and 2m + 1 hold the quad's two pairs, output j's in
 * 16-bit word j: interleaving their words puts an output's four bytes in one lane. */
static inline __attribute__((always_inline)) void
unpack_group8(const bi_linear *l, const int Q4, int tile, const int T, int g, __m256i *wb,
              __m256i *ws) {
    const __m256i nibbles = _mm256_set1_epi8(0x0f);
    for (int t = 0; t < T; t++) {
        const uint8_t *wg = group_bytes(l, Q4, tile + t, g);
        __m256i *w = wb + 16 * t, *s = ws + 16 * t;
        for (int m = 0; m < (Q4 ? 4 : 8); m++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(wg + 64 * m));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(wg + 64 * m + 32));
            /* per 128-bit lane (outputs 0..7, 8..15): outputs 0..3 | 4..7 of the half */
            const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
            const __m256i v[2] = {_mm256_permute2x128_si256(lo, hi, 0x20),
                                  _mm256_permute2x128_si256(lo, hi, 0x31)};
            for (int h = 0; h < 2; h++) {
                if (Q4) {  /* low nibbles: inputs 4m..; high ones: 16 + 4m.. */
                    _mm256_store_si256(w + 2 * m + h, _mm256_and_si256(v[h], nibbles));
                    _mm256_store_si256(w + 2 * (m + 4) + h,
                                       _mm256_and_si256(_mm256_srli_epi16(v[h], 4), nibbles));
                } else {
                    _mm256_store_si256(w + 2 * m + h, _mm256_abs_epi8(v[h]));
                    _mm256_store_si256(s + 2 * m + h, v[h]);
                }
            }
        }
    }
}

/* R (1..4) rows x one tile of one group of 8-bit inputs: a chain per (row, half), then each
 * row's `acc` (HELD_TILES * TILE_Q floats apart, this tile's 16 first) += the products,
 * scaled (and q4's offsets times the group's input sum). */
static inline __attribute__((always_inline)) void
rows_tile8(const __m256i *w, const __m256i *ws, const int Q4, const int8_t *xq, const float *xs,
           const float *xsum, int k, int groups, int g, int r0, const int R, const float *s,
           const float *off, float *acc) {
    __asm__("" : "+r"(w), "+r"(ws));  /* see the AVX-512 rows_tiles16_4x4 */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i d[HELD_ROWS][2];
    const int32_t *xp[HELD_ROWS];
    for (int r = 0; r < R; r++) {
        xp[r] = (const int32_t *)(xq + (int64_t)(r0 + r) * k + g * GROUP);
        d[r][0] = d[r][1] = _mm256_setzero_si256();
    }
#pragma GCC unroll 8
    for (int m = 0; m < 8; m++) {
        const __m256i w0 = _mm256_load_si256(w + 2 * m), w1 = _mm256_load_si256(w + 2 * m + 1);
        for (int r = 0; r < R; r++) {
            const __m256i x = _mm256_set1_epi32(xp[r][m]);
            if (Q4) {  /* 16-bit sums: widened once per group, below */
                d[r][0] = _mm256_add_epi16(d[r][0], _mm256_maddubs_epi16(w0, x));
                d[r][1] = _mm256_add_epi16(d[r][1], _mm256_maddubs_epi16(w1, x));
            } else {
                const __m256i p0 = _mm256_maddubs_epi16(
                    w0, _mm256_sign_epi8(x, _mm256_load_si256(ws + 2 * m)));
                const __m256i p1 = _mm256_maddubs_epi16(
                    w1, _mm256_sign_epi8(x, _mm256_load_si256(ws + 2 * m + 1)));
                d[r][0] = _mm256_add_epi32(d[r][0], _mm256_madd_epi16(p0, ones));
                d[r][1] = _mm256_add_epi32(d[r][1], _mm256_madd_epi16(p1, ones));
            }
            KEEP_CHAINS(d[r][0], d[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        const int64_t at = (int64_t)(r0 + r) * groups + g;
        const __m256 xsv = _mm256_set1_ps(xs[at]), xsumv = _mm256_set1_ps(xsum[at]);
        for (int h = 0; h < 2; h++)
            scale_into8(Q4, Q4 ? _mm256_madd_epi16(d[r][h], ones) : d[r][h], s + 8 * h,
                        Q4 ? off + 8 * h : NULL, xsv, xsumv,
                        acc + (r0 + r) * HELD_TILES * TILE_Q + 8 * h);
    }
}

/* Tiles [tile, tile + T) for up to BLOCK_ROWS rows of 8-bit inputs (see held_tiles16_kind). */
static inline __attribute__((always_inline)) void
held_tiles8_kind(const bi_linear *l, const int Q4, int tile, const int T, const int8_t *xq,
                 const float *xs, const float *xsum, int rows, float *y, int64_t ldy,
                 int accumulate) {
    const int groups = num_groups(l), k = l->k;
    __m256i wb[HELD_TILES * 16], ws[HELD_TILES * 16];  /* ws: q8 only */
    float acc[BLOCK_ROWS * HELD_TILES * TILE_Q] __attribute__((aligned(32)));
    memset(acc, 0, sizeof(float) * rows * HELD_TILES * TILE_Q);
    for (int g = 0; g < groups; g++) {
        unpack_group8(l, Q4, tile, T, g, wb, ws);
        for (int t = 0; t < T; t++) {
            const int64_t at = ((int64_t)(tile + t) * groups + g) * TILE_Q;
            const float *s = l->scale + at, *off = Q4 ? l->offset + at : NULL;
            const __m256i *w = wb + 16 * t, *sg = ws + (Q4 ? 0 : 16 * t);
            float *a = acc + t * TILE_Q;
#define ROWS8(R0, R) rows_tile8(w, sg, Q4, xq, xs, xsum, k, groups, g, R0, R, s, off, a)
            FOR_HELD_ROWS(rows, ROWS8);
#undef ROWS8
        }
    }
    finish_held(l, tile, T, acc, rows, y, ldy, accumulate);
}


/* e^x as the AVX-512 exp_ps computes it, 2^r built from r's exponent bits (r in [-126, 127]
 * after the clamp, so a normal float). */
static inline __m256 exp8_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 r = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, r), _mm256_set1_ps(0.693147180559945309f));
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i two_r = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(r), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_r));
}

/* The vector parts of the driver's loops (see common.h). */
BI_INLINE int64_t kv_widen(const void *src, int64_t n, int type, float *dst) {
    int64_t i = 0;
    const uint16_t *h = src;
    const uint8_t *b = src;
    switch (type) {
    case BI_KV_F16:
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const void *)(h + i))));
        return i;
    case BI_KV_BF16:
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)(h + i))), 16)));
        return i;
    case BI_KV_E5M2:  /* float16's top byte */
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_slli_epi16(
                _mm_cvtepu8_epi16(_mm_loadl_epi64((const void *)(b + i))), 8)));
        return i;
    case BI_KV_E4M3: {  /* its fields moved into a float16, times 2^8 */
        const __m128i sign = _mm_set1_epi16(0x80), rest = _mm_set1_epi16(0x7F);
        const __m256 two8 = _mm256_set1_ps(256.f);
        for (; i + 8 <= n; i += 8) {
            const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const void *)(b + i)));
            const __m128i e = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, sign), 8),
                                           _mm_slli_epi16(_mm_and_si128(x, rest), 7));
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(e), two8));
        }
        return i;
    }
    default: return 0;
    }
}

BI_INLINE int silu_mul_span(float *out, const float *g, const float *u, int i, int last) {
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= last; i += 8) {
        const __m256 v = _mm256_loadu_ps(g + i);
        const __m256 e = exp8_ps(_mm256_sub_ps(_mm256_setzero_ps(), v));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(one, e)),
                                                _mm256_loadu_ps(u + i)));
    }
    return i;
}

BI_INLINE int exp_shifted_span(float *s, int n, float m, float *sum) {
    int i = 0;
    __m256 acc = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        const __m256 p = exp8_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
        _mm256_storeu_ps(s + i, p);
        acc = _mm256_add_ps(acc, p);
    }
    *sum = hsum8(acc);
    return i;
}

BI_INLINE int dot_span(const float *a, const float *b, int d, float *sum) {
    if (d % 16) return 0;
    /* two chains */
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    __m256 odd = _mm256_mul_ps(_mm256_loadu_ps(a + 8), _mm256_loadu_ps(b + 8));
    for (int i = 16; i < d; i += 16) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), odd);
    }
    *sum = hsum8(_mm256_add_ps(acc, odd));
    return d;
}

BI_INLINE int max_span(const float *s, int n, float *best) {
    int t = 0;
    __m256 top = _mm256_set1_ps(*best);
    for (; t + 8 <= n; t += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + t));
    *best = hmax8(top);
    return t;
}

/* Lane t of the result: the sum of a[t]'s 8 lanes. */
static inline __m256 sum_lanes8(const __m256 a[8]) {
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                         _mm256_permute2f128_ps(h0, h1, 0x31));
}

/* 8 cache elements from element `i` of `p` (see the AVX-512 load_kv16). */
static inline __attribute__((always_inline)) __m256 load_kv8(const void *p, int64_t i,
                                                             const int KT) {
    if (KT == BI_KV_F32) return _mm256_loadu_ps((const float *)p + i);
    if (KT == BI_KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    if (KT == BI_KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(
        _mm_loadl_epi64((const __m128i *)((const uint8_t *)p + i))), 8));  /* e5m2 */
}

/* The AVX-512 kernels' arithmetic 8 lanes wide: 8 keys at a time (8 chains, the query read
 * from L1 rather than held: 128 floats of it would take every register), and each output's
 * 32-float chunks held in registers across the block's values. */
static inline __attribute__((always_inline)) void
block_scores_fixed(const float *q, const void *keys, int n, int per_kv, const int D, const int KT,
                   float scale, float *scores, int bs) {
    const __m256 sv = _mm256_set1_ps(scale);
    for (int h = 0; h < per_kv; h++)
        for (int t0 = 0; t0 < n; t0 += 8) {
            const int m = n - t0 < 8 ? n - t0 : 8;
            __m256 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
            int64_t key[8];  /* past the block's last key: that one again, not stored */
            for (int i = 0; i < 8; i++) key[i] = (int64_t)(t0 + (i < m ? i : m - 1)) * D;
            for (int c = 0; c < D / 8; c++) {
                const __m256 qc = _mm256_loadu_ps(q + h * D + 8 * c);
                for (int i = 0; i < 8; i++)
                    a[i] = _mm256_fmadd_ps(qc, load_kv8(keys, key[i] + 8 * c, KT), a[i]);
            }
            _mm256_maskstore_ps(scores + h * bs + t0, tail_mask8(m),
                                _mm256_mul_ps(sum_lanes8(a), sv));
        }
}

static inline __attribute__((always_inline)) void
block_values_fixed(const float *p, const void *values, int n, int per_kv, const int D,
                   const int KT, float *out, int bs) {
    for (int h = 0; h < per_kv; h++)
        for (int c0 = 0; c0 < D / 8; c0 += 4) {
            __m256 a[4], b[4];
            for (int i = 0; i < 4; i++) {
                a[i] = _mm256_loadu_ps(out + h * D + 8 * (c0 + i));
                b[i] = _mm256_setzero_ps();
            }
            int t = 0;
            for (; t + 2 <= n; t += 2) {  /* two chains: even and odd values */
                const __m256 w0 = _mm256_set1_ps(p[h * bs + t]);
                const __m256 w1 = _mm256_set1_ps(p[h * bs + t + 1]);
                const int64_t v0 = (int64_t)t * D + 8 * c0, v1 = v0 + D;
                for (int i = 0; i < 4; i++) {
                    a[i] = _mm256_fmadd_ps(w0, load_kv8(values, v0 + 8 * i, KT), a[i]);
                    b[i] = _mm256_fmadd_ps(w1, load_kv8(values, v1 + 8 * i, KT), b[i]);
                }
            }
            if (t < n) {
                const __m256 w0 = _mm256_set1_ps(p[h * bs + t]);
                const int64_t v0 = (int64_t)t * D + 8 * c0;
                for (int i = 0; i < 4; i++)
                    a[i] = _mm256_fmadd_ps(w0, load_kv8(values, v0 + 8 * i, KT), a[i]);
            }
            for (int i = 0; i < 4; i++)
                _mm256_storeu_ps(out + h * D + 8 * (c0 + i), _mm256_add_ps(a[i], b[i]));
        }
}


/* erf(x) as the AVX-512 erf_ps computes it, the reciprocal from the 12-bit estimate and one
 * Newton step (~2e-7 relative). */
static inline __m256 erf8_ps(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256 ax = _mm256_andnot_ps(sign, x);
    const __m256 d = _mm256_fmadd_ps(ax, _mm256_set1_ps(0.3275911f), _mm256_set1_ps(1.f));
    const __m256 r = _mm256_rcp_ps(d);
    const __m256 t = _mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.f)));
    __m256 p = _mm256_set1_ps(1.061405429f);
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
    p = _mm256_mul_ps(p, t);
    const __m256 e = exp8_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), ax), ax));
    const __m256 y = _mm256_fnmadd_ps(p, e, _mm256_set1_ps(1.f));
    return _mm256_or_ps(y, _mm256_and_ps(x, sign));
}

BI_INLINE int64_t gelu_span(float *x, int64_t i, int64_t end) {
    const __m256 half = _mm256_set1_ps(0.5f), root = _mm256_set1_ps(0.70710678118654752f);
    for (; i + 8 <= end; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 e = erf8_ps(_mm256_mul_ps(v, root));
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_mul_ps(v, half),
                                              _mm256_add_ps(e, _mm256_set1_ps(1.f))));
    }
    return i;
}

/* ---- the packed attention (see cpu_kernels.c): the AVX-512 kernels 8 lanes wide -------- */

/* One softmax row of the packed attention: exp(s - max) over its n scores (the last few
 * under a mask, the scores past them left as they are); *inv = 1 / sum. */
BI_INLINE int softmax_row_fast(float *s, int n, float *inv) {
    const int tail = n % 8, whole = n - tail;
    const __m256i mask = tail_mask8(tail);
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int j = 0; j < whole; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
    if (tail)  /* the lanes past n keep -inf */
        m = _mm256_max_ps(m, _mm256_blendv_ps(m, _mm256_maskload_ps(s + whole, mask),
                                              _mm256_castsi256_ps(mask)));
    const __m256 mv = _mm256_set1_ps(hmax8(m));
    __m256 acc = _mm256_setzero_ps();
    for (int j = 0; j < whole; j += 8) {
        const __m256 p = exp8_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, p);
        acc = _mm256_add_ps(acc, p);
    }
    if (tail) {
        const __m256 p = _mm256_and_ps(
            exp8_ps(_mm256_sub_ps(_mm256_maskload_ps(s + whole, mask), mv)),
            _mm256_castsi256_ps(mask));
        _mm256_maskstore_ps(s + whole, mask, p);
        acc = _mm256_add_ps(acc, p);
    }
    *inv = 1.f / hsum8(acc);
    return 1;
}

/* scores[r][j] = q_r . kt[:, j] for r < R, j < n rounded up to 8 (kt: `[D][ldk]`, zero past
 * n): 24 keys a pass for 4 rows (12 accumulators, three key vectors and a broadcast fill the
 * sixteen registers). */
static inline __attribute__((always_inline)) void
sentence_scores(const float *const *qr, const int R, const float *kt, int64_t ldk, int n,
                const int D, float *scores, int64_t lds) {
    int j0 = 0;
    enum { W = 3 };
    for (; j0 + 8 * W <= n; j0 += 8 * W) {
        __m256 acc[QROWS][W];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < W; i++) acc[r][i] = _mm256_setzero_ps();
        for (int c = 0; c < D; c++) {
            const float *row = kt + c * ldk + j0;
            __m256 kv[W];
            for (int i = 0; i < W; i++) kv[i] = _mm256_loadu_ps(row + 8 * i);
            for (int r = 0; r < R; r++) {
                const __m256 qv = _mm256_broadcast_ss(qr[r] + c);
                for (int i = 0; i < W; i++) acc[r][i] = _mm256_fmadd_ps(qv, kv[i], acc[r][i]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int i = 0; i < W; i++) _mm256_storeu_ps(scores + r * lds + j0 + 8 * i, acc[r][i]);
    }
    for (; j0 < n; j0 += 8) {  /* the last keys, 8 at a time */
        __m256 acc[QROWS], odd[QROWS];  /* even and odd c: twice the chains of multiply-adds */
        for (int r = 0; r < R; r++) acc[r] = odd[r] = _mm256_setzero_ps();
        for (int c = 0; c < D; c += 2) {
            const __m256 k0 = _mm256_loadu_ps(kt + c * ldk + j0);
            const __m256 k1 = _mm256_loadu_ps(kt + (c + 1) * ldk + j0);
            for (int r = 0; r < R; r++) {
                acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(qr[r] + c), k0, acc[r]);
                odd[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(qr[r] + c + 1), k1, odd[r]);
            }
        }
        for (int r = 0; r < R; r++)
            _mm256_storeu_ps(scores + r * lds + j0, _mm256_add_ps(acc[r], odd[r]));
    }
}

/* out_r = inv[r] * sum_j p[r][j] v_j for r < R (v rows `ld` apart; D a multiple of 32): 32
 * outputs of two rows at a time, in registers across the values. */
static inline __attribute__((always_inline)) void
sentence_values(const float *p, int64_t lds, const int R, const float *v, int64_t ld, int n,
                const int D, const float *inv, float *const *outr) {
    for (int c0 = 0; c0 < D; c0 += 32)
        for (int r0 = 0; r0 < R; r0 += 2) {
            const int rows = R - r0 < 2 ? R - r0 : 2;
            __m256 acc[2][4];
            for (int r = 0; r < rows; r++)
                for (int i = 0; i < 4; i++) acc[r][i] = _mm256_setzero_ps();
            for (int j = 0; j < n; j++) {
                const float *vj = v + j * ld + c0;
                __m256 vv[4];
                for (int i = 0; i < 4; i++) vv[i] = _mm256_loadu_ps(vj + 8 * i);
                for (int r = 0; r < rows; r++) {
                    const __m256 w = _mm256_broadcast_ss(p + (r0 + r) * lds + j);
                    for (int i = 0; i < 4; i++) acc[r][i] = _mm256_fmadd_ps(w, vv[i], acc[r][i]);
                }
            }
            for (int r = 0; r < rows; r++)
                for (int i = 0; i < 4; i++)
                    _mm256_storeu_ps(outr[r0 + r] + c0 + 8 * i,
                                     _mm256_mul_ps(acc[r][i], _mm256_set1_ps(inv[r0 + r])));
        }
}


/* r[i] <- column i of the 8 x 8 block r (rows r[0..8)). */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
    }
}

BI_INLINE int transpose_keys_fast(const float *keys, int64_t ldk, int n, int d, float scale,
                                  float *kt, int64_t ldt) {
    if (d % 8) return 0;
    const int padded = (n + 15) / 16 * 16;
    const __m256 sv = _mm256_set1_ps(scale);
    for (int j0 = 0; j0 < padded; j0 += 8)  /* 8 keys x 8 values at a time, in registers */
        for (int c0 = 0; c0 < d; c0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = j0 + i < n ? _mm256_mul_ps(_mm256_loadu_ps(keys + (j0 + i) * ldk + c0), sv)
                                  : _mm256_setzero_ps();
            transpose8(r);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(kt + (c0 + i) * ldt + j0, r[i]);
        }
    return 1;
}
