/* AVX-512 (F + BW; VNNI's dot products where the compiler targets them): 512-bit kernels. */
#include <immintrin.h>
#include "common.h"
#include "f32_256.h"

#define BI_ISA_NAME "avx512"
#define BI_HELD16 1
#define BI_FIXED_KV 1
#define BI_PACKED_FAST 1
#define BI_SOFTMAX_FAST 1
#define BI_GELU_FAST 1
/* 8-bit inputs' products (`vpdpbusd`) where AVX-512 VNNI is there */
#if defined(__AVX512VNNI__)
#define BI_ACT8 1
#else
#define BI_ACT8 0
#endif

/* Groups [0, groups) of one row into 16-bit integers, scales and sums. */
static void quantize_groups(const float *x, int groups, int16_t *q, float *scale, float *sum) {
    const __m512 sign = _mm512_set1_ps(-0.f);
    for (int g = 0; g < groups; g++) {
        const __m512 a = _mm512_loadu_ps(x + g * GROUP), b = _mm512_loadu_ps(x + g * GROUP + 16);
        const float top = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        float inv_top;
        scale[g] = input_scale16(top, &inv_top);
        const __m512 inv = _mm512_set1_ps(inv_top);
        /* round to nearest (the default mode), then narrow with saturation */
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
        _mm256_storeu_si256((__m256i *)(q + g * GROUP), _mm512_cvtsepi32_epi16(qa));
        _mm256_storeu_si256((__m256i *)(q + g * GROUP + 16), _mm512_cvtsepi32_epi16(qb));
        sum[g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
}

/* y[0..16) = v (+ bias[0..16)) (+ y[0..16) when accumulating). */
static inline void finish16(float *y, __m512 v, const float *bias, int accumulate) {
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
    if (accumulate) v = _mm512_add_ps(v, _mm512_loadu_ps(y));
    _mm512_storeu_ps(y, v);
}

static inline __m512i dot_pairs(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

/* 16 outputs (one per lane) of `rows` (1..4) input rows, accumulated over every group. */
static inline __attribute__((always_inline)) void
quant_tile(const bi_linear *l, int tile, const bi_input *in, int rows, float *y, int64_t ldy,
           int accumulate) {
    const int groups = num_groups(l), k = l->k;
    const int q4 = l->kind == BI_Q4;
    const int64_t chunk_bytes = q4 ? 8 * 32 : 16 * 32;
    const uint8_t *w = (const uint8_t *)l->weight + (int64_t)tile * groups * chunk_bytes;
    const float *sc = l->scale + (int64_t)tile * groups * TILE_Q;
    const float *off = q4 ? l->offset + (int64_t)tile * groups * TILE_Q : NULL;
    const __m512i low = _mm512_set1_epi16(0x0f);
    __m512 acc[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *wg = w + g * chunk_bytes;
        /* two chains of multiply-adds per row (a dot-product instruction's latency is several
         * of its issue slots): pairs i and i + 8, or even and odd pairs */
        __m512i d[ROW_TILE], e[ROW_TILE];
        for (int r = 0; r < ROW_TILE; r++) d[r] = e[r] = _mm512_setzero_si512();
        if (q4) {
            for (int i = 0; i < 8; i++) {  /* pairs i and i + 8 of the group */
                const __m512i v = _mm512_cvtepu8_epi16(
                    _mm256_loadu_si256((const __m256i *)(wg + 32 * i)));
                const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_srli_epi16(v, 4);
                for (int r = 0; r < rows; r++) {
                    const int32_t *xp = (const int32_t *)(in->q + (int64_t)r * k + g * GROUP);
                    d[r] = dot_pairs(d[r], lo, _mm512_set1_epi32(xp[i]));
                    e[r] = dot_pairs(e[r], hi, _mm512_set1_epi32(xp[i + 8]));
                }
            }
        } else {
            for (int p = 0; p < 16; p += 2) {
                const __m512i v0 = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const __m256i *)(wg + 32 * p)));
                const __m512i v1 = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const __m256i *)(wg + 32 * p + 32)));
                for (int r = 0; r < rows; r++) {
                    const int32_t *xp = (const int32_t *)(in->q + (int64_t)r * k + g * GROUP);
                    d[r] = dot_pairs(d[r], v0, _mm512_set1_epi32(xp[p]));
                    e[r] = dot_pairs(e[r], v1, _mm512_set1_epi32(xp[p + 1]));
                }
            }
        }
        for (int r = 0; r < rows; r++) d[r] = _mm512_add_epi32(d[r], e[r]);
        const __m512 s = _mm512_loadu_ps(sc + g * TILE_Q);
        for (int r = 0; r < rows; r++) {
            const int64_t at = (int64_t)r * groups + g;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r]),
                                     _mm512_mul_ps(s, _mm512_set1_ps(in->scale[at])), acc[r]);
            if (q4)
                acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(off + g * TILE_Q),
                                         _mm512_set1_ps(in->sum[at]), acc[r]);
        }
    }
    const float *bias = l->bias ? l->bias + tile * TILE_Q : NULL;
    for (int r = 0; r < rows; r++) finish16(y + r * ldy + tile * TILE_Q, acc[r], bias, accumulate);
}

/* One group's weights of T tiles, unpacked to 16 bits in input-pair order: `wb[t][p]` holds
 * each of the tile's 16 outputs' weights for inputs 2p and 2p + 1 (one 32-bit lane each). */
static inline __attribute__((always_inline)) void
unpack_group16(const bi_linear *l, const int Q4, int tile, const int T, int g, __m512i *wb) {
    const __m512i low = _mm512_set1_epi16(0x0f);
    for (int t = 0; t < T; t++) {
        const uint8_t *wg = group_bytes(l, Q4, tile + t, g);
        __m512i *w = wb + 16 * t;
        if (Q4) {  /* chunk i: pair i in the low nibbles, pair i + 8 in the high ones */
            for (int i = 0; i < 8; i++) {
                const __m512i v = _mm512_cvtepu8_epi16(
                    _mm256_loadu_si256((const __m256i *)(wg + 32 * i)));
                _mm512_store_si512(w + i, _mm512_and_si512(v, low));
                _mm512_store_si512(w + i + 8, _mm512_srli_epi16(v, 4));
            }
        } else {
            for (int p = 0; p < 16; p++)
                _mm512_store_si512(w + p, _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const __m256i *)(wg + 32 * p))));
        }
    }
}

/* What adding to a float's bits multiplies it by the input scale `scale` (a power of two from
 * input_scale16): (j << 23). */
static inline int32_t input_exponent(float scale) {
    int32_t bits;
    memcpy(&bits, &scale, sizeof bits);
    return bits - 0x3f800000;
}

/* s * the input's power-of-two scale xs, whose `input_exponent` is xe. For q4, whose
 * epilogue has a second multiply-add (the offsets), an integer add to the exponents, which
 * leaves the vector units' multiply issue slots to the integer products; a float multiply for
 * q8, where the add measured slower. The same product either way. */
static inline __m512 scaled(const int Q4, __m512 s, __m512i xe, __m512 xs) {
    return Q4 ? _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(s), xe))
              : _mm512_mul_ps(s, xs);
}

/* R rows x T tiles of one group: one chain of multiply-adds per (row, tile), a pair of
 * inputs broadcast against each tile's weights; then acc[row][t] += the products, scaled
 * (and q4's offsets times the group's input sum). */
static inline __attribute__((always_inline)) void
rows_tiles16(const __m512i *wb, const int Q4, const int T, const bi_input *in, int k,
             int groups, int g, int r0, const int R, const __m512 *s, const __m512 *off,
             float *acc) {
    __asm__("" : "+r"(wb));  /* see rows_tiles16_4x4 */
    __m512i d[HELD_ROWS][HELD_TILES];
    const int32_t *xp[HELD_ROWS];
    for (int r = 0; r < R; r++) {
        xp[r] = (const int32_t *)(in->q + (int64_t)(r0 + r) * k + g * GROUP);
        for (int t = 0; t < T; t++) d[r][t] = _mm512_setzero_si512();
    }
    for (int p = 0; p < 16; p++) {
        __m512i w[HELD_TILES];
        for (int t = 0; t < T; t++) w[t] = _mm512_load_si512(wb + 16 * t + p);
        for (int r = 0; r < R; r++) {
            const __m512i x = _mm512_set1_epi32(xp[r][p]);
            for (int t = 0; t < T; t++) d[r][t] = dot_pairs(d[r][t], w[t], x);
        }
    }
    for (int r = 0; r < R; r++) {
        const int64_t at = (int64_t)(r0 + r) * groups + g;
        const __m512i xe = _mm512_set1_epi32(input_exponent(in->scale[at]));
        const __m512 xs = _mm512_set1_ps(in->scale[at]), xsum = _mm512_set1_ps(in->sum[at]);
        for (int t = 0; t < T; t++) {
            float *a = acc + ((r0 + r) * HELD_TILES + t) * TILE_Q;
            __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][t]), scaled(Q4, s[t], xe, xs),
                                       _mm512_load_ps(a));
            if (Q4) v = _mm512_fmadd_ps(off[t], xsum, v);
            _mm512_store_ps(a, v);
        }
    }
}

/* rows_tiles16 for 4 rows x 4 tiles, written out: sixteen named accumulators, which the
 * compiler keeps in registers (arrays of them it shuffles between registers and the stack);
 * the scales are read from memory in the epilogue, leaving registers to the chains. */
#define DOT4(R, X)                                                                        \
    x = _mm512_set1_epi32(X[p]);                                                          \
    d##R##0 = dot_pairs(d##R##0, w0, x); d##R##1 = dot_pairs(d##R##1, w1, x);             \
    d##R##2 = dot_pairs(d##R##2, w2, x); d##R##3 = dot_pairs(d##R##3, w3, x)
#define SCALE_INTO(R, T, D)                                                               \
    do {                                                                                  \
        float *a = acc + ((r0 + R) * HELD_TILES + T) * TILE_Q;                            \
        __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D),                                 \
                                   scaled(Q4, _mm512_load_ps(s + T * TILE_Q), xe, xs),    \
                                   _mm512_load_ps(a));                                    \
        if (Q4) v = _mm512_fmadd_ps(_mm512_load_ps(off + T * TILE_Q), xsum, v);           \
        _mm512_store_ps(a, v);                                                            \
    } while (0)
#define SCALE_ROW(R)                                                                      \
    do {                                                                                  \
        const int64_t at = (int64_t)(r0 + R) * groups + g;                                \
        const __m512i xe = _mm512_set1_epi32(input_exponent(in->scale[at]));             \
        const __m512 xs = _mm512_set1_ps(in->scale[at]), xsum = _mm512_set1_ps(in->sum[at]); \
        SCALE_INTO(R, 0, d##R##0); SCALE_INTO(R, 1, d##R##1);                             \
        SCALE_INTO(R, 2, d##R##2); SCALE_INTO(R, 3, d##R##3);                             \
    } while (0)

static inline __attribute__((always_inline)) void
rows_tiles16_4x4(const __m512i *wb, const int Q4, const bi_input *in, int k, int groups, int g,
                 int r0, const float *s, const float *off, float *acc) {
    /* The weights are the same for every row of the group: left visible, the compiler would
     * hoist all 64 of their loads out of the rows' loop and spill the accumulators. */
    __asm__("" : "+r"(wb));
    const int32_t *x0 = (const int32_t *)(in->q + (int64_t)r0 * k + g * GROUP);
    const int32_t *x1 = x0 + k / 2, *x2 = x1 + k / 2, *x3 = x2 + k / 2;
    __m512i d00 = _mm512_setzero_si512(), d01 = d00, d02 = d00, d03 = d00, d10 = d00,
            d11 = d00, d12 = d00, d13 = d00, d20 = d00, d21 = d00, d22 = d00, d23 = d00,
            d30 = d00, d31 = d00, d32 = d00, d33 = d00, x;
#pragma GCC unroll 16
    for (int p = 0; p < 16; p++) {
        const __m512i w0 = _mm512_load_si512(wb + p), w1 = _mm512_load_si512(wb + 16 + p),
                      w2 = _mm512_load_si512(wb + 32 + p), w3 = _mm512_load_si512(wb + 48 + p);
        DOT4(0, x0); DOT4(1, x1); DOT4(2, x2); DOT4(3, x3);
    }
    SCALE_ROW(0); SCALE_ROW(1); SCALE_ROW(2); SCALE_ROW(3);
}
#undef DOT4
#undef SCALE_INTO
#undef SCALE_ROW

/* Tiles [tile, tile + T) for up to BLOCK_ROWS rows, group by group: the group's weights are
 * unpacked once (into L1) and serve every row, HELD_ROWS rows at a time. */
static inline __attribute__((always_inline)) void
held_tiles16_kind(const bi_linear *l, const int Q4, int tile, const int T, const bi_input *in,
                  int rows, float *y, int64_t ldy, int accumulate) {
    const int groups = num_groups(l), k = l->k;
    __m512i wb[HELD_TILES * 16];
    float acc[BLOCK_ROWS * HELD_TILES * TILE_Q] __attribute__((aligned(64)));
    memset(acc, 0, sizeof(float) * rows * HELD_TILES * TILE_Q);
    for (int g = 0; g < groups; g++) {
        unpack_group16(l, Q4, tile, T, g, wb);
        __m512 s[HELD_TILES], off[HELD_TILES];
        for (int t = 0; t < T; t++) {
            const int64_t at = ((int64_t)(tile + t) * groups + g) * TILE_Q;
            s[t] = _mm512_loadu_ps(l->scale + at);
            off[t] = Q4 ? _mm512_loadu_ps(l->offset + at) : _mm512_setzero_ps();
        }
#define ROWS16(R0, R)                                                                     \
    if ((R) == HELD_ROWS && T == HELD_TILES)                                              \
        rows_tiles16_4x4(wb, Q4, in, k, groups, g, R0, (const float *)s, (const float *)off, \
                         acc);                                                            \
    else                                                                                  \
        rows_tiles16(wb, Q4, T, in, k, groups, g, R0, R, s, off, acc)
        FOR_HELD_ROWS(rows, ROWS16);
#undef ROWS16
    }
    for (int t = 0; t < T; t++) {
        const float *bias = l->bias ? l->bias + (tile + t) * TILE_Q : NULL;
        for (int r = 0; r < rows; r++)
            finish16(y + r * ldy + (tile + t) * TILE_Q,
                     _mm512_load_ps(acc + (r * HELD_TILES + t) * TILE_Q), bias, accumulate);
    }
}

/* ---- 8-bit activations (opt-in, many rows) -------------------------------------------
 *
 * Rounding the input to 8-bit integers per group of 32 (largest |x| / 127, as llama.cpp's Q8
 * activations and OpenVINO's dynamic quantization do) lets one `vpdpbusd` take four inputs
 * against four weights of 16 outputs: twice `vpdpwssd`'s work per instruction. A group's
 * weights are arranged into 32-bit lanes of four consecutive inputs once per block of rows:
 * q4 as unsigned bytes (0..15) against signed inputs; q8 signed against the inputs stored
 * unsigned (+128), the 128 x sum of the weights taken off again. The error per input is up to
 * 1/254 of its group's largest, where the 16-bit rounding's is 1/65534. */
#if BI_ACT8
/* Groups of one row into int8 (`flip`: stored as unsigned, +128), scales and float sums. */
static void quantize_groups8(const float *x, int groups, int8_t *q, float *scale, float *sum,
                             int flip) {
    const __m512 sign = _mm512_set1_ps(-0.f);
    const __m128i bias = _mm_set1_epi8((char)0x80);
    for (int g = 0; g < groups; g++) {
        const __m512 a = _mm512_loadu_ps(x + g * GROUP), b = _mm512_loadu_ps(x + g * GROUP + 16);
        const float top = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        const __m512 inv = _mm512_set1_ps(top > TINY_GROUP ? 127.f / top : 0.f);
        __m128i qa = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)));
        __m128i qb = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv)));
        if (flip) {
            qa = _mm_xor_si128(qa, bias);
            qb = _mm_xor_si128(qb, bias);
        }
        _mm_storeu_si128((__m128i *)(q + g * GROUP), qa);
        _mm_storeu_si128((__m128i *)(q + g * GROUP + 16), qb);
        scale[g] = top / 127.f;
        sum[g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
}

/* One group's weights of T tiles as four-input lanes: `wb[t][m]` holds each output's weights
 * for inputs 4m..4m+3 (q4: unsigned 0..15; q8: signed, with `wsum[t]` = 128 x each output's
 * weight sum, for the inputs stored +128). */
static inline __attribute__((always_inline)) void
unpack_group8(const bi_linear *l, const int Q4, int tile, const int T, int g, __m512i *wb,
              __m512i *wsum) {
    const __m512i nibbles = _mm512_set1_epi8(0x0f), ones = _mm512_set1_epi8(1);
    for (int t = 0; t < T; t++) {
        const uint8_t *wg = group_bytes(l, Q4, tile + t, g);
        __m512i *w = wb + 8 * t, sum = _mm512_setzero_si512();
        for (int m = 0; m < (Q4 ? 4 : 8); m++) {
            /* lane j: output j's 16-bit pair from chunk 2m, then chunk 2m + 1's */
            const __m512i v = _mm512_or_si512(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(wg + 64 * m))),
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256((const __m256i *)(wg + 64 * m + 32))), 16));
            if (Q4) {  /* low nibbles: inputs 4m..; high ones: 16 + 4m.. */
                _mm512_store_si512(w + m, _mm512_and_si512(v, nibbles));
                _mm512_store_si512(w + m + 4, _mm512_and_si512(_mm512_srli_epi32(v, 4), nibbles));
            } else {
                _mm512_store_si512(w + m, v);
                sum = _mm512_dpbusd_epi32(sum, ones, v);
            }
        }
        if (!Q4) _mm512_store_si512(wsum + t, _mm512_slli_epi32(sum, 7));
    }
}

static inline __m512i dot_quads(const int Q4, __m512i acc, __m512i w, __m512i x) {
    return Q4 ? _mm512_dpbusd_epi32(acc, w, x) : _mm512_dpbusd_epi32(acc, x, w);
}

/* acc[row][t] += one group's 8-bit products of a row and tile, scaled (see rows_tiles16). */
static inline __attribute__((always_inline)) void
scale_into8(const int Q4, __m512i dot, __m512i wsum, __m512 s, __m512 off, float xs,
            float xsum, float *a) {
    if (!Q4) dot = _mm512_sub_epi32(dot, wsum);
    __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(xs)),
                               _mm512_load_ps(a));
    if (Q4) v = _mm512_fmadd_ps(off, _mm512_set1_ps(xsum), v);
    _mm512_store_ps(a, v);
}

/* R rows x T tiles of one group of 8-bit inputs. */
static inline __attribute__((always_inline)) void
rows_tiles8(const __m512i *wb, const __m512i *wsum, const int Q4, const int T, const int8_t *xq,
            const float *xs, const float *xsum, int k, int groups, int g, int r0, const int R,
            const __m512 *s, const __m512 *off, float *acc) {
    __asm__("" : "+r"(wb));  /* see rows_tiles16_4x4 */
    __m512i d[HELD_ROWS][HELD_TILES];
    const int32_t *xp[HELD_ROWS];
    for (int r = 0; r < R; r++) {
        xp[r] = (const int32_t *)(xq + (int64_t)(r0 + r) * k + g * GROUP);
        for (int t = 0; t < T; t++) d[r][t] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int m = 0; m < 8; m++) {
        __m512i w[HELD_TILES];
        for (int t = 0; t < T; t++) w[t] = _mm512_load_si512(wb + 8 * t + m);
        for (int r = 0; r < R; r++) {
            const __m512i x = _mm512_set1_epi32(xp[r][m]);
            for (int t = 0; t < T; t++) d[r][t] = dot_quads(Q4, d[r][t], w[t], x);
        }
    }
    for (int r = 0; r < R; r++) {
        const int64_t at = (int64_t)(r0 + r) * groups + g;
        for (int t = 0; t < T; t++)
            scale_into8(Q4, d[r][t], wsum[t], s[t], off[t], xs[at], xsum[at],
                        acc + ((r0 + r) * HELD_TILES + t) * TILE_Q);
    }
}

/* rows_tiles8 for 4 rows x 4 tiles, written out (see rows_tiles16_4x4). */
#define QUAD4(R, X)                                                                       \
    x = _mm512_set1_epi32(X[m]);                                                          \
    d##R##0 = dot_quads(Q4, d##R##0, w0, x); d##R##1 = dot_quads(Q4, d##R##1, w1, x);     \
    d##R##2 = dot_quads(Q4, d##R##2, w2, x); d##R##3 = dot_quads(Q4, d##R##3, w3, x)
#define SCALE_ROW8(R)                                                                     \
    do {                                                                                  \
        const int64_t at = (int64_t)(r0 + R) * groups + g;                                \
        float *a = acc + (r0 + R) * HELD_TILES * TILE_Q;                                  \
        scale_into8(Q4, d##R##0, wsum[0], s[0], off[0], xs[at], xsum[at], a);             \
        scale_into8(Q4, d##R##1, wsum[1], s[1], off[1], xs[at], xsum[at], a + TILE_Q);    \
        scale_into8(Q4, d##R##2, wsum[2], s[2], off[2], xs[at], xsum[at], a + 2 * TILE_Q); \
        scale_into8(Q4, d##R##3, wsum[3], s[3], off[3], xs[at], xsum[at], a + 3 * TILE_Q); \
    } while (0)

static inline __attribute__((always_inline)) void
rows_tiles8_4x4(const __m512i *wb, const __m512i *wsum, const int Q4, const int8_t *xq,
                const float *xs, const float *xsum, int k, int groups, int g, int r0,
                const __m512 *s, const __m512 *off, float *acc) {
    __asm__("" : "+r"(wb));  /* see rows_tiles16_4x4 */
    const int32_t *x0 = (const int32_t *)(xq + (int64_t)r0 * k + g * GROUP);
    const int32_t *x1 = x0 + k / 4, *x2 = x1 + k / 4, *x3 = x2 + k / 4;
    __m512i d00 = _mm512_setzero_si512(), d01 = d00, d02 = d00, d03 = d00, d10 = d00,
            d11 = d00, d12 = d00, d13 = d00, d20 = d00, d21 = d00, d22 = d00, d23 = d00,
            d30 = d00, d31 = d00, d32 = d00, d33 = d00, x;
#pragma GCC unroll 8
    for (int m = 0; m < 8; m++) {
        const __m512i w0 = _mm512_load_si512(wb + m), w1 = _mm512_load_si512(wb + 8 + m),
                      w2 = _mm512_load_si512(wb + 16 + m), w3 = _mm512_load_si512(wb + 24 + m);
        QUAD4(0, x0); QUAD4(1, x1); QUAD4(2, x2); QUAD4(3, x3);
    }
    SCALE_ROW8(0); SCALE_ROW8(1); SCALE_ROW8(2); SCALE_ROW8(3);
}
#undef QUAD4
#undef SCALE_ROW8

/* Tiles [tile, tile + T) for up to BLOCK_ROWS rows of 8-bit inputs (see held_tiles16_kind). */
static inline __attribute__((always_inline)) void
held_tiles8_kind(const bi_linear *l, const int Q4, int tile, const int T, const int8_t *xq,
                 const float *xs, const float *xsum, int rows, float *y, int64_t ldy,
                 int accumulate) {
    const int groups = num_groups(l), k = l->k;
    __m512i wb[HELD_TILES * 8], wsum[HELD_TILES];
    float acc[BLOCK_ROWS * HELD_TILES * TILE_Q] __attribute__((aligned(64)));
    memset(acc, 0, sizeof(float) * rows * HELD_TILES * TILE_Q);
    for (int t = 0; t < HELD_TILES; t++) wsum[t] = _mm512_setzero_si512();  /* q4: unused */
    for (int g = 0; g < groups; g++) {
        unpack_group8(l, Q4, tile, T, g, wb, wsum);
        __m512 s[HELD_TILES], off[HELD_TILES];
        for (int t = 0; t < HELD_TILES; t++) {
            const int64_t at = ((int64_t)(tile + t) * groups + g) * TILE_Q;
            s[t] = t < T ? _mm512_loadu_ps(l->scale + at) : _mm512_setzero_ps();
            off[t] = Q4 && t < T ? _mm512_loadu_ps(l->offset + at) : _mm512_setzero_ps();
        }
#define ROWS8(R0, R)                                                                      \
    if ((R) == HELD_ROWS && T == HELD_TILES)                                              \
        rows_tiles8_4x4(wb, wsum, Q4, xq, xs, xsum, k, groups, g, R0, s, off, acc);        \
    else                                                                                  \
        rows_tiles8(wb, wsum, Q4, T, xq, xs, xsum, k, groups, g, R0, R, s, off, acc)
        FOR_HELD_ROWS(rows, ROWS8);
#undef ROWS8
    }
    for (int t = 0; t < T; t++) {
        const float *bias = l->bias ? l->bias + (tile + t) * TILE_Q : NULL;
        for (int r = 0; r < rows; r++)
            finish16(y + r * ldy + (tile + t) * TILE_Q,
                     _mm512_load_ps(acc + (r * HELD_TILES + t) * TILE_Q), bias, accumulate);
    }
}
#endif

/* e^x, relative error ~1e-7 (x clamped to [-87, 88]): 2^(x log2 e) split into an integer
 * part (scalef) and a fraction in [-0.5, 0.5] (degree-6 polynomial). */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, r), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, r);
}

/* erf(x) to within 1.5e-7 (Abramowitz and Stegun 7.1.26): 1 - poly(t) exp(-x^2),
 * t = 1 / (1 + 0.3275911 |x|), the sign of x. */
static inline __m512 erf_ps(__m512 x) {
    const __m512 sign = _mm512_set1_ps(-0.f);
    const __m512 ax = _mm512_andnot_ps(sign, x);
    /* t = 1 / d: the 14-bit reciprocal estimate and one Newton step (~1e-8 relative), a
     * third of a division's cost */
    const __m512 d = _mm512_fmadd_ps(ax, _mm512_set1_ps(0.3275911f), _mm512_set1_ps(1.f));
    const __m512 r = _mm512_rcp14_ps(d);
    const __m512 t = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
    __m512 p = _mm512_set1_ps(1.061405429f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
    p = _mm512_mul_ps(p, t);
    const __m512 e = exp_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), ax), ax));
    const __m512 y = _mm512_fnmadd_ps(p, e, _mm512_set1_ps(1.f));
    return _mm512_or_ps(y, _mm512_and_ps(x, sign));
}

/* The vector parts of the driver's loops (see common.h). */
BI_INLINE int64_t kv_widen(const void *src, int64_t n, int type, float *dst) {
    int64_t i = 0;
    const uint16_t *h = src;
    const uint8_t *b = src;
    switch (type) {
    case BI_KV_F16:
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(h + i))));
        return i;
    case BI_KV_BF16:
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(h + i))), 16)));
        return i;
    case BI_KV_E5M2:
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_slli_epi16(
                _mm256_cvtepu8_epi16(_mm_loadu_si128((const void *)(b + i))), 8)));
        return i;
    case BI_KV_E4M3: {
        const __m256i sign = _mm256_set1_epi16(0x80), rest = _mm256_set1_epi16(0x7F);
        const __m512 two8 = _mm512_set1_ps(256.f);
        for (; i + 16 <= n; i += 16) {
            const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const void *)(b + i)));
            const __m256i e = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, sign), 8),
                                              _mm256_slli_epi16(_mm256_and_si256(x, rest), 7));
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtph_ps(e), two8));
        }
        return i;
    }
    default: return 0;
    }
}

BI_INLINE int silu_mul_span(float *out, const float *g, const float *u, int i, int last) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= last; i += 16) {
        const __m512 v = _mm512_loadu_ps(g + i);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(one, e)),
                                                _mm512_loadu_ps(u + i)));
    }
    return i;
}

BI_INLINE int64_t gelu_span(float *x, int64_t i, int64_t end) {
    const __m512 half = _mm512_set1_ps(0.5f), root = _mm512_set1_ps(0.70710678118654752f);
    for (; i + 16 <= end; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512 e = erf_ps(_mm512_mul_ps(v, root));
        _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_mul_ps(v, half),
                                              _mm512_add_ps(e, _mm512_set1_ps(1.f))));
    }
    return i;
}

BI_INLINE int exp_shifted_span(float *s, int n, float m, float *sum) {
    int i = 0;
    __m512 acc = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        const __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
        _mm512_storeu_ps(s + i, p);
        acc = _mm512_add_ps(acc, p);
    }
    *sum = _mm512_reduce_add_ps(acc);
    return i;
}

BI_INLINE int dot_span(const float *a, const float *b, int d, float *sum) {
    if (d % 16) return 0;
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
    for (int i = 16; i < d; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    *sum = _mm512_reduce_add_ps(acc);
    return d;
}

/* one dependent max per 16 scores, not per score */
BI_INLINE int max_span(const float *s, int n, float *best) {
    int t = 0;
    __m512 top = _mm512_set1_ps(*best);
    for (; t + 16 <= n; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t));
    if (t < n)
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, (__mmask16)((1u << (n - t)) - 1),
                                                      s + t));
    *best = _mm512_reduce_max_ps(top);
    return n;
}

/* Lane t of the result: the sum of a[t]'s 16 lanes (16 horizontal sums in 45 instructions,
 * where one at a time takes about 8 each). */
static inline __m512 sum_lanes16(const __m512 a[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [a2i 0+2, a2i+1 0+2, a2i 1+3, a2i+1 1+3] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int j = 0; j < 4; j++)  /* per 128-bit lane: partial sums of a[4j .. 4j+3] */
        c[j] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* 16 cache elements from element `i` of `p` (of type KT: float32, float16, bfloat16, e5m2)
 * as float32, widened in registers as `kv_load` widens them. */
static inline __attribute__((always_inline)) __m512 load_kv16(const void *p, int64_t i,
                                                              const int KT) {
    if (KT == BI_KV_F32) return _mm512_loadu_ps((const float *)p + i);
    if (KT == BI_KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    if (KT == BI_KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16));
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(
        _mm_loadu_si128((const __m128i *)((const uint8_t *)p + i))), 8));  /* e5m2 */
}

/* The same for a head size D known at compile time (a multiple of 16), reading keys and
 * values of cache type KT in place (widened in registers): 16 keys at a time (16 independent
 * chains of multiply-adds, summed across lanes together), and each output held in registers
 * across the block's values instead of stored and reloaded per value. */
static inline __attribute__((always_inline)) void
block_scores_fixed(const float *q, const void *keys, int n, int per_kv, const int D, const int KT,
                   float scale, float *scores, int bs) {
    const __m512 sv = _mm512_set1_ps(scale);
    for (int h = 0; h < per_kv; h++) {
        __m512 qv[D / 16];
        for (int c = 0; c < D / 16; c++) qv[c] = _mm512_loadu_ps(q + h * D + 16 * c);
        for (int t0 = 0; t0 < n; t0 += 16) {
            const int m = n - t0 < 16 ? n - t0 : 16;
            __m512 a[16];
            for (int i = 0; i < 16; i++) {
                if (i >= m) {
                    a[i] = _mm512_setzero_ps();
                    continue;
                }
                const int64_t key = (int64_t)(t0 + i) * D;
                a[i] = _mm512_mul_ps(qv[0], load_kv16(keys, key, KT));
                for (int c = 1; c < D / 16; c++)
                    a[i] = _mm512_fmadd_ps(qv[c], load_kv16(keys, key + 16 * c, KT), a[i]);
            }
            _mm512_mask_storeu_ps(scores + h * bs + t0, (__mmask16)((1u << m) - 1),
                                  _mm512_mul_ps(sum_lanes16(a), sv));
        }
    }
}

static inline __attribute__((always_inline)) void
block_values_fixed(const float *p, const void *values, int n, int per_kv, const int D,
                   const int KT, float *out, int bs) {
    for (int h = 0; h < per_kv; h++)
        for (int c0 = 0; c0 < D / 16; c0 += 4) {
            const int chunks = D / 16 - c0 < 4 ? D / 16 - c0 : 4;
            __m512 a[4], b[4];
            for (int i = 0; i < chunks; i++) {
                a[i] = _mm512_loadu_ps(out + h * D + 16 * (c0 + i));
                b[i] = _mm512_setzero_ps();
            }
            int t = 0;
            for (; t + 2 <= n; t += 2) {  /* two chains: even and odd values */
                const __m512 w0 = _mm512_set1_ps(p[h * bs + t]);
                const __m512 w1 = _mm512_set1_ps(p[h * bs + t + 1]);
                const int64_t v0 = (int64_t)t * D + 16 * c0, v1 = v0 + D;
                for (int i = 0; i < chunks; i++) {
                    a[i] = _mm512_fmadd_ps(w0, load_kv16(values, v0 + 16 * i, KT), a[i]);
                    b[i] = _mm512_fmadd_ps(w1, load_kv16(values, v1 + 16 * i, KT), b[i]);
                }
            }
            if (t < n) {
                const __m512 w0 = _mm512_set1_ps(p[h * bs + t]);
                const int64_t v0 = (int64_t)t * D + 16 * c0;
                for (int i = 0; i < chunks; i++)
                    a[i] = _mm512_fmadd_ps(w0, load_kv16(values, v0 + 16 * i, KT), a[i]);
            }
            for (int i = 0; i < chunks; i++)
                _mm512_storeu_ps(out + h * D + 16 * (c0 + i), _mm512_add_ps(a[i], b[i]));
        }
}

/* One softmax row of the packed attention: exp(s - max) over its n scores; *inv = 1 / sum. */
BI_INLINE int softmax_row_fast(float *s, int n, float *inv) {
    float best;
    int j = 0;
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    if (j < n)
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, (__mmask16)((1u << (n - j)) - 1), s + j));
    best = _mm512_reduce_max_ps(m);
    const __m512 mv = _mm512_set1_ps(best);
    __m512 acc = _mm512_setzero_ps();
    for (j = 0; j + 16 <= n; j += 16) {
        const __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
        _mm512_storeu_ps(s + j, p);
        acc = _mm512_add_ps(acc, p);
    }
    if (j < n) {
        const __mmask16 mask = (__mmask16)((1u << (n - j)) - 1);
        const __m512 p = _mm512_maskz_mov_ps(
            mask, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), mv)));
        _mm512_mask_storeu_ps(s + j, mask, p);
        acc = _mm512_add_ps(acc, p);
    }
    *inv = 1.f / _mm512_reduce_add_ps(acc);
    return 1;
}

/* scores[r][j] = q_r . kt[:, j] for r < R, j < n rounded up to 16 (kt: `[D][ldk]`, zero past
 * n). R and D are constants wherever this is inlined, so every accumulator is a register. */
static inline __attribute__((always_inline)) void
sentence_scores(const float *const *qr, const int R, const float *kt, int64_t ldk, int n,
                const int D, float *scores, int64_t lds) {
    int j0 = 0;
    enum { W = 16 / QROWS };  /* key vectors per pass: 16 accumulators */
    for (; j0 + 16 * W <= n; j0 += 16 * W) {
        __m512 acc[QROWS][W];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < W; i++) acc[r][i] = _mm512_setzero_ps();
        for (int c = 0; c < D; c++) {
            const float *row = kt + c * ldk + j0;
            __m512 kv[W];
            for (int i = 0; i < W; i++) kv[i] = _mm512_loadu_ps(row + 16 * i);
            for (int r = 0; r < R; r++) {
                const __m512 qv = _mm512_set1_ps(qr[r][c]);
                for (int i = 0; i < W; i++) acc[r][i] = _mm512_fmadd_ps(qv, kv[i], acc[r][i]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int i = 0; i < W; i++) _mm512_storeu_ps(scores + r * lds + j0 + 16 * i, acc[r][i]);
    }
    for (; j0 < n; j0 += 16) {  /* the last keys, 16 at a time (all of a short sentence's) */
        __m512 acc[QROWS], odd[QROWS];  /* even and odd c: twice the chains of multiply-adds */
        for (int r = 0; r < R; r++) acc[r] = odd[r] = _mm512_setzero_ps();
        for (int c = 0; c < D; c += 2) {
            const __m512 k0 = _mm512_loadu_ps(kt + c * ldk + j0);
            const __m512 k1 = _mm512_loadu_ps(kt + (c + 1) * ldk + j0);
            for (int r = 0; r < R; r++) {
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][c]), k0, acc[r]);
                odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][c + 1]), k1, odd[r]);
            }
        }
        for (int r = 0; r < R; r++)
            _mm512_storeu_ps(scores + r * lds + j0, _mm512_add_ps(acc[r], odd[r]));
    }
}

/* out_r = inv[r] * sum_j p[r][j] v_j for r < R (v rows `ld` apart; D a multiple of 16, at
 * most 64, and R constants where inlined). */
static inline __attribute__((always_inline)) void
sentence_values(const float *p, int64_t lds, const int R, const float *v, int64_t ld, int n,
                const int D, const float *inv, float *const *outr) {
    __m512 acc[QROWS][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < D / 16; i++) acc[r][i] = _mm512_setzero_ps();
    for (int j = 0; j < n; j++) {
        const float *vj = v + j * ld;
        __m512 vv[4];
        for (int i = 0; i < D / 16; i++) vv[i] = _mm512_loadu_ps(vj + 16 * i);
        for (int r = 0; r < R; r++) {
            const __m512 w = _mm512_set1_ps(p[r * lds + j]);
            for (int i = 0; i < D / 16; i++) acc[r][i] = _mm512_fmadd_ps(w, vv[i], acc[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < D / 16; i++)
            _mm512_storeu_ps(outr[r] + 16 * i, _mm512_mul_ps(acc[r][i], _mm512_set1_ps(inv[r])));
}


/* r[i] <- column i of the 16 x 16 block r (rows r[0..16)). */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
}

BI_INLINE int transpose_keys_fast(const float *keys, int64_t ldk, int n, int d, float scale,
                               float *kt, int64_t ldt) {
    const int padded = (n + 15) / 16 * 16;
    if (d % 16 == 0) {  /* 16 keys x 16 values at a time, transposed in registers */
        const __m512 sv = _mm512_set1_ps(scale);
        for (int j0 = 0; j0 < padded; j0 += 16)
            for (int c0 = 0; c0 < d; c0 += 16) {
                __m512 r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = j0 + i < n ? _mm512_mul_ps(_mm512_loadu_ps(keys + (j0 + i) * ldk + c0),
                                                      sv)
                                      : _mm512_setzero_ps();
                transpose16(r);
                for (int i = 0; i < 16; i++) _mm512_storeu_ps(kt + (c0 + i) * ldt + j0, r[i]);
            }
        return 1;
    }
    return 0;
}
