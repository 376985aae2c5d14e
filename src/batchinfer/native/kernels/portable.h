/* Portable C: the kernels' arithmetic as plain loops, vectorized by the compiler for the
 * machine it targets (SSE on x86-64-v2, NEON where an Arm build has no hand-written level).
 * The reference every other level is tested against. */
#include "common.h"

#define BI_ISA_NAME "portable"
#define BI_HELD16 0
#define BI_ACT8 0
#define BI_FIXED_KV 0
#define BI_PACKED_FAST 0
#define BI_SOFTMAX_FAST 0
#define BI_GELU_FAST 0

/* Groups [0, groups) of one row into 16-bit integers, scales and sums. */
static void quantize_groups(const float *x, int groups, int16_t *q, float *scale, float *sum) {
    for (int g = 0; g < groups; g++) {
        const float *v = x + g * GROUP;
        float top = 0.f, total = 0.f;
        for (int i = 0; i < GROUP; i++) {
            const float a = fabsf(v[i]);
            top = a > top ? a : top;
            total += v[i];
        }
        float inv;
        scale[g] = input_scale16(top, &inv);
        for (int i = 0; i < GROUP; i++) {
            const long r = lrintf(v[i] * inv);  /* saturating, as the vector levels narrow */
            q[g * GROUP + i] = (int16_t)(r > 32767 ? 32767 : r < -32768 ? -32768 : r);
        }
        sum[g] = total;
    }
}

/* A float32 tile (4 outputs) for `rows` (1..4) rows. */
static inline void f32_tile(const bi_linear *l, int tile, const float *x, int64_t ldx, int rows,
                            float *y, int64_t ldy, int accumulate) {
    const int k = l->k;
    const float *bias = l->bias ? l->bias + tile * TILE_F32 : NULL;
    for (int j = 0; j < TILE_F32; j++) {
        const float *w = (const float *)l->weight + ((int64_t)tile * TILE_F32 + j) * k;
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * ldx;
            float total = 0.f;
#pragma omp simd reduction(+ : total)
            for (int i = 0; i < k; i++) total += w[i] * xr[i];
            finish(y + r * ldy + tile * TILE_F32, j, total, bias, accumulate);
        }
    }
}

/* A quantized tile (16 outputs) for `rows` (1..4) rows of 16-bit inputs. */
static inline void quant_tile(const bi_linear *l, int tile, const bi_input *in, int rows,
                              float *y, int64_t ldy, int accumulate) {
    const int k = l->k, groups = num_groups(l);
    const float *bias = l->bias ? l->bias + tile * TILE_Q : NULL;
    for (int j = 0; j < TILE_Q; j++)
        for (int r = 0; r < rows; r++) {
            const int16_t *xq = in->q + (int64_t)r * k;
            float total = 0.f;
            for (int g = 0; g < groups; g++) {
                const int64_t at = (int64_t)tile * groups + g;
                int32_t dot = 0;
                if (l->kind == BI_Q4) {
                    const uint8_t *w = (const uint8_t *)l->weight + at * 256;
                    for (int i = 0; i < 8; i++)
                        for (int e = 0; e < 2; e++) {
                            const uint8_t b = w[32 * i + 2 * j + e];
                            dot += (b & 15) * xq[g * GROUP + 2 * i + e]
                                   + (b >> 4) * xq[g * GROUP + 2 * i + 16 + e];
                        }
                } else {
                    const int8_t *w = (const int8_t *)l->weight + at * 512;
                    for (int p = 0; p < 16; p++)
                        for (int e = 0; e < 2; e++)
                            dot += w[32 * p + 2 * j + e] * xq[g * GROUP + 2 * p + e];
                }
                const float xs = in->scale[(int64_t)r * groups + g];
                total += (float)dot * (l->scale[at * TILE_Q + j] * xs);
                if (l->kind == BI_Q4)
                    total += l->offset[at * TILE_Q + j] * in->sum[(int64_t)r * groups + g];
            }
            finish(y + r * ldy + tile * TILE_Q, j, total, bias, accumulate);
        }
}

/* No vector parts: the driver's loops do all of the work (see common.h). */
BI_INLINE int64_t kv_widen(const void *src, int64_t n, int type, float *dst) {
    (void)src, (void)n, (void)type, (void)dst;
    return 0;
}

BI_INLINE int silu_mul_span(float *out, const float *g, const float *u, int i, int last) {
    (void)out, (void)g, (void)u, (void)last;
    return i;
}

BI_INLINE int exp_shifted_span(float *s, int n, float m, float *sum) {
    (void)s, (void)n, (void)m;
    *sum = 0.f;
    return 0;
}

BI_INLINE int dot_span(const float *a, const float *b, int d, float *sum) {
    (void)a, (void)b, (void)d;
    *sum = 0.f;
    return 0;
}

BI_INLINE int max_span(const float *s, int n, float *best) {
    (void)s, (void)n, (void)best;
    return 0;
}
