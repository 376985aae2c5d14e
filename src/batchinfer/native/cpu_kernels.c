/* CPU kernels: weight-only quantized linears that read 4-bit or 8-bit weights straight from
 * their packed form (for one row or thousands), a whole decode step of a Llama-family model in
 * one call, and encoders' self-attention over packed sentences.
 *
 * Built on the machine that runs it, once per instruction-set level (see native/__init__.py),
 * loaded with ctypes; `bi_isa()` names the level of a build. This file holds what every level
 * shares (the entry points, threading, the decode step, the scalar loops); the level's own
 * kernels are one file each under kernels/ (avx512.h, avx2.h, neon.h, portable.h), chosen
 * below by what the compiler targets, behind the contract kernels/common.h states. Each level
 * is its own translation unit so that the tile kernels inline into the loops that call them.
 * Threads: OpenMP, the same runtime torch uses, the count passed by the caller.
 */
#include "kernels/common.h"
#if defined(BI_FORCE_PORTABLE)  /* the portable level of an Arm build */
#include "kernels/portable.h"
#elif defined(__AVX512F__) && defined(__AVX512BW__)
#include "kernels/avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "kernels/avx2.h"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include "kernels/neon.h"
#else
#include "kernels/portable.h"
#endif

int bi_avx512(void) { return strcmp(BI_ISA_NAME, "avx512") == 0; }

/* The instruction-set level this build's kernels use (native/__init__.py's ISA_LEVELS). */
const char *bi_isa(void) { return BI_ISA_NAME; }

/* ---- linears -------------------------------------------------------------------------- */

static void prepare_rows(const bi_linear *l, bi_input *in, int rows) {
    if (l->kind == BI_F32) return;
    const int groups = num_groups(l);
    for (int r = 0; r < rows; r++) {
#if BI_ACT8
        if (in->q8)
            quantize_groups8(in->x + r * in->ldx, groups, in->q8 + (int64_t)r * l->k,
                             in->scale + (int64_t)r * groups, in->sum + (int64_t)r * groups,
                             l->kind == BI_Q8);
        else
#endif
            quantize_groups(in->x + r * in->ldx, groups, in->q + (int64_t)r * l->k,
                            in->scale + (int64_t)r * groups, in->sum + (int64_t)r * groups);
    }
}

static void linear_tile(const bi_linear *l, int tile, const bi_input *in, int r0, int rows,
                        float *y, int64_t ldy, int accumulate) {
    if (l->kind == BI_F32) {
#define F32_ROWS(R) f32_tile(l, tile, in->x + r0 * in->ldx, in->ldx, R, y, ldy, accumulate)
        DISPATCH_ROWS(F32_ROWS)
    } else {
        const int groups = num_groups(l);
        const bi_input part = {NULL, 0, in->q + (int64_t)r0 * l->k,
                               in->scale + (int64_t)r0 * groups, in->sum + (int64_t)r0 * groups,
                               NULL};
#define Q_ROWS(R) quant_tile(l, tile, &part, R, y, ldy, accumulate)
        DISPATCH_ROWS(Q_ROWS)
    }
}

/* CALL(q4, T) with the linear's kind and its T (1..HELD_TILES) tiles as constants: the held
 * kernels' bodies for each. */
#define DISPATCH_HELD(CALL)                                                                \
    do {                                                                                   \
        const int q4 = l->kind == BI_Q4;                                                   \
        if (T == 4) { if (q4) CALL(1, 4); else CALL(0, 4); }                               \
        else if (T == 3) { if (q4) CALL(1, 3); else CALL(0, 3); }                          \
        else if (T == 2) { if (q4) CALL(1, 2); else CALL(0, 2); }                          \
        else { if (q4) CALL(1, 1); else CALL(0, 1); }                                      \
    } while (0)

#if BI_HELD16
static void held_tiles16(const bi_linear *l, int tile, int T, const bi_input *in, int rows,
                         float *y, int64_t ldy, int accumulate) {
#define HELD16(Q, N) held_tiles16_kind(l, Q, tile, N, in, rows, y, ldy, accumulate)
    DISPATCH_HELD(HELD16);
#undef HELD16
}
#endif

#if BI_ACT8
static void held_tiles8(const bi_linear *l, int tile, int T, const int8_t *xq, const float *xs,
                        const float *xsum, int rows, float *y, int64_t ldy, int accumulate) {
#define HELD8(Q, N) held_tiles8_kind(l, Q, tile, N, xq, xs, xsum, rows, y, ldy, accumulate)
    DISPATCH_HELD(HELD8);
#undef HELD8
}
#endif

/* Tiles [first, last) for every row: quantized weights for at least MIN_HELD_ROWS rows
 * unpacked once per group (`held_tiles16`, or `held_tiles8` for 8-bit inputs), else per
 * ROW_TILE rows. */
static void linear_tiles(const bi_linear *l, int first, int last, const bi_input *in,
                         int rows, float *y, int64_t ldy, int accumulate) {
#if BI_ACT8
    if (in->q8) {  /* set only for quantized weights and MIN_HELD_ROWS rows or more */
        const int groups = num_groups(l);
        for (int t = first; t < last; t += HELD_TILES)
            for (int r0 = 0; r0 < rows; r0 += BLOCK_ROWS)
                held_tiles8(l, t, last - t < HELD_TILES ? last - t : HELD_TILES,
                            in->q8 + (int64_t)r0 * l->k, in->scale + (int64_t)r0 * groups,
                            in->sum + (int64_t)r0 * groups,
                            rows - r0 < BLOCK_ROWS ? rows - r0 : BLOCK_ROWS, y + r0 * ldy, ldy,
                            accumulate);
        return;
    }
#endif
#if BI_HELD16
    if (l->kind != BI_F32 && rows >= MIN_HELD_ROWS) {
        const int groups = num_groups(l);
        for (int t = first; t < last; t += HELD_TILES) {
            const int T = last - t < HELD_TILES ? last - t : HELD_TILES;
            for (int r0 = 0; r0 < rows; r0 += BLOCK_ROWS) {
                const bi_input part = {NULL, 0, in->q + (int64_t)r0 * l->k,
                                       in->scale + (int64_t)r0 * groups,
                                       in->sum + (int64_t)r0 * groups, NULL};
                const int rr = rows - r0 < BLOCK_ROWS ? rows - r0 : BLOCK_ROWS;
                held_tiles16(l, t, T, &part, rr, y + r0 * ldy, ldy, accumulate);
            }
        }
        return;
    }
#endif
    for (int t = first; t < last; t++)
        for (int r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int rr = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
            linear_tile(l, t, in, r0, rr, y + r0 * ldy, ldy, accumulate);
        }
}

/* Bytes of weights (with their scales and offsets) one tile of `l` holds. */
static int64_t tile_bytes(const bi_linear *l) {
    const int64_t k = l->k;
    switch (l->kind) {
    case BI_F32: return TILE_F32 * k * (int64_t)sizeof(float);
    case BI_Q4: return TILE_Q * (k / 2 + 2 * (k / GROUP) * (int64_t)sizeof(float));
    default: return TILE_Q * (k + (k / GROUP) * (int64_t)sizeof(float));
    }
}

/* Tiles claimed at a time: about 64 KiB of weights, a stretch the prefetcher follows. */
#define CLAIM_BYTES 65536

/* This thread's work of a linear, inside a parallel region (no barrier). Each thread owns a
 * contiguous range of the tiles and claims chunks of it front to back, then claims chunks of
 * the others' ranges once its own is done, so that a thread the memory serves more slowly
 * does not hold the others at the next barrier (with a static split, one-sequence decode
 * steps spent a sizeable share waiting there). `next[nt]`: zeroed claim counters, one per
 * range, for this linear alone. */
static void linear_share(const bi_linear *l, const bi_input *in, int rows, float *y,
                         int64_t ldy, int accumulate, int32_t *next) {
    const int tiles = l->n / tile_of(l), nt = omp_get_num_threads(), id = omp_get_thread_num();
    int chunk = (int)(CLAIM_BYTES / tile_bytes(l));
    chunk = chunk < 1 ? 1 : chunk;
    for (int o = 0; o < nt; o++) {
        const int range = (id + o) % nt;
        const int first = (int)((int64_t)tiles * range / nt);
        const int last = (int)((int64_t)tiles * (range + 1) / nt);
        for (;;) {
            const int t = first + chunk * __atomic_fetch_add(next + range, 1, __ATOMIC_RELAXED);
            if (t >= last) break;
            linear_tiles(l, t, t + chunk < last ? t + chunk : last, in, rows, y, ldy,
                         accumulate);
        }
    }
}

/* Bytes of input scratch a linear with `k` inputs needs for `rows` rows. */
static int64_t input_bytes(int64_t k, int rows) {
    return rows * (k * (int64_t)sizeof(int16_t) + 2 * (k / GROUP) * (int64_t)sizeof(float));
}

static bi_input input_at(const float *x, int64_t ldx, int64_t k, int rows, void *scratch) {
    bi_input in = {x, ldx, (int16_t *)scratch, NULL, NULL, NULL};
    in.scale = (float *)(in.q + rows * k);
    in.sum = in.scale + rows * (k / GROUP);
    return in;
}

/* y[rows][n] = x[rows][k] W^T (+ bias) (`accumulate`: y += that), on `threads` threads, the
 * inputs rounded to 8 bits where `eight` (quantized weights, MIN_HELD_ROWS rows or more).
 * Returns 0, or -1 when the input's scratch cannot be had. */
static int linear_forward(const bi_linear *l, int rows, const float *x, float *y,
                          int accumulate, int threads, int eight) {
    void *scratch = malloc(input_bytes(l->k, rows) + 64);
    if (!scratch) return -1;
    bi_input in = input_at(x, l->k, l->k, rows, scratch);
    if (eight) in.q8 = (int8_t *)in.q;
    if (rows >= BLOCK_ROWS * threads) {
        /* Many rows: each thread takes blocks of rows and runs every tile over a block (the
         * block's inputs stay in its core's cache while the weights stream past), rather than
         * every thread re-reading all the rows for its share of the tiles. */
        const int blocks = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int b = 0; b < blocks; b++) {
            const int r0 = b * BLOCK_ROWS;
            const int rr = rows - r0 < BLOCK_ROWS ? rows - r0 : BLOCK_ROWS;
            bi_input part = in;
            part.x = in.x + (int64_t)r0 * in.ldx;
            if (l->kind != BI_F32) {
                part.q = in.q + (int64_t)r0 * l->k;
                part.scale = in.scale + (int64_t)r0 * num_groups(l);
                part.sum = in.sum + (int64_t)r0 * num_groups(l);
                if (eight) part.q8 = in.q8 + (int64_t)r0 * l->k;
                prepare_rows(l, &part, rr);
            }
            linear_tiles(l, 0, l->n / tile_of(l), &part, rr, y + (int64_t)r0 * l->n, l->n,
                         accumulate);
        }
    } else {
        prepare_rows(l, &in, rows);
        int32_t next[threads];
        memset(next, 0, sizeof(next));
#pragma omp parallel num_threads(threads)
        linear_share(l, &in, rows, y, l->n, accumulate, next);
    }
    free(scratch);
    return 0;
}

int bi_linear_forward(const bi_linear *l, int rows, const float *x, float *y, int accumulate,
                      int threads) {
    return linear_forward(l, rows, x, y, accumulate, threads, 0);
}

int bi_act8(void) { return BI_ACT8; }

/* bi_linear_forward with the inputs rounded to 8 bits where that path exists (`bi_act8`: AVX2,
 * AVX-512 VNNI, NEON with dot products; quantized weights, at least MIN_HELD_ROWS rows);
 * elsewhere bi_linear_forward. */
int bi_linear_forward8(const bi_linear *l, int rows, const float *x, float *y, int accumulate,
                       int threads) {
    return linear_forward(l, rows, x, y, accumulate, threads,
                          BI_ACT8 && l->kind != BI_F32 && rows >= MIN_HELD_ROWS);
}

/* ---- the decode step ------------------------------------------------------------------ */

static void rms_norm(const float *x, const float *w, int hidden, float eps, float *out) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < hidden; i++) ss += x[i] * x[i];
    const float inv = 1.f / sqrtf(ss / hidden + eps);
#pragma omp simd
    for (int i = 0; i < hidden; i++) out[i] = x[i] * inv * w[i];
}

/* Rotate each (v[i], v[i + d/2]) pair by its position's angle (the "rotate_half" form). */
static void rope(float *v, const float *cos_row, const float *sin_row, int half) {
#pragma omp simd
    for (int i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos_row[i] - b * sin_row[i];
        v[i + half] = b * cos_row[i] + a * sin_row[i];
    }
}

/* ---- KV cache element types ------------------------------------------------------------
 *
 * Stores round to nearest, ties to even, as torch's conversions do (the torch path and this
 * one write the same bytes); 8-bit values are clamped to the type's largest first. Reads widen
 * exactly: float16 and e5m2 (float16's top byte) through the half-precision converter, e4m3
 * by moving its fields into a float16 and scaling by 2^8, bfloat16 by a shift. */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static int kv_element_bytes(int type) {
    return type == BI_KV_F32 ? 4 : type == BI_KV_F16 || type == BI_KV_BF16 ? 2 : 1;
}

static uint16_t f32_to_f16(float f) {
    uint32_t x = f32_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7FFFFFFFu;
    if (x >= 0x7F800000u) return sign | 0x7C00 | (x > 0x7F800000u ? 0x200 : 0);
    if (x >= 0x477FF000u) return sign | 0x7C00;  /* rounds past 65504: infinity */
    if (x < 0x38800000u)  /* below 2^-14: a subnormal half, in units of 2^-24 */
        return sign | (uint16_t)nearbyintf(bits_f32(x) * 16777216.f);
    x += 0xFFFu + ((x >> 13) & 1);
    return sign | (uint16_t)((x - 0x38000000u) >> 13);
}

static float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0) return bits_f32(sign | f32_bits((float)m * 5.9604644775390625e-8f));
    if (e == 31) return bits_f32(sign | 0x7F800000u | (m << 13));
    return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

/* An 8-bit float with `mbits` mantissa bits and exponent bias `bias`, from |f| <= its largest. */
static uint8_t f32_to_f8(float f, int mbits, int bias) {
    uint32_t x = f32_bits(f);
    const uint8_t sign = (uint8_t)((x >> 24) & 0x80);
    x &= 0x7FFFFFFFu;
    if (x < (uint32_t)(128 - bias) << 23)  /* below the smallest normal: units of 2^(1-bias-m) */
        return sign | (uint8_t)nearbyintf(bits_f32(x) * ldexpf(1.f, bias - 1 + mbits));
    const int drop = 23 - mbits;
    x += (1u << (drop - 1)) - 1 + ((x >> drop) & 1);
    return sign | (uint8_t)((((x >> 23) - 127 + bias) << mbits) | ((x >> drop) & ((1u << mbits) - 1)));
}

static inline uint16_t e4m3_as_f16(uint8_t b) {  /* its value / 2^8, as float16 bits */
    return (uint16_t)(((b & 0x80) << 8) | ((b & 0x7F) << 7));
}

/* dst[i] = src[i] / scale stored as `type` (scale 1 for the 16- and 32-bit types). */
static void kv_store(const float *src, int n, int type, float scale, void *dst) {
    switch (type) {
    case BI_KV_F32: memcpy(dst, src, sizeof(float) * n); return;
    case BI_KV_F16:
        for (int i = 0; i < n; i++) ((uint16_t *)dst)[i] = f32_to_f16(src[i]);
        return;
    case BI_KV_BF16:
        for (int i = 0; i < n; i++) {
            const uint32_t x = f32_bits(src[i]);
            ((uint16_t *)dst)[i] = isnan(src[i]) ? (uint16_t)((x >> 16) | 0x40)
                                                 : (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1)) >> 16);
        }
        return;
    default: {
        const int e4 = type == BI_KV_E4M3;
        const float top = e4 ? 448.f : 57344.f;
        for (int i = 0; i < n; i++) {
            float v = src[i] / scale;
            v = v > top ? top : v < -top ? -top : v;
            ((uint8_t *)dst)[i] = f32_to_f8(v, e4 ? 3 : 2, e4 ? 7 : 15);
        }
    }
    }
}

static void kv_load(const void *src, int64_t n, int type, float *dst) {
    if (type == BI_KV_F32) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    const uint16_t *h = src;
    const uint8_t *b = src;
    int64_t i = kv_widen(src, n, type, dst);
    switch (type) {
    case BI_KV_F16: for (; i < n; i++) dst[i] = f16_to_f32(h[i]); return;
    case BI_KV_BF16: for (; i < n; i++) dst[i] = bits_f32((uint32_t)h[i] << 16); return;
    case BI_KV_E5M2: for (; i < n; i++) dst[i] = f16_to_f32((uint16_t)(b[i] << 8)); return;
    default: for (; i < n; i++) dst[i] = f16_to_f32(e4m3_as_f16(b[i])) * 256.f;
    }
}

/* Test hooks: `n` floats stored as cache elements of `type` (divided by `scale`), and read back. */
void bi_kv_store(const float *src, int64_t n, int type, float scale, void *dst) {
    const int64_t step = 1 << 20;
    for (int64_t i = 0; i < n; i += step)
        kv_store(src + i, (int)(n - i < step ? n - i : step), type, scale,
                 (char *)dst + i * kv_element_bytes(type));
}

void bi_kv_load(const void *src, int64_t n, int type, float *dst) { kv_load(src, n, type, dst); }

/* out[i] = silu(g[i]) * u[i] for i in [first, last) (`out` may be `g`). */
static void silu_mul(float *out, const float *g, const float *u, int first, int last) {
    for (int i = silu_mul_span(out, g, u, first, last); i < last; i++)
        out[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* ---- A layer's element-wise steps over many rows (the torch model's steps) ------------
 *
 * The torch model runs its products through the kernels above; these take the steps between
 * them that torch would run as several passes over the rows each (an RMSNorm is six ops, a
 * rotation seven), in one pass, a row per task. Few rows run on the calling thread alone. */
#define ELEMENTWISE_PARALLEL_ROWS 8

/* out[r] = x[r] / rms(x[r]) * w, `rows` rows of `hidden` (x's `ldx` floats apart). */
void bi_rms_norm_rows(const float *x, int64_t ldx, const float *w, int rows, int hidden,
                      float eps, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (rows >= ELEMENTWISE_PARALLEL_ROWS)
    for (int r = 0; r < rows; r++)
        rms_norm(x + r * ldx, w, hidden, eps, out + (int64_t)r * hidden);
}

/* out[r] = silu(gate) * up of row r of `gate_up` ([rows][2 * inter]: gate, then up). */
void bi_silu_mul_rows(const float *gate_up, int rows, int inter, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (rows >= ELEMENTWISE_PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (int64_t)r * 2 * inter;
        silu_mul(out + (int64_t)r * inter, g, g + inter, 0, inter);
    }
}

/* out[r] = LayerNorm(a[r] + b[r]) * gamma + beta over `hidden` values (mean, then the mean
 * square of the deviations: torch's two moments), rows `lda`, `ldb`, `ldo` floats apart; `out`
 * may be `a` or `b`. An encoder layer's residual add and norm in one pass. */
void bi_add_layer_norm_rows(const float *a, int64_t lda, const float *b, int64_t ldb,
                            const float *gamma, const float *beta, int rows, int hidden,
                            float eps, float *out, int64_t ldo, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (rows >= ELEMENTWISE_PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        const float *ar = a + r * lda, *br = b + r * ldb;
        float *o = out + r * ldo, sum = 0.f, squares = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < hidden; i++) {
            o[i] = ar[i] + br[i];
            sum += o[i];
        }
        const float mean = sum / hidden;
#pragma omp simd reduction(+ : squares)
        for (int i = 0; i < hidden; i++) squares += (o[i] - mean) * (o[i] - mean);
        const float inv = 1.f / sqrtf(squares / hidden + eps);
#pragma omp simd
        for (int i = 0; i < hidden; i++) o[i] = (o[i] - mean) * inv * gamma[i] + beta[i];
    }
}

/* x[i] = x[i] * (1 + erf(x[i] / sqrt(2))) / 2 for i < n, in place (GELU, erf form). */
void bi_gelu(float *x, int64_t n, int threads) {
    const int64_t chunk = 4096, chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static) if (chunks >= 4)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t i = c * chunk;
        const int64_t end = i + chunk < n ? i + chunk : n;
#if BI_GELU_FAST
        i = gelu_span(x, i, end);
#endif
        for (; i < end; i++) x[i] = 0.5f * x[i] * (1.f + erff(x[i] * 0.70710678118654752f));
    }
}

/* Rotates, in place, the first `heads` heads of `head_dim` of each row of x (rows `ldx` floats
 * apart) by its position's angles (`cos`, `sin`: `[positions][head_dim / 2]`). */
void bi_rope_rows(float *x, int64_t ldx, int rows, int heads, int head_dim,
                  const int64_t *positions, const float *cos, const float *sin, int threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (rows >= ELEMENTWISE_PARALLEL_ROWS)
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++)
            rope(x + r * ldx + h * head_dim, cos + positions[r] * half,
                 sin + positions[r] * half, half);
}

/* p[i] = exp(s[i] - m) for i < n; returns their sum. */
static float exp_shifted(float *s, int n, float m) {
    float sum = 0.f;
    for (int i = exp_shifted_span(s, n, m, &sum); i < n; i++) {
        s[i] = expf(s[i] - m);
        sum += s[i];
    }
    return sum;
}

static inline float dot(const float *a, const float *b, int d) {
    float s = 0.f;
    const int first = dot_span(a, b, d, &s);
#pragma omp simd reduction(+ : s)
    for (int i = first; i < d; i++) s += a[i] * b[i];
    return s;
}

/* scores[h][t] = q[h] . keys[t] * scale for the t < n keys of one block (rows of d). */
static void block_scores_any(const float *q, const float *keys, int n, int per_kv, int d,
                             float scale, float *scores, int bs) {
    for (int t = 0; t < n; t++)
        for (int h = 0; h < per_kv; h++)
            scores[h * bs + t] = dot(q + h * d, keys + (int64_t)t * d, d) * scale;
}

/* out[h] += sum_t p[h][t] values[t] over the t < n values of one block. */
static void block_values_any(const float *p, const float *values, int n, int per_kv, int d,
                             float *out, int bs) {
    for (int h = 0; h < per_kv; h++)
        for (int t = 0; t < n; t++) {
            const float w = p[h * bs + t];
            const float *value = values + (int64_t)t * d;
            float *oh = out + h * d;
#pragma omp simd
            for (int i = 0; i < d; i++) oh[i] += w * value[i];
        }
}

#if BI_FIXED_KV
/* Keys / values of one block, read in place, for the head sizes and cache types with a
 * fixed-size kernel; 0 where there is none (the caller widens the block, `kv_load`). Each
 * query head of the KV head reads the block again, widening it again: one instruction per 16
 * values for float16 (a 32-sequence decode step at ~270 tokens of context: 34.2 -> 32.2 ms
 * against widening the block into L1 first, with the prefetch below), but eight for e4m3
 * (39.7 ms read in place, 32.0 widened), which is widened once. */
#define FIXED_KV(CALL, D)                                                                  \
    switch (type) {                                                                        \
    case BI_KV_F32: CALL(D, BI_KV_F32); return 1;                                          \
    case BI_KV_F16: CALL(D, BI_KV_F16); return 1;                                          \
    case BI_KV_BF16: CALL(D, BI_KV_BF16); return 1;                                        \
    case BI_KV_E5M2: CALL(D, BI_KV_E5M2); return 1;                                        \
    default: return 0;                                                                     \
    }

static int block_scores_in_place(const float *q, const void *keys, int n, int per_kv, int d,
                                 int type, float scale, float *scores, int bs) {
#define SCORES(D, T) block_scores_fixed(q, keys, n, per_kv, D, T, scale, scores, bs)
    if (d == 64) FIXED_KV(SCORES, 64)
    if (d == 128) FIXED_KV(SCORES, 128)
#undef SCORES
    return 0;
}

static int block_values_in_place(const float *p, const void *values, int n, int per_kv, int d,
                                 int type, float *out, int bs) {
#define VALUES(D, T) block_values_fixed(p, values, n, per_kv, D, T, out, bs)
    if (d == 64) FIXED_KV(VALUES, 64)
    if (d == 128) FIXED_KV(VALUES, 128)
#undef VALUES
    return 0;
}
#undef FIXED_KV
#endif

static void block_scores(const float *q, const float *keys, int n, int per_kv, int d,
                         float scale, float *scores, int bs) {
#if BI_FIXED_KV
    if (block_scores_in_place(q, keys, n, per_kv, d, BI_KV_F32, scale, scores, bs)) return;
#endif
    block_scores_any(q, keys, n, per_kv, d, scale, scores, bs);
}

static void block_values(const float *p, const float *values, int n, int per_kv, int d,
                         float *out, int bs) {
#if BI_FIXED_KV
    if (block_values_in_place(p, values, n, per_kv, d, BI_KV_F32, out, bs)) return;
#endif
    block_values_any(p, values, n, per_kv, d, out, bs);
}

/* Pulls a block's bytes towards L1 while the block before it is attended (the blocks of a
 * sequence lie anywhere in the cache: the hardware's prefetchers cannot guess the next). */
#define PREFETCH_BLOCKS 2  /* how far ahead (1 and 2 measured alike) */
static inline void prefetch_bytes(const char *p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 3);
}

/* One block of `n` tokens (its keys at `k_at`, values at `v_at`) for the `per_kv` query heads
 * `q` that share one KV head: the online softmax's step, folding the block into each head's
 * unnormalized output `out[h][d]`, largest score `mx[h]` and sum of exp(score - mx)
 * `total[h]`. `scores`: per_kv * block_size floats; `widened`: 2 * block_size * head_dim
 * floats, where a block of a narrower cache is widened to float32 (in L1) before the float32
 * kernels read it. */
static void attend_block(const bi_model *m, const char *k_at, const char *v_at, int n,
                         const float *q, float scale, float *out, float *mx, float *total,
                         float *scores, float *widened) {
    const int d = m->head_dim, bs = m->block_size, type = m->kv_type;
    const int per_kv = m->num_heads / m->num_kv_heads;
    const float *keys = (const float *)k_at, *values = (const float *)v_at;
    int in_place = 0;
#if BI_FIXED_KV
    in_place = block_scores_in_place(q, k_at, n, per_kv, d, type, scale, scores, bs);
#endif
    if (!in_place && type != BI_KV_F32) {
        kv_load(k_at, (int64_t)n * d, type, widened);
        kv_load(v_at, (int64_t)n * d, type, widened + (int64_t)bs * d);
        keys = widened;
        values = widened + (int64_t)bs * d;
    }
    if (!in_place) block_scores(q, keys, n, per_kv, d, scale, scores, bs);
    for (int h = 0; h < per_kv; h++) {
        float *sh = scores + h * bs, *oh = out + h * d;
        float best = mx[h];
        int t = max_span(sh, n, &best);
        for (; t < n; t++) best = sh[t] > best ? sh[t] : best;
        if (best > mx[h]) {  /* a new maximum: rescale what was summed so far */
            const float factor = mx[h] == -INFINITY ? 0.f : expf(mx[h] - best);
            total[h] *= factor;
#pragma omp simd
            for (int i = 0; i < d; i++) oh[i] *= factor;
            mx[h] = best;
        }
        total[h] += exp_shifted(sh, n, mx[h]);
    }
#if BI_FIXED_KV
    if (in_place) {
        block_values_in_place(scores, v_at, n, per_kv, d, type, out, bs);
        return;
    }
#endif
    block_values(scores, values, n, per_kv, d, out, bs);
}

/* One part of a sequence's attention, every KV head's: context blocks [first_block,
 * last_block) of its table (this step's K/V already written), `context` tokens in all, for
 * the rotated queries `q[heads][d]`. Writes per query head the unnormalized output
 * `out[heads][d]`, the largest score `mx[heads]` and the sum of exp(score - mx)
 * `total[heads]` (an online softmax, block by block), for `merge_parts` to combine. A block's
 * KV heads are taken one after another: its keys of every head lie end to end, then its
 * values, so a part reads its blocks in runs as long as the block rather than one head's
 * slice of each. An 8-bit cache's scales fold into the scores' scale and the output:
 * q . (K k_scale) = (q . K) k_scale, and the output is linear in V. */
static void attend_part(const bi_model *m, const void *layer_cache, const float *q,
                        int64_t context, const int64_t *table, int64_t first_block,
                        int64_t last_block, float k_scale, float v_scale, float *out,
                        float *mx, float *total, float *scores, float *widened) {
    const int d = m->head_dim, bs = m->block_size, kv = m->num_kv_heads;
    const int per_kv = m->num_heads / kv, heads = m->num_heads;
    const int64_t head_bytes = (int64_t)bs * d * kv_element_bytes(m->kv_type);
    const float scale = k_scale / sqrtf((float)d);
    for (int h = 0; h < heads; h++) {
        mx[h] = -INFINITY;
        total[h] = 0.f;
        memset(out + h * d, 0, sizeof(float) * d);
    }
    for (int64_t b = first_block; b < last_block; b++) {
        const int64_t t0 = b * bs;
        const int n = context - t0 < bs ? (int)(context - t0) : bs;
        const char *k_at = (const char *)layer_cache + table[b] * 2 * kv * head_bytes;
        if (b + PREFETCH_BLOCKS < last_block)  /* the keys and values of every head */
            prefetch_bytes((const char *)layer_cache + table[b + PREFETCH_BLOCKS] * 2 * kv
                           * head_bytes, 2 * kv * head_bytes);
        for (int i = 0; i < kv; i++)
            attend_block(m, k_at + i * head_bytes, k_at + (kv + i) * head_bytes, n,
                         q + i * per_kv * d, scale, out + i * per_kv * d, mx + i * per_kv,
                         total + i * per_kv, scores, widened);
    }
    if (v_scale != 1.f)
        for (int i = 0; i < heads * d; i++) out[i] *= v_scale;
}

/* The attention of `heads` query heads from `parts` partial results (`attend_part`), each
 * `[heads][d + 2]` (output, then max and total): the normalized output `[heads][d]`. */
static void merge_parts(const float *parts, int num_parts, int64_t part_stride, int heads,
                        int d, float *out) {
    for (int h = 0; h < heads; h++) {
        float best = -INFINITY;
        for (int p = 0; p < num_parts; p++) {
            const float v = parts[p * part_stride + h * (d + 2) + d];
            best = v > best ? v : best;
        }
        float total = 0.f;
        float *oh = out + h * d;
        memset(oh, 0, sizeof(float) * d);
        for (int p = 0; p < num_parts; p++) {
            const float *part = parts + p * part_stride + h * (d + 2);
            if (part[d] == -INFINITY) continue;  /* an empty part */
            const float w = expf(part[d] - best);
            total += w * part[d + 1];
#pragma omp simd
            for (int i = 0; i < d; i++) oh[i] += w * part[i];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int i = 0; i < d; i++) oh[i] *= inv;
    }
}

/* Parts a sequence's context is cut into so that every thread has work: at most
 * MAX_PARTS, none shorter than MIN_PART_TOKENS. */
#define MAX_PARTS 16
#define MIN_PART_TOKENS 64

static int parts_wanted(int rows, int threads) {
    const int parts = (2 * threads + rows - 1) / rows;
    return parts < 1 ? 1 : parts > MAX_PARTS ? MAX_PARTS : parts;
}

static int64_t max_k(const bi_model *m) {
    int64_t k = m->hidden;
    if (m->intermediate > k) k = m->intermediate;
    if (m->num_heads * m->head_dim > k) k = m->num_heads * m->head_dim;
    return k;
}

/* Where `bi_decode`'s scratch goes: shared buffers, then one private set per thread. */
typedef struct {
    float *x, *qkv, *att, *gu, *parts;
    void *att_in;   /* the o projection's prepared input (filled slice by slice) */
    int32_t *done;  /* [layers][rows]: parts of each row's attention finished */
    int32_t *claims;  /* [layers * 4 + 1][threads]: each linear's claim counters */
    float *private_base;
    int64_t private_floats, total;
} bi_scratch;

static int64_t floats_for(int64_t bytes) { return (bytes + 63) / 64 * 16; }

/* Claim counters of a decode step's linears (`linear_share`): four a layer and the LM head's,
 * one per thread each. */
static int64_t claim_counters(const bi_model *m, int threads) {
    return ((int64_t)m->num_layers * 4 + 1) * threads;
}

static bi_scratch scratch_layout(const bi_model *m, int rows, int threads, float *work) {
    const int64_t h = m->hidden, d = m->head_dim, kv = m->num_kv_heads;
    const int64_t qkv = (m->num_heads + 2 * kv) * d, att = (int64_t)m->num_heads * d;
    const int64_t per_kv = m->num_heads / kv, parts = parts_wanted(rows, threads);
    bi_scratch s = {0};
    int64_t at = 0;  /* offsets in floats; `work` may be NULL when only sizing */
#define TAKE(n) (at += (n), at - (n))
    const int64_t x = TAKE(rows * h), q = TAKE(rows * qkv), a = TAKE(rows * att);
    const int64_t att_in = TAKE(floats_for(input_bytes(att, rows)));
    const int64_t gu = TAKE(rows * 2 * (int64_t)m->intermediate);
    const int64_t pa = TAKE(rows * kv * parts * per_kv * (d + 2));
    const int64_t done = TAKE((int64_t)m->num_layers * rows);
    const int64_t claims = TAKE(claim_counters(m, threads));
#undef TAKE
    /* per thread: normalized input, silu(gate) * up, a linear's prepared input, scores,
     * rotated queries, a widened block of keys and values */
    s.private_floats = rows * (h + m->intermediate) + floats_for(input_bytes(max_k(m), rows))
                       + per_kv * m->block_size + m->num_heads * d + 2 * m->block_size * d
                       + 16;
    s.total = at + threads * s.private_floats;
    if (work) {
        s.x = work + x; s.qkv = work + q; s.att = work + a; s.att_in = work + att_in;
        s.gu = work + gu; s.parts = work + pa; s.done = (int32_t *)(work + done);
        s.claims = (int32_t *)(work + claims);
        s.private_base = work + at;
    }
    return s;
}

/* Floats of scratch `bi_decode` needs for `rows` rows and `threads` threads. */
int64_t bi_work_floats(const bi_model *m, int rows, int threads) {
    return scratch_layout(m, rows, threads, NULL).total;
}

/* Whether linear `l` of a decode step of `rows` rows takes 8-bit inputs (`bi_model.act8`). */
static int eight_bit(const bi_model *m, const bi_linear *l, int rows) {
    return BI_ACT8 && m->act8 && l->kind != BI_F32 && rows >= MIN_HELD_ROWS;
}

/* Every row of x normalized into `out`, prepared as linear `l` reads it (`eight`: rounded to
 * 8 bits, in the 16-bit form's room). */
static bi_input norm_rows(const bi_model *m, const float *x, const float *w, int rows,
                          const bi_linear *l, float *out, void *scratch, int eight) {
    for (int r = 0; r < rows; r++)
        rms_norm(x + r * m->hidden, w, m->hidden, m->eps, out + r * m->hidden);
    bi_input in = input_at(out, m->hidden, m->hidden, rows, scratch);
    if (eight) in.q8 = (int8_t *)in.q;
    prepare_rows(l, &in, rows);
    return in;
}

/* Store KV head `i` of one row's new token (`row`: its q, k, v; `c`, `sn`: its RoPE row) at
 * cache slot `slot`; `scratch`: `head_dim` floats. */
static void store_new_kv(const bi_model *m, char *cache, const float *row, int i, int64_t slot,
                         const float *c, const float *sn, float k_scale, float v_scale,
                         float *scratch) {
    const int d = m->head_dim, kv = m->num_kv_heads, bs = m->block_size;
    const int64_t block = slot / bs, offset = slot % bs, eb = kv_element_bytes(m->kv_type);
    char *kdst = cache + (((block * 2 + 0) * kv + i) * bs + offset) * d * eb;
    char *vdst = cache + (((block * 2 + 1) * kv + i) * bs + offset) * d * eb;
    memcpy(scratch, row + (m->num_heads + i) * d, sizeof(float) * d);
    rope(scratch, c, sn, d / 2);
    kv_store(scratch, d, m->kv_type, k_scale, kdst);
    kv_store(row + (m->num_heads + kv + i) * d, d, m->kv_type, v_scale, vdst);
}

/* One decode step: `rows` sequences, one new token each (`tokens`, `positions`), their K/V
 * written at `slots`; sequence r's context is `context_lens[r]` tokens whose blocks are
 * `block_ids[block_starts[r] ..]`. Writes `logits` `[rows][vocab]`. With `m->kv_first`, rows
 * may be positions of one sequence (each attending to the ones before it). `work`: at least
 * `bi_work_floats(m, rows, threads)` floats.
 *
 * One parallel region, five barriers a layer: each thread normalizes the whole residual
 * stream into its own buffer (a few hundred floats a row: cheaper than a barrier), so a
 * linear's outputs split among threads start as soon as its input is complete; an attention
 * task ropes its own queries, the task holding a sequence's last block writes the new K/V,
 * and the last part of a cut context to finish merges the parts. */
void bi_decode(const bi_model *m, int rows, const int64_t *tokens, const int64_t *positions,
               const int64_t *slots, const int64_t *context_lens, const int64_t *block_ids,
               const int64_t *block_starts, float *work, float *logits, int threads) {
    const int hidden = m->hidden, d = m->head_dim, heads = m->num_heads, kv = m->num_kv_heads;
    const int inter = m->intermediate, bs = m->block_size, half = d / 2;
    const int qkv_n = (heads + 2 * kv) * d, att_n = heads * d, per_kv = heads / kv;
    const int max_parts = parts_wanted(rows, threads);
    const int64_t part_stride = (int64_t)per_kv * (d + 2);
    const int64_t layer_bytes = m->num_blocks * 2 * kv * (int64_t)bs * d * kv_element_bytes(m->kv_type);
    const bi_scratch s = scratch_layout(m, rows, threads, work);
    float *x = s.x, *qkv = s.qkv, *att = s.att, *gu = s.gu;
    const bi_input att_in16 = input_at(att, att_n, att_n, rows, s.att_in);

    for (int r = 0; r < rows; r++)
        memcpy(x + r * hidden, m->embed + tokens[r] * (int64_t)hidden, sizeof(float) * hidden);
    memset(s.done, 0, sizeof(int32_t) * (size_t)m->num_layers * rows);
    memset(s.claims, 0, sizeof(int32_t) * (size_t)claim_counters(m, threads));

#pragma omp parallel num_threads(threads)
    {
        float *h = s.private_base + omp_get_thread_num() * s.private_floats;
        float *act = h + rows * hidden;
        void *in_scratch = act + rows * inter;
        float *scores = (float *)in_scratch + floats_for(input_bytes(max_k(m), rows));
        float *q_rot = scores + per_kv * bs;
        float *widened = q_rot + heads * d;
        for (int li = 0; li < m->num_layers; li++) {
            const bi_layer *L = m->layers + li;
            char *cache = (char *)m->kv_cache + li * layer_bytes;
            const float k_scale = m->kv_scales ? m->kv_scales[2 * li] : 1.f;
            const float v_scale = m->kv_scales ? m->kv_scales[2 * li + 1] : 1.f;
            int32_t *done = s.done + (int64_t)li * rows;
            bi_input att_in = att_in16;
            if (eight_bit(m, &L->o, rows)) att_in.q8 = (int8_t *)att_in.q;
            bi_input in = norm_rows(m, x, L->input_norm, rows, &L->qkv, h, in_scratch,
                                    eight_bit(m, &L->qkv, rows));
            int32_t *claims = s.claims + (int64_t)li * 4 * threads;
            linear_share(&L->qkv, &in, rows, qkv, qkv_n, 0, claims);
#pragma omp barrier
            if (m->kv_first) {  /* a row may read the slots of rows before it */
#pragma omp for schedule(static)
                for (int task = 0; task < rows * kv; task++) {
                    const int r = task / kv;
                    store_new_kv(m, cache, qkv + r * qkv_n, task % kv, slots[r],
                                 m->rope_cos + positions[r] * half,
                                 m->rope_sin + positions[r] * half, k_scale, v_scale, widened);
                }
            }
#pragma omp for schedule(dynamic, 1)
            for (int task = 0; task < rows * max_parts; task++) {
                const int r = task / max_parts, part = task % max_parts;
                const int64_t context = context_lens[r], blocks = (context + bs - 1) / bs;
                int num_parts = (int)((context + MIN_PART_TOKENS - 1) / MIN_PART_TOKENS);
                num_parts = num_parts > max_parts ? max_parts : num_parts < 1 ? 1 : num_parts;
                if (part >= num_parts) continue;
                const float *row = qkv + r * qkv_n;
                const float *c = m->rope_cos + positions[r] * half;
                const float *sn = m->rope_sin + positions[r] * half;
                memcpy(q_rot, row, sizeof(float) * heads * d);
                for (int j = 0; j < heads; j++) rope(q_rot + j * d, c, sn, half);
                if (!m->kv_first && part == num_parts - 1)  /* it reads the new slot */
                    for (int i = 0; i < kv; i++)
                        store_new_kv(m, cache, row, i, slots[r], c, sn, k_scale, v_scale,
                                     widened);
                float mx[heads], total[heads], acc[heads * d];
                attend_part(m, cache, q_rot, context, block_ids + block_starts[r],
                            blocks * part / num_parts, blocks * (part + 1) / num_parts,
                            k_scale, v_scale, acc, mx, total, scores, widened);
                for (int j = 0; j < heads; j++) {  /* head j: KV head j / per_kv's parts */
                    float *out = s.parts + ((int64_t)(r * kv + j / per_kv) * max_parts + part)
                                 * part_stride + (j % per_kv) * (d + 2);
                    memcpy(out, acc + j * d, sizeof(float) * d);
                    out[d] = mx[j];
                    out[d + 1] = total[j];
                }
                /* The last part to finish (its writes released, the others' acquired) merges
                 * them and prepares the row's output for the o projection. */
                if (__atomic_add_fetch(done + r, 1, __ATOMIC_ACQ_REL) == num_parts) {
                    for (int i = 0; i < kv; i++)
                        merge_parts(s.parts + (int64_t)(r * kv + i) * max_parts * part_stride,
                                    num_parts, part_stride, per_kv, d,
                                    att + r * att_n + i * per_kv * d);
                    const int groups = att_n / GROUP;
#if BI_ACT8
                    if (att_in.q8)
                        quantize_groups8(att + r * att_n, groups, att_in.q8 + (int64_t)r * att_n,
                                         att_in.scale + (int64_t)r * groups,
                                         att_in.sum + (int64_t)r * groups, L->o.kind == BI_Q8);
                    else
#endif
                    if (L->o.kind != BI_F32)
                        quantize_groups(att + r * att_n, groups, att_in.q + (int64_t)r * att_n,
                                        att_in.scale + (int64_t)r * groups,
                                        att_in.sum + (int64_t)r * groups);
                }
            }
            /* x += o(att) */
            linear_share(&L->o, &att_in, rows, x, hidden, 1, claims + threads);
#pragma omp barrier
            in = norm_rows(m, x, L->post_norm, rows, &L->gate_up, h, in_scratch,
                           eight_bit(m, &L->gate_up, rows));
            linear_share(&L->gate_up, &in, rows, gu, 2 * inter, 0, claims + 2 * threads);
#pragma omp barrier
            for (int r = 0; r < rows; r++) {  /* silu(gate) * up, all of it, in each thread */
                silu_mul(act + r * inter, gu + r * 2 * inter, gu + r * 2 * inter + inter, 0,
                         inter);
            }
            in = input_at(act, inter, inter, rows, in_scratch);
            if (eight_bit(m, &L->down, rows)) in.q8 = (int8_t *)in.q;
            prepare_rows(&L->down, &in, rows);
            /* x += down(act) */
            linear_share(&L->down, &in, rows, x, hidden, 1, claims + 3 * threads);
#pragma omp barrier
        }
        bi_input in = norm_rows(m, x, m->final_norm, rows, &m->lm_head, h, in_scratch, 0);
        linear_share(&m->lm_head, &in, rows, logits, m->vocab, 0,
                     s.claims + (int64_t)m->num_layers * 4 * threads);
    }
}

/* ---- Self-attention of packed sentences (encoders; first prefill chunks) ------------------
 *
 * Sentences lie end to end in one row of tokens (no padding); each attends to itself only,
 * unmasked (encoders) or causally (a prompt's first chunk, whose context is its own tokens).
 * One task per (sentence, head), longest sentences first; a task copies its keys transposed and scaled
 * (`[d][L]`, rows padded to 16) so that a block of query rows scores 64 keys per pass with
 * every product in registers, then multiplies the row's probabilities with the values in
 * place. Scratch per thread: `d * (L + 16) + QROWS * (L + 16)` floats for the longest L. */

/* exp(s - max) in place over the first valid[r] of each of R score rows, zeros from there to
 * n_all; inv[r]: 1 / their sum. */
static void softmax_rows(float *scores, int64_t lds, int R, const int *valid, int n_all,
                         float *inv) {
    for (int r = 0; r < R; r++) {
        float *s = scores + r * lds, best = -INFINITY;
        const int n = valid[r];
        if (n < n_all) memset(s + n, 0, sizeof(float) * (n_all - n));
#if BI_SOFTMAX_FAST
        if (softmax_row_fast(s, n, inv + r)) continue;
#endif
        for (int j = max_span(s, n, &best); j < n; j++) best = s[j] > best ? s[j] : best;
        inv[r] = 1.f / exp_shifted(s, n, best);
    }
}

#if BI_PACKED_FAST
/* sentence_rows' vector body (the level's sentence_scores and sentence_values) for a head size D and R rows known at compile time. */
static inline __attribute__((always_inline)) void
sentence_rows_fixed(const float *const *qr, const int R, const float *v, int64_t ld,
                    const float *kt, int64_t ldk, int n, const int *valid, const int D,
                    float *scores, float *const *outr) {
    float inv[QROWS];
    sentence_scores(qr, R, kt, ldk, n, D, scores, ldk);
    softmax_rows(scores, ldk, R, valid, n, inv);
    sentence_values(scores, ldk, R, v, ld, n, D, inv, outr);
}

/* sentence_rows' vector form for head sizes 32 and 64: 1 where it took the rows. */
static int sentence_rows_fast(const float *const *qr, int R, const float *v, int64_t ldv,
                              const float *kt, int64_t ldk, int n, const int *valid, int d,
                              float *scores, float *const *outr) {
    if (d != 32 && d != 64) return 0;
    if (R == QROWS && d == 32)
        sentence_rows_fixed(qr, QROWS, v, ldv, kt, ldk, n, valid, 32, scores, outr);
    else if (R == QROWS)
        sentence_rows_fixed(qr, QROWS, v, ldv, kt, ldk, n, valid, 64, scores, outr);
    else if (d == 32)
        sentence_rows_fixed(qr, 1, v, ldv, kt, ldk, n, valid, 32, scores, outr);
    else
        sentence_rows_fixed(qr, 1, v, ldv, kt, ldk, n, valid, 64, scores, outr);
    return 1;
}
#endif

/* Scores and values of R query rows, portable (any d). */
static void sentence_scores_any(const float *const *qr, int R, const float *kt, int64_t ldk,
                                int n, int d, float *scores, int64_t lds) {
    for (int r = 0; r < R; r++) {
        float *s = scores + r * lds;
        memset(s, 0, sizeof(float) * n);
        for (int c = 0; c < d; c++) {
            const float qc = qr[r][c];
            const float *row = kt + c * ldk;
#pragma omp simd
            for (int j = 0; j < n; j++) s[j] += qc * row[j];
        }
    }
}

static void sentence_values_any(const float *p, int64_t lds, int R, const float *v, int64_t ld,
                                int n, int d, const float *inv, float *const *outr) {
    for (int r = 0; r < R; r++) {
        float *o = outr[r];
        memset(o, 0, sizeof(float) * d);
        for (int j = 0; j < n; j++) {
            const float w = p[r * lds + j];
            const float *vj = v + j * ld;
#pragma omp simd
            for (int i = 0; i < d; i++) o[i] += w * vj[i];
        }
#pragma omp simd
        for (int i = 0; i < d; i++) o[i] *= inv[r];
    }
}

/* Rows [r0, r0 + R) of one (sentence, head) over its first n keys (R: QROWS or 1; causal:
 * row r sees keys [0, r]): scores, softmax, values. q rows `ldq` apart, v rows `ldv`. */
static void sentence_rows(const float *q, int64_t ldq, const float *v, int64_t ldv, float *out,
                          int64_t ldo, int r0, int R, const float *kt, int64_t ldk, int n,
                          int causal, int d, float *scores) {
    const float *qr[QROWS];
    float *outr[QROWS];
    int valid[QROWS];
    if (causal && r0 + R < n) n = r0 + R;  /* no row of the block sees past its last */
    for (int r = 0; r < R; r++) {
        qr[r] = q + (r0 + r) * ldq;
        outr[r] = out + (r0 + r) * ldo;
        valid[r] = causal ? r0 + r + 1 : n;
    }
#if BI_PACKED_FAST
    if (sentence_rows_fast(qr, R, v, ldv, kt, ldk, n, valid, d, scores, outr)) return;
#endif
    float inv[QROWS];
    sentence_scores_any(qr, R, kt, ldk, n, d, scores, ldk);
    softmax_rows(scores, ldk, R, valid, n, inv);
    sentence_values_any(scores, ldk, R, v, ldv, n, d, inv, outr);
}
/* kt[c][j] = keys[j][c] * scale for j < n, zeros from n to n rounded up to 16 (keys: rows `ldk`
 * apart, d values each; kt rows `ldt` apart). */
static void transpose_keys(const float *keys, int64_t ldk, int n, int d, float scale, float *kt,
                           int64_t ldt) {
    const int padded = (n + 15) / 16 * 16;
#if BI_PACKED_FAST
    if (transpose_keys_fast(keys, ldk, n, d, scale, kt, ldt)) return;
#endif
    for (int c = 0; c < d; c++) memset(kt + c * ldt + n, 0, sizeof(float) * (padded - n));
    for (int j = 0; j < n; j++)
        for (int c = 0; c < d; c++) kt[c * ldt + j] = keys[j * ldk + c] * scale;
}

/* Attention of `num_seqs` packed sentences (token `starts[s]`, `lengths[s]` tokens each,
 * `longest` the largest): `heads` query heads of size `d` over `kv_heads` key/value heads
 * (query head h reads KV head h / (heads / kv_heads)), scores scaled by `scale`, each token
 * seeing its whole sentence, or (`causal`) itself and the tokens before it. q, k, v, out: rows
 * `ldq`, `ldk`, `ldv`, `ldo` floats apart, heads side by side in a row. Returns 0, or -1 when
 * the scratch cannot be had (nothing is then written). */
int bi_packed_attention(int num_seqs, const int64_t *starts, const int64_t *lengths,
                        int longest, int heads, int kv_heads, int d, const float *q,
                        int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                        float *out, int64_t ldo, float scale, int causal, int threads) {
    const int64_t ldt = (longest + 15) / 16 * 16 + 16;  /* a transposed key row */
    const size_t per_thread = sizeof(float) * (size_t)(d + QROWS) * ldt;  /* a multiple of 64 */
    const int group = heads / kv_heads;
    float *scratch = aligned_alloc(64, per_thread * (size_t)threads);
    if (!scratch) return -1;
#pragma omp parallel num_threads(threads)
    {
        float *kt = scratch + per_thread / sizeof(float) * omp_get_thread_num();
        float *scores = kt + (int64_t)d * ldt;
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < num_seqs * heads; task++) {
            const int s = num_seqs - 1 - task / heads, h = task % heads;  /* longest first */
            const int n = (int)lengths[s];
            const int64_t t0 = starts[s], kv_col = (int64_t)(h / group) * d;
            transpose_keys(k + t0 * ldk + kv_col, ldk, n, d, scale, kt, ldt);
            const float *qs = q + t0 * ldq + (int64_t)h * d, *vs = v + t0 * ldv + kv_col;
            float *os = out + t0 * ldo + (int64_t)h * d;
            int r = 0;
            for (; r + QROWS <= n; r += QROWS)
                sentence_rows(qs, ldq, vs, ldv, os, ldo, r, QROWS, kt, ldt, n, causal, d, scores);
            for (; r < n; r++)
                sentence_rows(qs, ldq, vs, ldv, os, ldo, r, 1, kt, ldt, n, causal, d, scores);
        }
    }
    free(scratch);
    return 0;
}
