/* Arm NEON (AArch64, where Advanced SIMD is always there), 128 bits at a time: the quantized
 * products as 16-bit integer multiply-adds widening to 32 bits (`smlal`; for 8+ rows against
 * weights unpacked once per group), 8-bit ones by `sdot` where the build targets ARMv8.2's
 * dot products, the float32 GEMV, the inputs' rounding, exp (SiLU, softmax), GELU, the decode
 * attention (keys and values read in place at head sizes 64 and 128), the packed attention
 * and the float16 / bfloat16 / 8-bit cache widening. The integer products are exact, so the
 * results equal the portable level's up to the order of float additions. */
#include <arm_neon.h>
#include "common.h"

#define BI_ISA_NAME "neon"
#define BI_HELD16 1
/* BI_ACT8: below, 1 where the build targets the dot-product extension */
#define BI_FIXED_KV 1
#define BI_PACKED_FAST 1
#define BI_SOFTMAX_FAST 1
#define BI_GELU_FAST 1

/* A group of 32 inputs into v[8]; returns their largest |x|, `*sum` their float sum. */
static inline __attribute__((always_inline)) float load_group(const float *x, float32x4_t v[8],
                                                              float *sum) {
    for (int i = 0; i < 8; i++) v[i] = vld1q_f32(x + 4 * i);
    float32x4_t top4 = vabsq_f32(v[0]), total4 = v[0];
    for (int i = 1; i < 8; i++) {
        top4 = vmaxq_f32(top4, vabsq_f32(v[i]));
        total4 = vaddq_f32(total4, v[i]);
    }
    *sum = vaddvq_f32(total4);
    return vmaxvq_f32(top4);
}

/* Groups [0, groups) of one row into 16-bit integers, scales and sums. */
static void quantize_groups(const float *x, int groups, int16_t *q, float *scale, float *sum) {
    for (int g = 0; g < groups; g++) {
        float32x4_t v[8];
        const float top = load_group(x + g * GROUP, v, sum + g);
        float inv_top;
        scale[g] = input_scale16(top, &inv_top);
        const float32x4_t inv = vdupq_n_f32(inv_top);
        for (int i = 0; i < 8; i += 2) {  /* round to nearest, ties to even; narrow saturating */
            const int32x4_t a = vcvtnq_s32_f32(vmulq_f32(v[i], inv));
            const int32x4_t b = vcvtnq_s32_f32(vmulq_f32(v[i + 1], inv));
            vst1q_s16(q + g * GROUP + 4 * i, vcombine_s16(vqmovn_s32(a), vqmovn_s32(b)));
        }
    }
}

/* acc[0], acc[1] += the products of 8 widened weights (4 outputs' weights for an input pair,
 * side by side) and that input pair, repeated in every 32-bit lane of `x`: lane 2m + e holds
 * output m's product with input e of the pair; the two lanes are added once per group. */
static inline __attribute__((always_inline)) void
pair_products(int32x4_t *acc, int16x8_t w, int16x8_t x) {
    acc[0] = vmlal_s16(acc[0], vget_low_s16(w), vget_low_s16(x));
    acc[1] = vmlal_high_s16(acc[1], w, x);
}

/* y[0..16) = v (+ bias) (+ y when accumulating), four lanes at a time. */
static inline void finish16(float *y, const float32x4_t *v, const float *bias, int accumulate) {
    for (int c = 0; c < 4; c++) {
        float32x4_t o = v[c];
        if (bias) o = vaddq_f32(o, vld1q_f32(bias + 4 * c));
        if (accumulate) o = vaddq_f32(o, vld1q_f32(y + 4 * c));
        vst1q_f32(y + 4 * c, o);
    }
}

/* 16 outputs of one row of 16-bit inputs, over every group. */
static inline __attribute__((always_inline)) void
quant_row(const bi_linear *l, int tile, const int16_t *xq, const float *xs, const float *xsum,
          float *y, int accumulate) {
    const int groups = num_groups(l), q4 = l->kind == BI_Q4;
    const int64_t chunk_bytes = q4 ? 8 * 32 : 16 * 32;
    const uint8_t *w = (const uint8_t *)l->weight + (int64_t)tile * groups * chunk_bytes;
    const float *sc = l->scale + (int64_t)tile * groups * TILE_Q;
    const float *off = q4 ? l->offset + (int64_t)tile * groups * TILE_Q : NULL;
    float32x4_t out[4];
    for (int c = 0; c < 4; c++) out[c] = vdupq_n_f32(0.f);
    for (int g = 0; g < groups; g++) {
        const uint8_t *wg = w + g * chunk_bytes;
        const int32_t *xp = (const int32_t *)(xq + g * GROUP);
        int32x4_t acc[8];  /* acc[c]: outputs 2c, 2c + 1, each input of a pair in its lane */
        for (int c = 0; c < 8; c++) acc[c] = vdupq_n_s32(0);
        if (q4) {
            const uint8x16_t low = vdupq_n_u8(0x0f);
            for (int i = 0; i < 8; i++) {  /* chunk i: pair i low, pair i + 8 high */
                const int16x8_t xa = vreinterpretq_s16_s32(vdupq_n_s32(xp[i]));
                const int16x8_t xb = vreinterpretq_s16_s32(vdupq_n_s32(xp[i + 8]));
                for (int half = 0; half < 2; half++) {
                    const uint8x16_t b = vld1q_u8(wg + 32 * i + 16 * half);
                    const uint8x16_t lo = vandq_u8(b, low), hi = vshrq_n_u8(b, 4);
                    int32x4_t *a = acc + 4 * half;
                    pair_products(a, vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(lo))), xa);
                    pair_products(a + 2, vreinterpretq_s16_u16(vmovl_high_u8(lo)), xa);
                    pair_products(a, vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(hi))), xb);
                    pair_products(a + 2, vreinterpretq_s16_u16(vmovl_high_u8(hi)), xb);
                }
            }
        } else {
            for (int p = 0; p < 16; p++) {  /* chunk p: pair p */
                const int16x8_t xa = vreinterpretq_s16_s32(vdupq_n_s32(xp[p]));
                for (int half = 0; half < 2; half++) {
                    const int8x16_t b = vld1q_s8((const int8_t *)wg + 32 * p + 16 * half);
                    pair_products(acc + 4 * half, vmovl_s8(vget_low_s8(b)), xa);
                    pair_products(acc + 4 * half + 2, vmovl_high_s8(b), xa);
                }
            }
        }
        const float32x4_t xsv = vdupq_n_f32(xs[g]);
        for (int c = 0; c < 4; c++) {  /* outputs 4c..4c+3 */
            const float32x4_t dot = vcvtq_f32_s32(vpaddq_s32(acc[2 * c], acc[2 * c + 1]));
            out[c] = vfmaq_f32(out[c], dot, vmulq_f32(vld1q_f32(sc + g * TILE_Q + 4 * c), xsv));
            if (q4)
                out[c] = vfmaq_n_f32(out[c], vld1q_f32(off + g * TILE_Q + 4 * c), xsum[g]);
        }
    }
    finish16(y, out, l->bias ? l->bias + tile * TILE_Q : NULL, accumulate);
}

/* A quantized tile (16 outputs) for `rows` (1..4) rows, a row at a time (its 8 accumulators
 * of 32-bit pairs and the widened weights fill the registers). */
static inline __attribute__((always_inline)) void
quant_tile(const bi_linear *l, int tile, const bi_input *in, int rows, float *y, int64_t ldy,
           int accumulate) {
    const int groups = num_groups(l);
    for (int r = 0; r < rows; r++)
        quant_row(l, tile, in->q + (int64_t)r * l->k, in->scale + (int64_t)r * groups,
                  in->sum + (int64_t)r * groups, y + r * ldy + tile * TILE_Q, accumulate);
}

/* A float32 tile (4 outputs) for `rows` (1..4) rows, one output after another: each weight
 * row is read once, front to back, for every input row, so the tile streams through memory in
 * order. Two chains per input row cover FMA latency. */
static inline __attribute__((always_inline)) void
f32_tile(const bi_linear *l, int tile, const float *x, int64_t ldx, const int rows, float *y,
         int64_t ldy, int accumulate) {
    const int k = l->k;
    const float *bias = l->bias ? l->bias + tile * TILE_F32 : NULL;
    for (int j = 0; j < TILE_F32; j++) {
        const float *w = (const float *)l->weight + ((int64_t)tile * TILE_F32 + j) * k;
        float32x4_t a[ROW_TILE], b[ROW_TILE];
        for (int r = 0; r < rows; r++) a[r] = b[r] = vdupq_n_f32(0.f);
        int i = 0;
        for (; i + 8 <= k; i += 8) {
            const float32x4_t w0 = vld1q_f32(w + i), w1 = vld1q_f32(w + i + 4);
            for (int r = 0; r < rows; r++) {
                a[r] = vfmaq_f32(a[r], w0, vld1q_f32(x + r * ldx + i));
                b[r] = vfmaq_f32(b[r], w1, vld1q_f32(x + r * ldx + i + 4));
            }
        }
        for (int r = 0; r < rows; r++) {
            float total = vaddvq_f32(vaddq_f32(a[r], b[r]));
            for (int t = i; t < k; t++) total += w[t] * x[r * ldx + t];
            finish(y + r * ldy + tile * TILE_F32, j, total, bias, accumulate);
        }
    }
}

/* ---- Held weights for many rows ------------------------------------------------------
 *
 * From MIN_HELD_ROWS rows on, a group's weights of up to HELD_TILES tiles are unpacked once
 * (into L1) and serve every row of a block, four rows at a time: 16-bit weights input by input
 * (`wb[t][i]`: the tile's 16 outputs' weights for input i of the group, two registers), so
 * that `smlal` by a lane (`vmlal_laneq_s16`) multiplies one input of a row by four outputs'
 * weights; 4 rows x 16 outputs make 16 accumulators, 16 independent chains. */

/* One group's weights of T tiles, unpacked to 16 bits input by input (see above). */
static inline __attribute__((always_inline)) void
unpack_group16(const bi_linear *l, const int Q4, int tile, const int T, int g, int16x8_t *wb) {
    const uint8x16_t low = vdupq_n_u8(0x0f);
    for (int t = 0; t < T; t++) {
        const uint8_t *wg = group_bytes(l, Q4, tile + t, g);
        int16x8_t *w = wb + 2 * GROUP * t;
        for (int c = 0; c < (Q4 ? 8 : 16); c++) {
            /* chunk c, de-interleaved: val[e] holds byte e of each output's pair, which is
             * input 2c + e (q8), or inputs 2c + e and 2c + 16 + e in its nibbles (q4) */
            const uint8x16x2_t b = vld2q_u8(wg + 32 * c);
            for (int e = 0; e < 2; e++) {
                int16x8_t *wi = w + 2 * (2 * c + e);
                if (Q4) {
                    const uint8x16_t lo = vandq_u8(b.val[e], low), hi = vshrq_n_u8(b.val[e], 4);
                    wi[0] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(lo)));
                    wi[1] = vreinterpretq_s16_u16(vmovl_high_u8(lo));
                    wi[32] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(hi)));
                    wi[33] = vreinterpretq_s16_u16(vmovl_high_u8(hi));
                } else {
                    const int8x16_t v = vreinterpretq_s8_u8(b.val[e]);
                    wi[0] = vmovl_s8(vget_low_s8(v));
                    wi[1] = vmovl_high_s8(v);
                }
            }
        }
    }
}

/* acc[row][0..16) += one group's integer sums `d` of R rows, scaled by the weights' scales
 * `s` and the row's input scale (and q4's offsets `off` times the group's input sum). */
static inline __attribute__((always_inline)) void
scale_rows(int32x4_t d[HELD_ROWS][4], const int Q4, const float *xs, const float *xsum,
           int groups, int g, int r0, const int R, const float *s, const float *off,
           float *acc) {
    for (int r = 0; r < R; r++) {
        const int64_t at = (int64_t)(r0 + r) * groups + g;
        float *a = acc + (r0 + r) * HELD_TILES * TILE_Q;
        for (int c = 0; c < 4; c++) {
            float32x4_t v = vfmaq_f32(vld1q_f32(a + 4 * c), vcvtq_f32_s32(d[r][c]),
                                      vmulq_n_f32(vld1q_f32(s + 4 * c), xs[at]));
            if (Q4) v = vfmaq_n_f32(v, vld1q_f32(off + 4 * c), xsum[at]);
            vst1q_f32(a + 4 * c, v);
        }
    }
}

/* Input L of each row's 8 (lanes of x[r]) times the 16 outputs' weights for it (w[0], w[1]). */
#define MAC_LANE16(L)                                                                     \
    do {                                                                                  \
        const int16x8_t w0 = w[2 * (L)], w1 = w[2 * (L) + 1];                             \
        for (int r = 0; r < R; r++) {                                                     \
            d[r][0] = vmlal_laneq_s16(d[r][0], vget_low_s16(w0), x[r], L);                \
            d[r][1] = vmlal_high_laneq_s16(d[r][1], w0, x[r], L);                         \
            d[r][2] = vmlal_laneq_s16(d[r][2], vget_low_s16(w1), x[r], L);                \
            d[r][3] = vmlal_high_laneq_s16(d[r][3], w1, x[r], L);                         \
        }                                                                                 \
    } while (0)

/* R (1..4) rows x one tile of one group, 16-bit inputs, into each row's `acc` (HELD_TILES *
 * TILE_Q floats apart, this tile's 16 first). */
static inline __attribute__((always_inline)) void
rows_tile16(const int16x8_t *wt, const int Q4, const bi_input *in, int k, int groups, int g,
            int r0, const int R, const float *s, const float *off, float *acc) {
    int32x4_t d[HELD_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) d[r][c] = vdupq_n_s32(0);
    for (int b = 0; b < GROUP / 8; b++) {  /* inputs 8b..8b+7 */
        int16x8_t x[HELD_ROWS];
        for (int r = 0; r < R; r++)
            x[r] = vld1q_s16(in->q + (int64_t)(r0 + r) * k + g * GROUP + 8 * b);
        const int16x8_t *w = wt + 16 * b;
        MAC_LANE16(0); MAC_LANE16(1); MAC_LANE16(2); MAC_LANE16(3);
        MAC_LANE16(4); MAC_LANE16(5); MAC_LANE16(6); MAC_LANE16(7);
    }
    scale_rows(d, Q4, in->scale, in->sum, groups, g, r0, R, s, off, acc);
}
#undef MAC_LANE16

/* y += the held kernels' sums `acc` (rows of HELD_TILES * TILE_Q) of tiles [tile, tile + T). */
static inline void finish_held(const bi_linear *l, int tile, int T, const float *acc, int rows,
                               float *y, int64_t ldy, int accumulate) {
    for (int t = 0; t < T; t++) {
        const float *bias = l->bias ? l->bias + (tile + t) * TILE_Q : NULL;
        for (int r = 0; r < rows; r++) {
            float32x4_t v[4];
            for (int c = 0; c < 4; c++)
                v[c] = vld1q_f32(acc + (r * HELD_TILES + t) * TILE_Q + 4 * c);
            finish16(y + r * ldy + (tile + t) * TILE_Q, v, bias, accumulate);
        }
    }
}

/* Tiles [tile, tile + T) for up to BLOCK_ROWS rows, group by group: the group's weights are
 * unpacked once and serve every row, HELD_ROWS rows and a tile at a time. */
static inline __attribute__((always_inline)) void
held_tiles16_kind(const bi_linear *l, const int Q4, int tile, const int T, const bi_input *in,
                  int rows, float *y, int64_t ldy, int accumulate) {
    const int groups = num_groups(l), k = l->k;
    int16x8_t wb[HELD_TILES * 2 * GROUP];
    float acc[BLOCK_ROWS * HELD_TILES * TILE_Q];
    memset(acc, 0, sizeof(float) * rows * HELD_TILES * TILE_Q);
    for (int g = 0; g < groups; g++) {
        unpack_group16(l, Q4, tile, T, g, wb);
        for (int t = 0; t < T; t++) {
            const int64_t at = ((int64_t)(tile + t) * groups + g) * TILE_Q;
            const float *s = l->scale + at, *off = Q4 ? l->offset + at : NULL;
            const int16x8_t *w = wb + 2 * GROUP * t;
            float *a = acc + t * TILE_Q;
#define ROWS16(R0, R) rows_tile16(w, Q4, in, k, groups, g, R0, R, s, off, a)
            FOR_HELD_ROWS(rows, ROWS16);
#undef ROWS16
        }
    }
    finish_held(l, tile, T, acc, rows, y, ldy, accumulate);
}

/* ---- 8-bit activations (opt-in, many rows), where the CPU has the dot-product extension --
 *
 * `sdot` by a lane (`vdotq_laneq_s32`) adds four products of signed bytes into each 32-bit
 * lane: four inputs of a row (one 32-bit lane of its register of 16 inputs) against four
 * weights of each of four outputs. A group's weights are held as four-input lanes, `wb[t][m]`
 * the tile's 16 outputs' weights for inputs 4m..4m+3 (four registers; q4's 0..15 and q8's
 * -127..127 both fit a signed byte, so the inputs stay signed and need no correction). The
 * inputs are rounded as on x86 (largest |x| / 127, to nearest): the same integers. Built
 * where the compiler targets ARMv8.2's dot products (`-march=native` on a CPU that has them:
 * Neoverse N1 and later, Apple M1 and later); an ARMv8.0 build has no 8-bit path. */
#if defined(__ARM_FEATURE_DOTPROD)
#define BI_ACT8 1

/* Groups of one row into int8, scales and float sums (`flip` is not needed: the inputs stay
 * signed). */
static void quantize_groups8(const float *x, int groups, int8_t *q, float *scale, float *sum,
                             int flip) {
    (void)flip;
    for (int g = 0; g < groups; g++) {
        float32x4_t v[8];
        const float top = load_group(x + g * GROUP, v, sum + g);
        const float32x4_t inv = vdupq_n_f32(top > TINY_GROUP ? 127.f / top : 0.f);
        for (int i = 0; i < 8; i += 4) {  /* round to nearest, ties to even; narrow saturating */
            int16x8_t h[2];
            for (int j = 0; j < 2; j++)
                h[j] = vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(v[i + 2 * j], inv))),
                                    vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(v[i + 2 * j + 1], inv))));
            vst1q_s8(q + g * GROUP + 4 * i, vcombine_s8(vqmovn_s16(h[0]), vqmovn_s16(h[1])));
        }
        scale[g] = top / 127.f;
    }
}

/* One group's weights of T tiles as four-input lanes (see above). Chunks 2m and 2m + 1 hold
 * the quad's two pairs, output j's in 16-bit word j: interleaving their words puts an
 * output's four bytes in one lane. */
static inline __attribute__((always_inline)) void
unpack_group8(const bi_linear *l, const int Q4, int tile, const int T, int g, int8x16_t *wb) {
    const uint8x16_t nibbles = vdupq_n_u8(0x0f);
    for (int t = 0; t < T; t++) {
        const uint8_t *wg = group_bytes(l, Q4, tile + t, g);
        int8x16_t *w = wb + 4 * (GROUP / 4) * t;
        for (int m = 0; m < (Q4 ? 4 : 8); m++) {
            uint16x8_t a[2], b[2];  /* outputs 0..7 and 8..15 of chunks 2m and 2m + 1 */
            for (int h = 0; h < 2; h++) {
                a[h] = vreinterpretq_u16_u8(vld1q_u8(wg + 64 * m + 16 * h));
                b[h] = vreinterpretq_u16_u8(vld1q_u8(wg + 64 * m + 32 + 16 * h));
            }
            const uint8x16_t v[4] = {  /* outputs 0..3, 4..7, 8..11, 12..15 */
                vreinterpretq_u8_u16(vzip1q_u16(a[0], b[0])),
                vreinterpretq_u8_u16(vzip2q_u16(a[0], b[0])),
                vreinterpretq_u8_u16(vzip1q_u16(a[1], b[1])),
                vreinterpretq_u8_u16(vzip2q_u16(a[1], b[1]))};
            for (int c = 0; c < 4; c++) {
                if (Q4) {  /* low nibbles: inputs 4m..; high ones: 16 + 4m.. */
                    w[4 * m + c] = vreinterpretq_s8_u8(vandq_u8(v[c], nibbles));
                    w[4 * (m + 4) + c] = vreinterpretq_s8_u8(vshrq_n_u8(v[c], 4));
                } else {
                    w[4 * m + c] = vreinterpretq_s8_u8(v[c]);
                }
            }
        }
    }
}

/* Inputs 4L..4L+3 of each row's 16 (lane L of x[r]) against the tile's weights for them. */
#define DOT_LANE(L)                                                                       \
    do {                                                                                  \
        const int8x16_t *wm = w + 4 * (4 * half + (L));                                   \
        for (int r = 0; r < R; r++)                                                       \
            for (int c = 0; c < 4; c++) d[r][c] = vdotq_laneq_s32(d[r][c], wm[c], x[r], L); \
    } while (0)

/* R (1..4) rows x one tile of one group of 8-bit inputs (see rows_tile16). */
static inline __attribute__((always_inline)) void
rows_tile8(const int8x16_t *w, const int Q4, const int8_t *xq, const float *xs,
           const float *xsum, int k, int groups, int g, int r0, const int R, const float *s,
           const float *off, float *acc) {
    int32x4_t d[HELD_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) d[r][c] = vdupq_n_s32(0);
    for (int half = 0; half < 2; half++) {  /* inputs 16 half .. 16 half + 15 */
        int8x16_t x[HELD_ROWS];
        for (int r = 0; r < R; r++)
            x[r] = vld1q_s8(xq + (int64_t)(r0 + r) * k + g * GROUP + 16 * half);
        DOT_LANE(0); DOT_LANE(1); DOT_LANE(2); DOT_LANE(3);
    }
    scale_rows(d, Q4, xs, xsum, groups, g, r0, R, s, off, acc);
}
#undef DOT_LANE

/* Tiles [tile, tile + T) for up to BLOCK_ROWS rows of 8-bit inputs (see held_tiles16_kind). */
static inline __attribute__((always_inline)) void
held_tiles8_kind(const bi_linear *l, const int Q4, int tile, const int T, const int8_t *xq,
                 const float *xs, const float *xsum, int rows, float *y, int64_t ldy,
                 int accumulate) {
    const int groups = num_groups(l), k = l->k;
    int8x16_t wb[HELD_TILES * GROUP];
    float acc[BLOCK_ROWS * HELD_TILES * TILE_Q];
    memset(acc, 0, sizeof(float) * rows * HELD_TILES * TILE_Q);
    for (int g = 0; g < groups; g++) {
        unpack_group8(l, Q4, tile, T, g, wb);
        for (int t = 0; t < T; t++) {
            const int64_t at = ((int64_t)(tile + t) * groups + g) * TILE_Q;
            const float *s = l->scale + at, *off = Q4 ? l->offset + at : NULL;
            const int8x16_t *w = wb + GROUP * t;
            float *a = acc + t * TILE_Q;
#define ROWS8(R0, R) rows_tile8(w, Q4, xq, xs, xsum, k, groups, g, R0, R, s, off, a)
            FOR_HELD_ROWS(rows, ROWS8);
#undef ROWS8
        }
    }
    finish_held(l, tile, T, acc, rows, y, ldy, accumulate);
}
#else
#define BI_ACT8 0
#endif

/* e^x as the x86 levels compute it (x clamped to [-87, 88], degree-6 polynomial of the
 * fraction, 2^r from r's exponent bits). */
static inline float32x4_t exp4_ps(float32x4_t x) {
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.f)), vdupq_n_f32(88.f));
    const float32x4_t t = vmulq_f32(x, vdupq_n_f32(1.44269504088896341f));
    const float32x4_t r = vrndnq_f32(t);
    const float32x4_t f = vmulq_f32(vsubq_f32(t, r), vdupq_n_f32(0.693147180559945309f));
    float32x4_t p = vdupq_n_f32(1.f / 720.f);
    p = vfmaq_f32(vdupq_n_f32(1.f / 120.f), p, f);
    p = vfmaq_f32(vdupq_n_f32(1.f / 24.f), p, f);
    p = vfmaq_f32(vdupq_n_f32(1.f / 6.f), p, f);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, f);
    p = vfmaq_f32(vdupq_n_f32(1.f), p, f);
    p = vfmaq_f32(vdupq_n_f32(1.f), p, f);
    const int32x4_t two_r = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(r), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(two_r));
}

/* Four float16 bit patterns as float32. */
static inline float32x4_t f16x4_to_f32(uint16x4_t h) {
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}

/* The vector parts of the driver's loops (see common.h). */
BI_INLINE int64_t kv_widen(const void *src, int64_t n, int type, float *dst) {
    int64_t i = 0;
    const uint16_t *h = src;
    const uint8_t *b = src;
    switch (type) {
    case BI_KV_F16:
        for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, f16x4_to_f32(vld1_u16(h + i)));
        return i;
    case BI_KV_BF16:
        for (; i + 4 <= n; i += 4)
            vst1q_f32(dst + i, vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(h + i), 16)));
        return i;
    case BI_KV_E5M2:  /* float16's top byte */
        for (; i + 8 <= n; i += 8) {
            const uint16x8_t e = vshll_n_u8(vld1_u8(b + i), 8);
            vst1q_f32(dst + i, f16x4_to_f32(vget_low_u16(e)));
            vst1q_f32(dst + i + 4, f16x4_to_f32(vget_high_u16(e)));
        }
        return i;
    case BI_KV_E4M3: {  /* its fields moved into a float16, times 2^8 */
        const float32x4_t two8 = vdupq_n_f32(256.f);
        for (; i + 8 <= n; i += 8) {
            const uint16x8_t x = vmovl_u8(vld1_u8(b + i));
            const uint16x8_t e = vorrq_u16(vshlq_n_u16(vandq_u16(x, vdupq_n_u16(0x80)), 8),
                                           vshlq_n_u16(vandq_u16(x, vdupq_n_u16(0x7F)), 7));
            vst1q_f32(dst + i, vmulq_f32(f16x4_to_f32(vget_low_u16(e)), two8));
            vst1q_f32(dst + i + 4, vmulq_f32(f16x4_to_f32(vget_high_u16(e)), two8));
        }
        return i;
    }
    default: return 0;
    }
}

BI_INLINE int silu_mul_span(float *out, const float *g, const float *u, int i, int last) {
    const float32x4_t one = vdupq_n_f32(1.f);
    for (; i + 4 <= last; i += 4) {
        const float32x4_t v = vld1q_f32(g + i);
        const float32x4_t e = exp4_ps(vnegq_f32(v));
        vst1q_f32(out + i, vmulq_f32(vdivq_f32(v, vaddq_f32(one, e)), vld1q_f32(u + i)));
    }
    return i;
}

BI_INLINE int exp_shifted_span(float *s, int n, float m, float *sum) {
    int i = 0;
    float32x4_t acc = vdupq_n_f32(0.f);
    const float32x4_t mv = vdupq_n_f32(m);
    for (; i + 4 <= n; i += 4) {
        const float32x4_t p = exp4_ps(vsubq_f32(vld1q_f32(s + i), mv));
        vst1q_f32(s + i, p);
        acc = vaddq_f32(acc, p);
    }
    *sum = vaddvq_f32(acc);
    return i;
}

BI_INLINE int dot_span(const float *a, const float *b, int d, float *sum) {
    if (d % 16) return 0;
    float32x4_t acc[4];  /* four chains */
    for (int c = 0; c < 4; c++) acc[c] = vmulq_f32(vld1q_f32(a + 4 * c), vld1q_f32(b + 4 * c));
    for (int i = 16; i < d; i += 16)
        for (int c = 0; c < 4; c++)
            acc[c] = vfmaq_f32(acc[c], vld1q_f32(a + i + 4 * c), vld1q_f32(b + i + 4 * c));
    *sum = vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));
    return d;
}

BI_INLINE int max_span(const float *s, int n, float *best) {
    int t = 0;
    float32x4_t top = vdupq_n_f32(*best);
    for (; t + 4 <= n; t += 4) top = vmaxq_f32(top, vld1q_f32(s + t));
    *best = vmaxvq_f32(top);
    return t;
}

/* ---- Decode attention over keys and values read in place (head sizes 64 and 128) ------- */

/* 4 cache elements from element `i` of `p` (of type KT: float32, float16, bfloat16, e5m2) as
 * float32, widened in registers as `kv_widen` widens them. */
static inline __attribute__((always_inline)) float32x4_t load_kv4(const void *p, int64_t i,
                                                                 const int KT) {
    if (KT == BI_KV_F32) return vld1q_f32((const float *)p + i);
    if (KT == BI_KV_F16) return f16x4_to_f32(vld1_u16((const uint16_t *)p + i));
    if (KT == BI_KV_BF16)
        return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)p + i), 16));
    uint32_t four;  /* e5m2: float16's top byte */
    memcpy(&four, (const uint8_t *)p + i, 4);
    return f16x4_to_f32(vshl_n_u16(vget_low_u16(vmovl_u8(vcreate_u8(four))), 8));
}

/* scores[h][t] = q[h] . keys[t] * scale for the t < n keys of one block, head size D: four
 * keys at a time (two chains each, the query's chunks read from L1), their four sums reduced
 * together by pairwise adds. */
static inline __attribute__((always_inline)) void
block_scores_fixed(const float *q, const void *keys, int n, int per_kv, const int D, const int KT,
                   float scale, float *scores, int bs) {
    for (int h = 0; h < per_kv; h++)
        for (int t0 = 0; t0 < n; t0 += 4) {
            const int m = n - t0 < 4 ? n - t0 : 4;
            float32x4_t a[4], b[4];
            int64_t key[4];  /* past the block's last key: that one again, not stored */
            for (int i = 0; i < 4; i++) {
                key[i] = (int64_t)(t0 + (i < m ? i : m - 1)) * D;
                a[i] = b[i] = vdupq_n_f32(0.f);
            }
            for (int c = 0; c < D; c += 8) {
                const float32x4_t q0 = vld1q_f32(q + h * D + c), q1 = vld1q_f32(q + h * D + c + 4);
                for (int i = 0; i < 4; i++) {
                    a[i] = vfmaq_f32(a[i], q0, load_kv4(keys, key[i] + c, KT));
                    b[i] = vfmaq_f32(b[i], q1, load_kv4(keys, key[i] + c + 4, KT));
                }
            }
            for (int i = 0; i < 4; i++) a[i] = vaddq_f32(a[i], b[i]);
            float sums[4];
            vst1q_f32(sums, vmulq_n_f32(vpaddq_f32(vpaddq_f32(a[0], a[1]),
                                                   vpaddq_f32(a[2], a[3])), scale));
            memcpy(scores + h * bs + t0, sums, sizeof(float) * m);
        }
}

/* out[h] += sum_t p[h][t] values[t] over the t < n values of one block: 32 outputs at a time
 * held in registers across the block's values, two chains (even and odd values). */
static inline __attribute__((always_inline)) void
block_values_fixed(const float *p, const void *values, int n, int per_kv, const int D,
                   const int KT, float *out, int bs) {
    for (int h = 0; h < per_kv; h++)
        for (int c0 = 0; c0 < D; c0 += 32) {
            float *o = out + h * D + c0;
            float32x4_t a[8], b[8];
            for (int i = 0; i < 8; i++) {
                a[i] = vld1q_f32(o + 4 * i);
                b[i] = vdupq_n_f32(0.f);
            }
            int t = 0;
            for (; t + 2 <= n; t += 2) {
                const float w0 = p[h * bs + t], w1 = p[h * bs + t + 1];
                const int64_t v0 = (int64_t)t * D + c0, v1 = v0 + D;
                for (int i = 0; i < 8; i++) {
                    a[i] = vfmaq_n_f32(a[i], load_kv4(values, v0 + 4 * i, KT), w0);
                    b[i] = vfmaq_n_f32(b[i], load_kv4(values, v1 + 4 * i, KT), w1);
                }
            }
            if (t < n) {
                const float w0 = p[h * bs + t];
                for (int i = 0; i < 8; i++)
                    a[i] = vfmaq_n_f32(a[i], load_kv4(values, (int64_t)t * D + c0 + 4 * i, KT), w0);
            }
            for (int i = 0; i < 8; i++) vst1q_f32(o + 4 * i, vaddq_f32(a[i], b[i]));
        }
}

/* ---- The packed attention (see cpu_kernels.c) and GELU ---------------------------------- */

/* One softmax row of the packed attention: exp(s - max) over its n scores (the last few
 * through a padded copy, the scores past them left as they are); *inv = 1 / sum. */
BI_INLINE int softmax_row_fast(float *s, int n, float *inv) {
    const int whole = n / 4 * 4;
    float32x4_t m = vdupq_n_f32(-INFINITY);
    for (int j = 0; j < whole; j += 4) m = vmaxq_f32(m, vld1q_f32(s + j));
    float best = vmaxvq_f32(m);
    for (int j = whole; j < n; j++) best = s[j] > best ? s[j] : best;
    const float32x4_t mv = vdupq_n_f32(best);
    float32x4_t acc = vdupq_n_f32(0.f);
    for (int j = 0; j < whole; j += 4) {
        const float32x4_t p = exp4_ps(vsubq_f32(vld1q_f32(s + j), mv));
        vst1q_f32(s + j, p);
        acc = vaddq_f32(acc, p);
    }
    float sum = vaddvq_f32(acc);
    if (whole < n) {
        float tail[4] = {0.f, 0.f, 0.f, 0.f};
        memcpy(tail, s + whole, sizeof(float) * (n - whole));
        vst1q_f32(tail, exp4_ps(vsubq_f32(vld1q_f32(tail), mv)));
        for (int j = whole; j < n; j++) {
            s[j] = tail[j - whole];
            sum += s[j];
        }
    }
    *inv = 1.f / sum;
    return 1;
}

/* scores[r][j] = q_r . kt[:, j] for r < R, j < n rounded up to 4 (kt: `[D][ldk]`, zero past
 * n): 16 keys a pass (for 4 rows: 16 accumulators), then 4 at a time with two chains. */
static inline __attribute__((always_inline)) void
sentence_scores(const float *const *qr, const int R, const float *kt, int64_t ldk, int n,
                const int D, float *scores, int64_t lds) {
    int j0 = 0;
    for (; j0 + 16 <= n; j0 += 16) {
        float32x4_t acc[QROWS][4];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = vdupq_n_f32(0.f);
        for (int c = 0; c < D; c++) {
            const float *row = kt + c * ldk + j0;
            float32x4_t kv[4];
            for (int i = 0; i < 4; i++) kv[i] = vld1q_f32(row + 4 * i);
            for (int r = 0; r < R; r++) {
                const float qc = qr[r][c];
                for (int i = 0; i < 4; i++) acc[r][i] = vfmaq_n_f32(acc[r][i], kv[i], qc);
            }
        }
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 4; i++) vst1q_f32(scores + r * lds + j0 + 4 * i, acc[r][i]);
    }
    for (; j0 < n; j0 += 4) {
        float32x4_t acc[QROWS], odd[QROWS];  /* even and odd c */
        for (int r = 0; r < R; r++) acc[r] = odd[r] = vdupq_n_f32(0.f);
        for (int c = 0; c < D; c += 2) {
            const float32x4_t k0 = vld1q_f32(kt + c * ldk + j0);
            const float32x4_t k1 = vld1q_f32(kt + (c + 1) * ldk + j0);
            for (int r = 0; r < R; r++) {
                acc[r] = vfmaq_n_f32(acc[r], k0, qr[r][c]);
                odd[r] = vfmaq_n_f32(odd[r], k1, qr[r][c + 1]);
            }
        }
        for (int r = 0; r < R; r++) vst1q_f32(scores + r * lds + j0, vaddq_f32(acc[r], odd[r]));
    }
}

/* out_r = inv[r] * sum_j p[r][j] v_j for r < R (v rows `ld` apart; D a multiple of 16): 16
 * outputs of every row at a time, in registers across the values. */
static inline __attribute__((always_inline)) void
sentence_values(const float *p, int64_t lds, const int R, const float *v, int64_t ld, int n,
                const int D, const float *inv, float *const *outr) {
    for (int c0 = 0; c0 < D; c0 += 16) {
        float32x4_t acc[QROWS][4];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 4; i++) acc[r][i] = vdupq_n_f32(0.f);
        for (int j = 0; j < n; j++) {
            const float *vj = v + j * ld + c0;
            float32x4_t vv[4];
            for (int i = 0; i < 4; i++) vv[i] = vld1q_f32(vj + 4 * i);
            for (int r = 0; r < R; r++) {
                const float w = p[r * lds + j];
                for (int i = 0; i < 4; i++) acc[r][i] = vfmaq_n_f32(acc[r][i], vv[i], w);
            }
        }
        for (int r = 0; r < R; r++)
            for (int i = 0; i < 4; i++)
                vst1q_f32(outr[r] + c0 + 4 * i, vmulq_n_f32(acc[r][i], inv[r]));
    }
}

BI_INLINE int transpose_keys_fast(const float *keys, int64_t ldk, int n, int d, float scale,
                                  float *kt, int64_t ldt) {
    if (d % 4) return 0;
    const int padded = (n + 15) / 16 * 16;
    for (int j0 = 0; j0 < padded; j0 += 4)  /* 4 keys x 4 values at a time, in registers */
        for (int c0 = 0; c0 < d; c0 += 4) {
            float32x4_t r[4];
            for (int i = 0; i < 4; i++)
                r[i] = j0 + i < n ? vmulq_n_f32(vld1q_f32(keys + (j0 + i) * ldk + c0), scale)
                                  : vdupq_n_f32(0.f);
            /* pairs of rows interleaved, then pairs of pairs: column i of the block */
            const float64x2_t t0 = vreinterpretq_f64_f32(vtrn1q_f32(r[0], r[1]));
            const float64x2_t t1 = vreinterpretq_f64_f32(vtrn2q_f32(r[0], r[1]));
            const float64x2_t t2 = vreinterpretq_f64_f32(vtrn1q_f32(r[2], r[3]));
            const float64x2_t t3 = vreinterpretq_f64_f32(vtrn2q_f32(r[2], r[3]));
            vst1q_f32(kt + c0 * ldt + j0, vreinterpretq_f32_f64(vtrn1q_f64(t0, t2)));
            vst1q_f32(kt + (c0 + 1) * ldt + j0, vreinterpretq_f32_f64(vtrn1q_f64(t1, t3)));
            vst1q_f32(kt + (c0 + 2) * ldt + j0, vreinterpretq_f32_f64(vtrn2q_f64(t0, t2)));
            vst1q_f32(kt + (c0 + 3) * ldt + j0, vreinterpretq_f32_f64(vtrn2q_f64(t1, t3)));
        }
    return 1;
}

/* erf(x) as the x86 levels compute it (Abramowitz and Stegun 7.1.26), t = 1 / (1 + 0.3275911
 * |x|) by division. */
static inline float32x4_t erf4_ps(float32x4_t x) {
    const float32x4_t ax = vabsq_f32(x);
    const float32x4_t t = vdivq_f32(vdupq_n_f32(1.f),
                                    vfmaq_n_f32(vdupq_n_f32(1.f), ax, 0.3275911f));
    float32x4_t p = vdupq_n_f32(1.061405429f);
    p = vfmaq_f32(vdupq_n_f32(-1.453152027f), p, t);
    p = vfmaq_f32(vdupq_n_f32(1.421413741f), p, t);
    p = vfmaq_f32(vdupq_n_f32(-0.284496736f), p, t);
    p = vfmaq_f32(vdupq_n_f32(0.254829592f), p, t);
    p = vmulq_f32(p, t);
    const float32x4_t y = vfmsq_f32(vdupq_n_f32(1.f), p, exp4_ps(vnegq_f32(vmulq_f32(ax, ax))));
    /* the sign of x */
    return vbslq_f32(vdupq_n_u32(0x80000000u), x, y);
}

BI_INLINE int64_t gelu_span(float *x, int64_t i, int64_t end) {
    for (; i + 4 <= end; i += 4) {
        const float32x4_t v = vld1q_f32(x + i);
        const float32x4_t e = erf4_ps(vmulq_n_f32(v, 0.70710678118654752f));
        vst1q_f32(x + i, vmulq_f32(vmulq_n_f32(v, 0.5f), vaddq_f32(e, vdupq_n_f32(1.f))));
    }
    return i;
}
