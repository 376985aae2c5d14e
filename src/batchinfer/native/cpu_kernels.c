/* CPU kernels: weight-only quantized linears that read 4-bit or 8-bit weights straight from
 * their packed form (for one row or thousands), a whole decode step of a Llama-family model in
 * one call, and encoders' self-attention over packed sentences.
 *
 * Built on the machine that runs it, once per instruction-set level (see native/__init__.py),
 * loaded with ctypes; `bi_isa()` names the level of a build. AVX-512 paths where the compiler
 * targets AVX-512 (with VNNI's dot-product instructions where present); AVX2 paths where it
 * targets AVX2 + FMA + F16C and not AVX-512 (the quantized and float32 linears, the decode
 * attention, exp and SiLU; the rest is the portable loops, vectorized by the compiler);
 * portable C loops elsewhere (the compiler vectorizes them for the machine: SSE, NEON).
 * Threads: OpenMP, the same runtime torch uses, the count passed by the caller.
 *
 * Weight layouts (`bi_linear.kind`), for `n` outputs and `k` inputs:
 *   BI_F32: float32 `[n][k]`, row-major (a dense `nn.Linear` weight as it is), n % 4 == 0;
 *   BI_Q4:  4-bit integers q in 0..15 in groups of 32 along k, weight = q * scale + offset
 *           (GGUF Q4_1's grid); bytes `[n/16][k/32][8][32]`: for each tile of 16 outputs and
 *           each group, chunk i holds byte 2j+e = q[j][2i+e] | q[j][2i+16+e] << 4 (output j
 *           of the tile, e in 0..1); scale, offset float32 `[n/16][k/32][16]`;
 *   BI_Q8:  int8 q in -127..127 in groups of 32, weight = q * scale (GGUF Q8_0's grid);
 *           bytes `[n/16][k/32][16][32]`, chunk p holding byte 2j+e = q[j][2p+e]; scale
 *           `[n/16][k/32][16]`.
 *
 * How the quantized ones multiply: the input row is rounded to 16-bit integers in groups of
 * 32, each group by its own scale (its largest |x| / 32767: an error of at most 1.5e-5 of that
 * value, about 250 times finer than bfloat16's rounding), so that one 512-bit integer
 * multiply-add (`vpdpwssd`) takes a pair of inputs against the same pair of weights of 16
 * outputs at once, one output per 32-bit lane. Unpacking a weight to 16 bits costs one or two
 * instructions per 32 weights, where converting each weight to float32 costs four: the
 * float32 form of these kernels ran 2-3 times slower on a 2-core Xeon (AVX-512 VNNI).
 * For a few rows, each 16-output tile unpacks its weights per four rows; from 8 rows on, four
 * tiles unpack a group's weights once (into L1) and every row of a block of 32 runs against
 * them, 4 rows x 4 tiles at a time: sixteen independent chains of multiply-adds, enough to
 * keep both vector units of a core busy through the instruction's latency (the earlier form,
 * one tile's weights in registers and 4 rows x 2 chains, ran 10-20 % slower on a 2-core Xeon
 * with AVX-512 VNNI); from 32 rows per thread on, threads take blocks of rows.
 *
 * Also here: the self-attention of packed (unpadded) sentences, for encoders.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define BI_AVX512 1
#else
#define BI_AVX512 0
#endif
/* 256-bit paths where the compiler targets AVX2 + FMA (+ F16C) but not AVX-512 */
#if !BI_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define BI_AVX2 1
#else
#define BI_AVX2 0
#endif
/* 8-bit inputs' products (`vpdpbusd`) where AVX-512 VNNI is there */
#if BI_AVX512 && defined(__AVX512VNNI__)
#define BI_ACT8 1
#else
#define BI_ACT8 0
#endif

#define TILE_F32 4  /* outputs per tile of the float32 kernel */
#define TILE_Q 16   /* outputs per tile of the quantized layouts: one per 32-bit lane */
#define GROUP 32
#define ROW_TILE 4

enum { BI_F32 = 0, BI_Q4 = 1, BI_Q8 = 2 };

typedef struct {
    int32_t kind, n, k, reserved;
    const void *weight;
    const float *scale;
    const float *offset;
    const float *bias;
} bi_linear;

typedef struct {
    const float *input_norm, *post_norm;
    bi_linear qkv, o, gate_up, down;
} bi_layer;

/* Element types of the KV cache (`bi_model.kv_type`). The 8-bit ones hold K / k_scale and
 * V / v_scale, clamped to the type's range (one scale pair per layer, `bi_model.kv_scales`). */
enum { BI_KV_F32 = 0, BI_KV_F16 = 1, BI_KV_BF16 = 2, BI_KV_E4M3 = 3, BI_KV_E5M2 = 4 };

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads;
    int32_t head_dim, intermediate, vocab, block_size;
    float eps;
    int32_t kv_type;
    const float *embed;       /* [vocab][hidden]: the token embedding table */
    const float *final_norm;  /* [hidden] */
    const float *rope_cos;    /* [max_positions][head_dim / 2] */
    const float *rope_sin;
    const bi_layer *layers;
    bi_linear lm_head;
    void *kv_cache;  /* [layers][num_blocks][2][kv_heads][block_size][head_dim], of kv_type */
    int64_t num_blocks;
    const float *kv_scales;  /* [layers][2]: k_scale, v_scale; NULL: all 1 */
    int32_t act8;  /* 1: the layers' quantized products of MIN_HELD_ROWS+ rows take 8-bit inputs */
} bi_model;

int bi_avx512(void) { return BI_AVX512; }

/* The instruction-set level this build's kernels use (native/__init__.py's ISA_LEVELS). */
const char *bi_isa(void) { return BI_AVX512 ? "avx512" : BI_AVX2 ? "avx2" : "portable"; }

/* ---- linears -------------------------------------------------------------------------- */

static inline int num_groups(const bi_linear *l) { return l->k / GROUP; }
static inline int tile_of(const bi_linear *l) { return l->kind == BI_F32 ? TILE_F32 : TILE_Q; }

#if BI_AVX2
/* Horizontal sum and maximum of 8 floats. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* A linear's input rows as its kernel reads them: float32 rows (BI_F32), or per group of 32
 * the 16-bit integers `q`, their `scale` and the float sum of the group (`sum`, for q4's
 * offsets). */
typedef struct {
    const float *x;
    int64_t ldx;
    int16_t *q;   /* [rows][k] */
    float *scale; /* [rows][k / 32] */
    float *sum;   /* [rows][k / 32] */
    int8_t *q8;   /* [rows][k]: where set, the rows rounded to 8 bits instead (in q's room) */
} bi_input;

/* A group whose largest |x| is below this is taken as zeros (32767 / top would overflow). */
#define TINY_GROUP 1e-30f

/* Groups [0, groups) of one row into 16-bit integers, scales and sums. */
static void quantize_groups(const float *x, int groups, int16_t *q, float *scale, float *sum) {
#if BI_AVX512
    const __m512 sign = _mm512_set1_ps(-0.f);
    for (int g = 0; g < groups; g++) {
        const __m512 a = _mm512_loadu_ps(x + g * GROUP), b = _mm512_loadu_ps(x + g * GROUP + 16);
        const float top = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        const __m512 inv = _mm512_set1_ps(top > TINY_GROUP ? 32767.f / top : 0.f);
        /* round to nearest (the default mode), then narrow with saturation */
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
        _mm256_storeu_si256((__m256i *)(q + g * GROUP), _mm512_cvtsepi32_epi16(qa));
        _mm256_storeu_si256((__m256i *)(q + g * GROUP + 16), _mm512_cvtsepi32_epi16(qb));
        scale[g] = top / 32767.f;
        sum[g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
    return;
#elif BI_AVX2
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int g = 0; g < groups; g++) {
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(x + g * GROUP + 8 * i);
        const float top = hmax8(_mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
        const __m256 inv = _mm256_set1_ps(top > TINY_GROUP ? 32767.f / top : 0.f);
        __m256i qi[4];  /* round to nearest (the default mode) */
        for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        /* narrow with saturation; packs works within 128-bit lanes: put them back in order */
        const __m256i a = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xd8);
        const __m256i b = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xd8);
        _mm256_storeu_si256((__m256i *)(q + g * GROUP), a);
        _mm256_storeu_si256((__m256i *)(q + g * GROUP + 16), b);
        scale[g] = top / 32767.f;
        sum[g] = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    }
    return;
#endif
    for (int g = 0; g < groups; g++) {
        const float *v = x + g * GROUP;
        float top = 0.f, total = 0.f;
        for (int i = 0; i < GROUP; i++) {
            const float a = fabsf(v[i]);
            top = a > top ? a : top;
            total += v[i];
        }
        const float s = top / 32767.f, inv = top > TINY_GROUP ? 32767.f / top : 0.f;
        for (int i = 0; i < GROUP; i++) q[g * GROUP + i] = (int16_t)lrintf(v[i] * inv);
        scale[g] = s;
        sum[g] = total;
    }
}

#if BI_ACT8  /* the 8-bit inputs' kernels (below) */
static void quantize_groups8(const float *x, int groups, int8_t *q, float *scale, float *sum,
                             int flip);
static void held_tiles8(const bi_linear *l, int tile, int T, const int8_t *xq, const float *xs,
                        const float *xsum, int rows, float *y, int64_t ldy, int accumulate);
#endif

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

static inline void finish(float *y, int j, float v, const float *bias, int accumulate) {
    if (bias) v += bias[j];
    if (accumulate) y[j] += v; else y[j] = v;
}

#if BI_AVX512
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

static inline __attribute__((always_inline)) void
f32_tile(const bi_linear *l, int tile, const float *x, int64_t ldx, int rows,
         float *y, int64_t ldy, int accumulate) {
    const int k = l->k;
    const float *w = (const float *)l->weight + (int64_t)tile * TILE_F32 * k;
    /* float32 weights stream from memory: fetch the tile two ahead (inside the weight) */
    const float *ahead = tile + 2 < l->n / TILE_F32 ? w + (int64_t)2 * TILE_F32 * k : w;
    __m512 acc[ROW_TILE][TILE_F32];
    for (int r = 0; r < ROW_TILE; r++)
        for (int j = 0; j < TILE_F32; j++) acc[r][j] = _mm512_setzero_ps();
    for (int i = 0; i < k; i += 16) {
        const __mmask16 m = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
        __m512 xv[ROW_TILE];
        for (int r = 0; r < rows; r++) xv[r] = _mm512_maskz_loadu_ps(m, x + r * ldx + i);
        for (int j = 0; j < TILE_F32; j++) {
            _mm_prefetch((const char *)(ahead + (int64_t)j * k + i), _MM_HINT_T0);
            const __m512 wv = _mm512_maskz_loadu_ps(m, w + (int64_t)j * k + i);
            for (int r = 0; r < rows; r++) acc[r][j] = _mm512_fmadd_ps(wv, xv[r], acc[r][j]);
        }
    }
    const float *bias = l->bias ? l->bias + tile * TILE_F32 : NULL;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < TILE_F32; j++)
            finish(y + r * ldy + tile * TILE_F32, j, _mm512_reduce_add_ps(acc[r][j]), bias,
                   accumulate);
}

/* One tile for `rows` (1..4) input rows; constant row counts let the compiler keep every
 * accumulator in a register. */
#define DISPATCH_ROWS(call_rows) \
    switch (rows) { case 1: call_rows(1); break; case 2: call_rows(2); break; \
                    case 3: call_rows(3); break; default: call_rows(4); break; }

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
#elif BI_AVX2
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

/* The lanes of a float32 row's last `left` (< 8) elements. */
static inline __m256i tail_mask8(int left) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lanes);
}

/* J outputs [j0, j0 + J) of a float32 tile for R rows: one chain per (row, output), two for a
 * single row (8 floats apart), so that FMA latency is covered. */
static inline __attribute__((always_inline)) void
f32_part(const bi_linear *l, int tile, int j0, const int J, const float *x, int64_t ldx,
         const int R, float *y, int64_t ldy, int accumulate) {
    const int k = l->k, U = R == 1 ? 2 : 1;
    const float *w = (const float *)l->weight + ((int64_t)tile * TILE_F32 + j0) * k;
    /* float32 weights stream from memory: fetch the tile two ahead (inside the weight) */
    const float *ahead = tile + 2 < l->n / TILE_F32 ? w + (int64_t)2 * TILE_F32 * k : w;
    __m256 acc[ROW_TILE][TILE_F32][2];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 * U <= k; i += 8 * U)
        for (int u = 0; u < U; u++) {
            __m256 xv[ROW_TILE];
            for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + r * ldx + i + 8 * u);
            for (int j = 0; j < J; j++) {
                if (u == 0) _mm_prefetch((const char *)(ahead + (int64_t)j * k + i), _MM_HINT_T0);
                const __m256 wv = _mm256_loadu_ps(w + (int64_t)j * k + i + 8 * u);
                for (int r = 0; r < R; r++)
                    acc[r][j][u] = _mm256_fmadd_ps(wv, xv[r], acc[r][j][u]);
            }
        }
    for (; i < k; i += 8) {
        const __m256i m = tail_mask8(k - i < 8 ? k - i : 8);
        __m256 xv[ROW_TILE];
        for (int r = 0; r < R; r++) xv[r] = _mm256_maskload_ps(x + r * ldx + i, m);
        for (int j = 0; j < J; j++) {
            const __m256 wv = _mm256_maskload_ps(w + (int64_t)j * k + i, m);
            for (int r = 0; r < R; r++) acc[r][j][0] = _mm256_fmadd_ps(wv, xv[r], acc[r][j][0]);
        }
    }
    const float *bias = l->bias ? l->bias + tile * TILE_F32 : NULL;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < J; j++)
            finish(y + r * ldy + tile * TILE_F32, j0 + j,
                   hsum8(U == 2 ? _mm256_add_ps(acc[r][j][0], acc[r][j][1]) : acc[r][j][0]),
                   bias, accumulate);
}

/* A float32 tile (4 outputs) for `rows` (1..4) rows: all four outputs together for up to two
 * rows, two at a time for three or four (the accumulators then still fit the registers). */
static inline __attribute__((always_inline)) void
f32_tile(const bi_linear *l, int tile, const float *x, int64_t ldx, const int rows,
         float *y, int64_t ldy, int accumulate) {
    if (rows <= 2) {
        f32_part(l, tile, 0, TILE_F32, x, ldx, rows, y, ldy, accumulate);
    } else {
        f32_part(l, tile, 0, 2, x, ldx, rows, y, ldy, accumulate);
        f32_part(l, tile, 2, 2, x, ldx, rows, y, ldy, accumulate);
    }
}

#define DISPATCH_ROWS(call_rows) \
    switch (rows) { case 1: call_rows(1); break; case 2: call_rows(2); break; \
                    case 3: call_rows(3); break; default: call_rows(4); break; }

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
#else  /* portable C: the same arithmetic, vectorized by the compiler for this machine */
static void linear_tile(const bi_linear *l, int tile, const bi_input *in, int r0, int rows,
                        float *y, int64_t ldy, int accumulate) {
    const int k = l->k, groups = num_groups(l), width = tile_of(l);
    for (int j = 0; j < width; j++) {
        const int col = tile * width + j;
        for (int r = r0; r < r0 + rows; r++) {
            float total = 0.f;
            if (l->kind == BI_F32) {
                const float *w = (const float *)l->weight + (int64_t)col * k;
                const float *xr = in->x + r * in->ldx;
#pragma omp simd reduction(+ : total)
                for (int i = 0; i < k; i++) total += w[i] * xr[i];
            } else {
                const int16_t *xq = in->q + (int64_t)r * k;
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
            }
            finish(y + (r - r0) * ldy + tile * width, j, total,
                   l->bias ? l->bias + tile * width : NULL, accumulate);
        }
    }
}
#endif

/* Rows the held-weight kernels serve at a time; from MIN_HELD_ROWS rows on, linears use them
 * (`held_tiles`); from BLOCK_ROWS rows per thread on, threads take blocks of rows instead of
 * shares of the tiles (`bi_linear_forward`). */
#define BLOCK_ROWS 32
#define MIN_HELD_ROWS 8
/* Tiles (of 16 outputs) the held-weight kernels take together, and rows per pass: 4 x 4 = 16
 * independent chains of multiply-adds, enough to keep both of a core's vector units busy
 * through the instruction's latency (the tiles' weights for the group are read from L1). */
#define HELD_TILES 4
#define HELD_ROWS 4

#if BI_AVX512
/* One group's weights of T tiles, unpacked to 16 bits in input-pair order: `wb[t][p]` holds
 * each of the tile's 16 outputs' weights for inputs 2p and 2p + 1 (one 32-bit lane each). */
static inline __attribute__((always_inline)) void
unpack_group16(const bi_linear *l, const int Q4, int tile, const int T, int g, __m512i *wb) {
    const int groups = num_groups(l);
    const int64_t chunk_bytes = Q4 ? 8 * 32 : 16 * 32;
    const __m512i low = _mm512_set1_epi16(0x0f);
    for (int t = 0; t < T; t++) {
        const uint8_t *wg = (const uint8_t *)l->weight
                            + ((int64_t)(tile + t) * groups + g) * chunk_bytes;
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
        const __m512 xs = _mm512_set1_ps(in->scale[at]), xsum = _mm512_set1_ps(in->sum[at]);
        for (int t = 0; t < T; t++) {
            float *a = acc + ((r0 + r) * HELD_TILES + t) * TILE_Q;
            __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r][t]), _mm512_mul_ps(s[t], xs),
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
                                   _mm512_mul_ps(_mm512_load_ps(s + T * TILE_Q), xs),     \
                                   _mm512_load_ps(a));                                    \
        if (Q4) v = _mm512_fmadd_ps(_mm512_load_ps(off + T * TILE_Q), xsum, v);           \
        _mm512_store_ps(a, v);                                                            \
    } while (0)
#define SCALE_ROW(R)                                                                      \
    do {                                                                                  \
        const int64_t at = (int64_t)(r0 + R) * groups + g;                                \
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
        int r0 = 0;
        for (; r0 + HELD_ROWS <= rows; r0 += HELD_ROWS) {
            if (T == HELD_TILES)
                rows_tiles16_4x4(wb, Q4, in, k, groups, g, r0, (const float *)s,
                                 (const float *)off, acc);
            else
                rows_tiles16(wb, Q4, T, in, k, groups, g, r0, HELD_ROWS, s, off, acc);
        }
        switch (rows - r0) {
        case 3: rows_tiles16(wb, Q4, T, in, k, groups, g, r0, 3, s, off, acc); break;
        case 2: rows_tiles16(wb, Q4, T, in, k, groups, g, r0, 2, s, off, acc); break;
        case 1: rows_tiles16(wb, Q4, T, in, k, groups, g, r0, 1, s, off, acc); break;
        default: break;
        }
    }
    for (int t = 0; t < T; t++) {
        const float *bias = l->bias ? l->bias + (tile + t) * TILE_Q : NULL;
        for (int r = 0; r < rows; r++)
            finish16(y + r * ldy + (tile + t) * TILE_Q,
                     _mm512_load_ps(acc + (r * HELD_TILES + t) * TILE_Q), bias, accumulate);
    }
}

#elif BI_AVX2
/* One group's weights of T tiles, unpacked to 16 bits in input-pair order: `wb[t][p][h]`
 * holds outputs 8h..8h+7 of tile t, their weights for inputs 2p and 2p + 1 (one 32-bit lane
 * each). */
static inline __attribute__((always_inline)) void
unpack_group16(const bi_linear *l, const int Q4, int tile, const int T, int g, __m256i *wb) {
    const int groups = num_groups(l);
    const int64_t chunk_bytes = Q4 ? 8 * 32 : 16 * 32;
    const __m256i low = _mm256_set1_epi16(0x0f);
    for (int t = 0; t < T; t++) {
        const uint8_t *wg = (const uint8_t *)l->weight
                            + ((int64_t)(tile + t) * groups + g) * chunk_bytes;
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
        for (int h = 0; h < 2; h++) {
            float *a = acc + (r0 + r) * HELD_TILES * TILE_Q + 8 * h;
            __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[r][h]),
                                       _mm256_mul_ps(_mm256_loadu_ps(s + 8 * h), xs),
                                       _mm256_load_ps(a));
            if (Q4) v = _mm256_fmadd_ps(_mm256_loadu_ps(off + 8 * h), xsum, v);
            _mm256_store_ps(a, v);
        }
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
            int r0 = 0;
            for (; r0 + HELD_ROWS <= rows; r0 += HELD_ROWS)
                rows_tile16(w, Q4, in, k, groups, g, r0, HELD_ROWS, s, off, a);
            switch (rows - r0) {
            case 3: rows_tile16(w, Q4, in, k, groups, g, r0, 3, s, off, a); break;
            case 2: rows_tile16(w, Q4, in, k, groups, g, r0, 2, s, off, a); break;
            case 1: rows_tile16(w, Q4, in, k, groups, g, r0, 1, s, off, a); break;
            default: break;
            }
        }
    }
    for (int t = 0; t < T; t++) {
        const float *bias = l->bias ? l->bias + (tile + t) * TILE_Q : NULL;
        for (int r = 0; r < rows; r++)
            for (int h = 0; h < 2; h++)
                finish8(y + r * ldy + (tile + t) * TILE_Q + 8 * h,
                        _mm256_load_ps(acc + (r * HELD_TILES + t) * TILE_Q + 8 * h),
                        bias ? bias + 8 * h : NULL, accumulate);
    }
}
#endif

#if BI_AVX512 || BI_AVX2
static void held_tiles16(const bi_linear *l, int tile, int T, const bi_input *in, int rows,
                         float *y, int64_t ldy, int accumulate) {
#define HELD16(Q, N) held_tiles16_kind(l, Q, tile, N, in, rows, y, ldy, accumulate)
    const int q4 = l->kind == BI_Q4;
    if (T == 4) { if (q4) HELD16(1, 4); else HELD16(0, 4); }
    else if (T == 3) { if (q4) HELD16(1, 3); else HELD16(0, 3); }
    else if (T == 2) { if (q4) HELD16(1, 2); else HELD16(0, 2); }
    else { if (q4) HELD16(1, 1); else HELD16(0, 1); }
#undef HELD16
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
#if BI_AVX512 || BI_AVX2
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

/* This thread's share of a linear, inside a parallel region (no barrier). */
static void linear_share(const bi_linear *l, const bi_input *in, int rows, float *y,
                         int64_t ldy, int accumulate) {
    const int tiles = l->n / tile_of(l), nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int first = (int)((int64_t)tiles * id / nt), last = (int)((int64_t)tiles * (id + 1) / nt);
    linear_tiles(l, first, last, in, rows, y, ldy, accumulate);
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
#pragma omp parallel num_threads(threads)
        linear_share(l, &in, rows, y, l->n, accumulate);
    }
    free(scratch);
    return 0;
}

int bi_linear_forward(const bi_linear *l, int rows, const float *x, float *y, int accumulate,
                      int threads) {
    return linear_forward(l, rows, x, y, accumulate, threads, 0);
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
    const int groups = num_groups(l);
    const int64_t chunk_bytes = Q4 ? 8 * 32 : 16 * 32;
    const __m512i nibbles = _mm512_set1_epi8(0x0f), ones = _mm512_set1_epi8(1);
    for (int t = 0; t < T; t++) {
        const uint8_t *wg = (const uint8_t *)l->weight
                            + ((int64_t)(tile + t) * groups + g) * chunk_bytes;
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
        int r0 = 0;
        for (; r0 + HELD_ROWS <= rows; r0 += HELD_ROWS) {
            if (T == HELD_TILES)
                rows_tiles8_4x4(wb, wsum, Q4, xq, xs, xsum, k, groups, g, r0, s, off, acc);
            else
                rows_tiles8(wb, wsum, Q4, T, xq, xs, xsum, k, groups, g, r0, HELD_ROWS, s, off,
                            acc);
        }
        switch (rows - r0) {
        case 3: rows_tiles8(wb, wsum, Q4, T, xq, xs, xsum, k, groups, g, r0, 3, s, off, acc); break;
        case 2: rows_tiles8(wb, wsum, Q4, T, xq, xs, xsum, k, groups, g, r0, 2, s, off, acc); break;
        case 1: rows_tiles8(wb, wsum, Q4, T, xq, xs, xsum, k, groups, g, r0, 1, s, off, acc); break;
        default: break;
        }
    }
    for (int t = 0; t < T; t++) {
        const float *bias = l->bias ? l->bias + (tile + t) * TILE_Q : NULL;
        for (int r = 0; r < rows; r++)
            finish16(y + r * ldy + (tile + t) * TILE_Q,
                     _mm512_load_ps(acc + (r * HELD_TILES + t) * TILE_Q), bias, accumulate);
    }
}

static void held_tiles8(const bi_linear *l, int tile, int T, const int8_t *xq, const float *xs,
                        const float *xsum, int rows, float *y, int64_t ldy, int accumulate) {
#define HELD8(Q, N) held_tiles8_kind(l, Q, tile, N, xq, xs, xsum, rows, y, ldy, accumulate)
    const int q4 = l->kind == BI_Q4;
    if (T == 4) { if (q4) HELD8(1, 4); else HELD8(0, 4); }
    else if (T == 3) { if (q4) HELD8(1, 3); else HELD8(0, 3); }
    else if (T == 2) { if (q4) HELD8(1, 2); else HELD8(0, 2); }
    else { if (q4) HELD8(1, 1); else HELD8(0, 1); }
#undef HELD8
}
#endif

int bi_act8(void) { return BI_ACT8; }

/* bi_linear_forward with the inputs rounded to 8 bits where that path exists (AVX-512 VNNI,
 * quantized weights, at least BLOCK_ROWS rows per thread); elsewhere bi_linear_forward. */
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

/* dst[i] = the value of src[i], a cache element of `type`, for i < n. */
static void kv_load(const void *src, int64_t n, int type, float *dst) {
    int64_t i = 0;
    switch (type) {
    case BI_KV_F32: memcpy(dst, src, sizeof(float) * n); return;
    case BI_KV_F16: {
        const uint16_t *h = src;
#if BI_AVX512
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(h + i))));
#elif BI_AVX2
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const void *)(h + i))));
#endif
        for (; i < n; i++) dst[i] = f16_to_f32(h[i]);
        return;
    }
    case BI_KV_BF16: {
        const uint16_t *h = src;
#if BI_AVX512
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(h + i))), 16)));
#elif BI_AVX2
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)(h + i))), 16)));
#endif
        for (; i < n; i++) dst[i] = bits_f32((uint32_t)h[i] << 16);
        return;
    }
    case BI_KV_E5M2: {
        const uint8_t *b = src;
#if BI_AVX512
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_slli_epi16(
                _mm256_cvtepu8_epi16(_mm_loadu_si128((const void *)(b + i))), 8)));
#endif
        for (; i < n; i++) dst[i] = f16_to_f32((uint16_t)(b[i] << 8));
        return;
    }
    default: {
        const uint8_t *b = src;
#if BI_AVX512
        const __m256i sign = _mm256_set1_epi16(0x80), rest = _mm256_set1_epi16(0x7F);
        const __m512 two8 = _mm512_set1_ps(256.f);
        for (; i + 16 <= n; i += 16) {
            const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const void *)(b + i)));
            const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, sign), 8),
                                              _mm256_slli_epi16(_mm256_and_si256(x, rest), 7));
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtph_ps(h), two8));
        }
#endif
        for (; i < n; i++) dst[i] = f16_to_f32(e4m3_as_f16(b[i])) * 256.f;
    }
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

#if BI_AVX512
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
#elif BI_AVX2
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
#endif

/* out[i] = silu(g[i]) * u[i] for i in [first, last) (`out` may be `g`). */
static void silu_mul(float *out, const float *g, const float *u, int first, int last) {
    int i = first;
#if BI_AVX512
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= last; i += 16) {
        const __m512 v = _mm512_loadu_ps(g + i);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(one, e)),
                                                _mm512_loadu_ps(u + i)));
    }
#elif BI_AVX2
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= last; i += 8) {
        const __m256 v = _mm256_loadu_ps(g + i);
        const __m256 e = exp8_ps(_mm256_sub_ps(_mm256_setzero_ps(), v));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(one, e)),
                                                _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < last; i++) out[i] = g[i] / (1.f + expf(-g[i])) * u[i];
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

#if BI_AVX512
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
#endif

/* x[i] = x[i] * (1 + erf(x[i] / sqrt(2))) / 2 for i < n, in place (GELU, erf form). */
void bi_gelu(float *x, int64_t n, int threads) {
    const int64_t chunk = 4096, chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static) if (chunks >= 4)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t i = c * chunk;
        const int64_t end = i + chunk < n ? i + chunk : n;
#if BI_AVX512
        const __m512 half = _mm512_set1_ps(0.5f), root = _mm512_set1_ps(0.70710678118654752f);
        for (; i + 16 <= end; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            const __m512 e = erf_ps(_mm512_mul_ps(v, root));
            _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_mul_ps(v, half),
                                                  _mm512_add_ps(e, _mm512_set1_ps(1.f))));
        }
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
    int i = 0;
#if BI_AVX512
    __m512 acc = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        const __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
        _mm512_storeu_ps(s + i, p);
        acc = _mm512_add_ps(acc, p);
    }
    sum = _mm512_reduce_add_ps(acc);
#elif BI_AVX2
    __m256 acc = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        const __m256 p = exp8_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
        _mm256_storeu_ps(s + i, p);
        acc = _mm256_add_ps(acc, p);
    }
    sum = hsum8(acc);
#endif
    for (; i < n; i++) {
        s[i] = expf(s[i] - m);
        sum += s[i];
    }
    return sum;
}

static inline float dot(const float *a, const float *b, int d) {
#if BI_AVX512
    if (d % 16 == 0) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
        for (int i = 16; i < d; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#elif BI_AVX2
    if (d % 16 == 0) {  /* two chains */
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
        __m256 odd = _mm256_mul_ps(_mm256_loadu_ps(a + 8), _mm256_loadu_ps(b + 8));
        for (int i = 16; i < d; i += 16) {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
            odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), odd);
        }
        return hsum8(_mm256_add_ps(acc, odd));
    }
#endif
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < d; i++) s += a[i] * b[i];
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

#if BI_AVX512
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

#elif BI_AVX2
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
#endif

#if BI_AVX512 || BI_AVX2
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
#if BI_AVX512 || BI_AVX2
    if (block_scores_in_place(q, keys, n, per_kv, d, BI_KV_F32, scale, scores, bs)) return;
#endif
    block_scores_any(q, keys, n, per_kv, d, scale, scores, bs);
}

static void block_values(const float *p, const float *values, int n, int per_kv, int d,
                         float *out, int bs) {
#if BI_AVX512 || BI_AVX2
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

/* One part of a sequence's attention, for the query heads that share KV head `kvh`: context
 * blocks [first_block, last_block) of its table (this step's K/V already written), `context`
 * tokens in all. Writes per head the unnormalized output `out[h][d]`, the largest score
 * `mx[h]` and the sum of exp(score - mx) `total[h]` (an online softmax, block by block), for
 * `merge_parts` to combine. `scores`: per_kv * block_size floats; `widened`: 2 * block_size *
 * head_dim floats, where a block of a narrower cache is widened to float32 (in L1) before the
 * float32 kernels read it. An 8-bit cache's scales fold into the scores' scale and the
 * output: q . (K k_scale) = (q . K) k_scale, and the output is linear in V. */
static void attend_part(const bi_model *m, const void *layer_cache, const float *q,
                        int64_t context, const int64_t *table, int64_t first_block,
                        int64_t last_block, int kvh, float k_scale, float v_scale, float *out,
                        float *mx, float *total, float *scores, float *widened) {
    const int d = m->head_dim, bs = m->block_size, kv = m->num_kv_heads;
    const int per_kv = m->num_heads / kv, type = m->kv_type;
    const int64_t eb = kv_element_bytes(type);
    const float scale = k_scale / sqrtf((float)d);
    for (int h = 0; h < per_kv; h++) {
        mx[h] = -INFINITY;
        total[h] = 0.f;
        memset(out + h * d, 0, sizeof(float) * d);
    }
    for (int64_t b = first_block; b < last_block; b++) {
        const int64_t t0 = b * bs;
        const int n = context - t0 < bs ? (int)(context - t0) : bs;
        const int64_t block = table[b];
        const char *k_at = (const char *)layer_cache + ((block * 2 + 0) * kv + kvh) * bs * d * eb;
        const char *v_at = (const char *)layer_cache + ((block * 2 + 1) * kv + kvh) * bs * d * eb;
        if (b + PREFETCH_BLOCKS < last_block) {
            const int64_t next = table[b + PREFETCH_BLOCKS];
            const int64_t left = context - t0 - PREFETCH_BLOCKS * bs;
            const int64_t next_n = left < bs ? left : bs;
            prefetch_bytes((const char *)layer_cache + ((next * 2 + 0) * kv + kvh) * bs * d * eb,
                           next_n * d * eb);
            prefetch_bytes((const char *)layer_cache + ((next * 2 + 1) * kv + kvh) * bs * d * eb,
                           next_n * d * eb);
        }
        const float *keys = (const float *)k_at, *values = (const float *)v_at;
        int in_place = 0;
#if BI_AVX512 || BI_AVX2
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
            int t = 0;
#if BI_AVX512  /* one dependent max per 16 scores, not per score */
            __m512 top = _mm512_set1_ps(best);
            for (; t + 16 <= n; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(sh + t));
            if (t < n)
                top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, (__mmask16)((1u << (n - t)) - 1),
                                                              sh + t));
            best = _mm512_reduce_max_ps(top);
            t = n;
#elif BI_AVX2
            __m256 top = _mm256_set1_ps(best);
            for (; t + 8 <= n; t += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(sh + t));
            best = hmax8(top);
#endif
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
#if BI_AVX512 || BI_AVX2
        if (in_place) {
            block_values_in_place(scores, v_at, n, per_kv, d, type, out, bs);
            continue;
        }
#endif
        block_values(scores, values, n, per_kv, d, out, bs);
    }
    if (v_scale != 1.f)
        for (int i = 0; i < per_kv * d; i++) out[i] *= v_scale;
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
#define MIN_PART_TOKENS 128

static int parts_wanted(int rows, int kv, int threads) {
    const int tasks = rows * kv;
    int parts = (2 * threads + tasks - 1) / tasks;
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
    int32_t *done;  /* [layers][rows][kv]: parts of each attention finished */
    float *private_base;
    int64_t private_floats, total;
} bi_scratch;

static int64_t floats_for(int64_t bytes) { return (bytes + 63) / 64 * 16; }

static bi_scratch scratch_layout(const bi_model *m, int rows, int threads, float *work) {
    const int64_t h = m->hidden, d = m->head_dim, kv = m->num_kv_heads;
    const int64_t qkv = (m->num_heads + 2 * kv) * d, att = (int64_t)m->num_heads * d;
    const int64_t per_kv = m->num_heads / kv, parts = parts_wanted(rows, (int)kv, threads);
    bi_scratch s = {0};
    int64_t at = 0;  /* offsets in floats; `work` may be NULL when only sizing */
#define TAKE(n) (at += (n), at - (n))
    const int64_t x = TAKE(rows * h), q = TAKE(rows * qkv), a = TAKE(rows * att);
    const int64_t att_in = TAKE(floats_for(input_bytes(att, rows)));
    const int64_t gu = TAKE(rows * 2 * (int64_t)m->intermediate);
    const int64_t pa = TAKE(rows * kv * parts * per_kv * (d + 2));
    const int64_t done = TAKE((int64_t)m->num_layers * rows * kv);
#undef TAKE
    /* per thread: normalized input, silu(gate) * up, a linear's prepared input, scores,
     * rotated queries, a widened block of keys and values */
    s.private_floats = rows * (h + m->intermediate) + floats_for(input_bytes(max_k(m), rows))
                       + per_kv * (m->block_size + d) + 2 * m->block_size * d + 16;
    s.total = at + threads * s.private_floats;
    if (work) {
        s.x = work + x; s.qkv = work + q; s.att = work + a; s.att_in = work + att_in;
        s.gu = work + gu; s.parts = work + pa; s.done = (int32_t *)(work + done);
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

/* One decode step: `rows` sequences, one new token each (`tokens`, `positions`), their K/V
 * written at `slots`; sequence r's context is `context_lens[r]` tokens whose blocks are
 * `block_ids[block_starts[r] ..]`. Writes `logits` `[rows][vocab]`. `work`: at least
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
    const int max_parts = parts_wanted(rows, kv, threads);
    const int64_t part_stride = (int64_t)per_kv * (d + 2);
    const int64_t layer_bytes = m->num_blocks * 2 * kv * (int64_t)bs * d * kv_element_bytes(m->kv_type);
    const bi_scratch s = scratch_layout(m, rows, threads, work);
    float *x = s.x, *qkv = s.qkv, *att = s.att, *gu = s.gu;
    const bi_input att_in16 = input_at(att, att_n, att_n, rows, s.att_in);

    for (int r = 0; r < rows; r++)
        memcpy(x + r * hidden, m->embed + tokens[r] * (int64_t)hidden, sizeof(float) * hidden);
    memset(s.done, 0, sizeof(int32_t) * (size_t)m->num_layers * rows * kv);

#pragma omp parallel num_threads(threads)
    {
        float *h = s.private_base + omp_get_thread_num() * s.private_floats;
        float *act = h + rows * hidden;
        void *in_scratch = act + rows * inter;
        float *scores = (float *)in_scratch + floats_for(input_bytes(max_k(m), rows));
        float *q_rot = scores + per_kv * bs;
        float *widened = q_rot + per_kv * d;
        for (int li = 0; li < m->num_layers; li++) {
            const bi_layer *L = m->layers + li;
            char *cache = (char *)m->kv_cache + li * layer_bytes;
            const float k_scale = m->kv_scales ? m->kv_scales[2 * li] : 1.f;
            const float v_scale = m->kv_scales ? m->kv_scales[2 * li + 1] : 1.f;
            int32_t *done = s.done + (int64_t)li * rows * kv;
            bi_input att_in = att_in16;
            if (eight_bit(m, &L->o, rows)) att_in.q8 = (int8_t *)att_in.q;
            bi_input in = norm_rows(m, x, L->input_norm, rows, &L->qkv, h, in_scratch,
                                    eight_bit(m, &L->qkv, rows));
            linear_share(&L->qkv, &in, rows, qkv, qkv_n, 0);
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
            for (int task = 0; task < rows * kv * max_parts; task++) {
                const int r = task / (kv * max_parts), i = task / max_parts % kv;
                const int part = task % max_parts;
                const int64_t context = context_lens[r], blocks = (context + bs - 1) / bs;
                int num_parts = (int)((context + MIN_PART_TOKENS - 1) / MIN_PART_TOKENS);
                num_parts = num_parts > max_parts ? max_parts : num_parts < 1 ? 1 : num_parts;
                if (part >= num_parts) continue;
                const float *row = qkv + r * qkv_n;
                const float *c = m->rope_cos + positions[r] * half;
                const float *sn = m->rope_sin + positions[r] * half;
                memcpy(q_rot, row + i * per_kv * d, sizeof(float) * per_kv * d);
                for (int j = 0; j < per_kv; j++) rope(q_rot + j * d, c, sn, half);
                if (part == num_parts - 1) {  /* the part that reads the new token's slot */
                    const int64_t block = slots[r] / bs, offset = slots[r] % bs;
                    const int64_t eb = kv_element_bytes(m->kv_type);
                    char *kdst = cache + (((block * 2 + 0) * kv + i) * bs + offset) * d * eb;
                    char *vdst = cache + (((block * 2 + 1) * kv + i) * bs + offset) * d * eb;
                    memcpy(widened, row + (heads + i) * d, sizeof(float) * d);
                    rope(widened, c, sn, half);
                    kv_store(widened, d, m->kv_type, k_scale, kdst);
                    kv_store(row + (heads + kv + i) * d, d, m->kv_type, v_scale, vdst);
                }
                float *first = s.parts + (int64_t)(r * kv + i) * max_parts * part_stride;
                float *out = first + part * part_stride;
                float mx[per_kv], total[per_kv], acc[per_kv * d];
                attend_part(m, cache, q_rot, context, block_ids + block_starts[r],
                            blocks * part / num_parts, blocks * (part + 1) / num_parts, i,
                            k_scale, v_scale, acc, mx, total, scores, widened);
                for (int j = 0; j < per_kv; j++) {
                    memcpy(out + j * (d + 2), acc + j * d, sizeof(float) * d);
                    out[j * (d + 2) + d] = mx[j];
                    out[j * (d + 2) + d + 1] = total[j];
                }
                /* The last part to finish (its writes released, the others' acquired) merges
                 * them and prepares its slice of the output for the o projection. */
                if (__atomic_add_fetch(done + r * kv + i, 1, __ATOMIC_ACQ_REL) == num_parts) {
                    const int at = i * per_kv * d;
                    merge_parts(first, num_parts, part_stride, per_kv, d, att + r * att_n + at);
#if BI_ACT8
                    if (att_in.q8)
                        quantize_groups8(att + r * att_n + at, per_kv * d / GROUP,
                                         att_in.q8 + (int64_t)r * att_n + at,
                                         att_in.scale + (int64_t)r * (att_n / GROUP) + at / GROUP,
                                         att_in.sum + (int64_t)r * (att_n / GROUP) + at / GROUP,
                                         L->o.kind == BI_Q8);
                    else
#endif
                    if (L->o.kind != BI_F32)
                        quantize_groups(att + r * att_n + at, per_kv * d / GROUP,
                                        att_in.q + (int64_t)r * att_n + at,
                                        att_in.scale + (int64_t)r * (att_n / GROUP) + at / GROUP,
                                        att_in.sum + (int64_t)r * (att_n / GROUP) + at / GROUP);
                }
            }
            linear_share(&L->o, &att_in, rows, x, hidden, 1);  /* x += o(att) */
#pragma omp barrier
            in = norm_rows(m, x, L->post_norm, rows, &L->gate_up, h, in_scratch,
                           eight_bit(m, &L->gate_up, rows));
            linear_share(&L->gate_up, &in, rows, gu, 2 * inter, 0);
#pragma omp barrier
            for (int r = 0; r < rows; r++) {  /* silu(gate) * up, all of it, in each thread */
                silu_mul(act + r * inter, gu + r * 2 * inter, gu + r * 2 * inter + inter, 0,
                         inter);
            }
            in = input_at(act, inter, inter, rows, in_scratch);
            if (eight_bit(m, &L->down, rows)) in.q8 = (int8_t *)in.q;
            prepare_rows(&L->down, &in, rows);
            linear_share(&L->down, &in, rows, x, hidden, 1);  /* x += down(act) */
#pragma omp barrier
        }
        bi_input in = norm_rows(m, x, m->final_norm, rows, &m->lm_head, h, in_scratch, 0);
        linear_share(&m->lm_head, &in, rows, logits, m->vocab, 0);
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
#define QROWS 4

/* exp(s - max) in place over the first valid[r] of each of R score rows, zeros from there to
 * n_all; inv[r]: 1 / their sum. */
static void softmax_rows(float *scores, int64_t lds, int R, const int *valid, int n_all,
                         float *inv) {
    for (int r = 0; r < R; r++) {
        float *s = scores + r * lds, best = -INFINITY;
        const int n = valid[r];
        if (n < n_all) memset(s + n, 0, sizeof(float) * (n_all - n));
        int j = 0;
#if BI_AVX512
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
        inv[r] = 1.f / _mm512_reduce_add_ps(acc);
        continue;
#endif
        for (; j < n; j++) best = s[j] > best ? s[j] : best;
        inv[r] = 1.f / exp_shifted(s, n, best);
    }
}

#if BI_AVX512
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

/* sentence_rows' AVX-512 body for a head size D and R rows known at compile time. */
static inline __attribute__((always_inline)) void
sentence_rows_fixed(const float *const *qr, const int R, const float *v, int64_t ld,
                    const float *kt, int64_t ldk, int n, const int *valid, const int D,
                    float *scores, float *const *outr) {
    float inv[QROWS];
    sentence_scores(qr, R, kt, ldk, n, D, scores, ldk);
    softmax_rows(scores, ldk, R, valid, n, inv);
    sentence_values(scores, ldk, R, v, ld, n, D, inv, outr);
}
#endif

/* The same, portable (any d). */
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
#if BI_AVX512
    if (d == 32 || d == 64) {
        if (R == QROWS && d == 32)
            sentence_rows_fixed(qr, QROWS, v, ldv, kt, ldk, n, valid, 32, scores, outr);
        else if (R == QROWS)
            sentence_rows_fixed(qr, QROWS, v, ldv, kt, ldk, n, valid, 64, scores, outr);
        else if (d == 32)
            sentence_rows_fixed(qr, 1, v, ldv, kt, ldk, n, valid, 32, scores, outr);
        else
            sentence_rows_fixed(qr, 1, v, ldv, kt, ldk, n, valid, 64, scores, outr);
        return;
    }
#endif
    float inv[QROWS];
    sentence_scores_any(qr, R, kt, ldk, n, d, scores, ldk);
    softmax_rows(scores, ldk, R, valid, n, inv);
    sentence_values_any(scores, ldk, R, v, ldv, n, d, inv, outr);
}

#if BI_AVX512
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
#endif

/* kt[c][j] = keys[j][c] * scale for j < n, zeros from n to n rounded up to 16 (keys: rows `ldk`
 * apart, d values each; kt rows `ldt` apart). */
static void transpose_keys(const float *keys, int64_t ldk, int n, int d, float scale, float *kt,
                           int64_t ldt) {
    const int padded = (n + 15) / 16 * 16;
#if BI_AVX512
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
        return;
    }
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
