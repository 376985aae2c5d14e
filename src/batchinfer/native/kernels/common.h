/* The kernels' shared contract: weight layouts, the structures the Python side fills
 * (`native/__init__.py` mirrors them with ctypes), the constants every level's kernels agree
 * on, and the list of what each instruction-set file defines.
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
 * 32, each group by its own scale (the power of two at or above its largest |x| / 32767: an
 * error of at most 3.1e-5 of that value, over a hundred times finer than bfloat16's
 * rounding; `input_scale16`), so that one 512-bit integer
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
 *
 * What each level's file (avx512.h, avx2.h, neon.h, portable.h) defines, included once into
 * cpu_kernels.c after this header (all `static`, so each build holds one level):
 *   BI_ISA_NAME                  the level's name (`bi_isa()`);
 *   BI_HELD16, held_tiles16_kind 1 where the level has held-weight kernels for many rows;
 *   BI_ACT8, quantize_groups8, held_tiles8_kind
 *                                1 where it has 8-bit-input products (the inputs rounded by
 *                                their group's largest |x| / 127 to nearest: the same integers
 *                                at every level; `flip`, set for q8 weights, lets a level
 *                                store them in its own form);
 *   BI_FIXED_KV, block_scores_fixed, block_values_fixed   1 where the decode attention reads
 *                                keys and values in place for head sizes 64 and 128;
 *   quantize_groups              a row's groups of 32 into 16-bit integers, scales and sums;
 *   quant_tile, f32_tile         one 16-output (quantized) or 4-output (float32) tile of 1..4
 *                                rows;
 *   kv_widen, silu_mul_span, exp_shifted_span, dot_span, max_span
 *                                the vector part of a loop: each does what it can from its
 *                                start and returns where the caller's scalar loop goes on;
 *   BI_GELU_FAST, gelu_span      1 where GELU has a vector form (the same contract);
 *   BI_PACKED_FAST, sentence_scores, sentence_values, transpose_keys_fast
 *                                1 where the packed attention has vector forms for head sizes
 *                                32 and 64 (transpose_keys_fast: 1 where it did the work, 0
 *                                where the portable loop must);
 *   BI_SOFTMAX_FAST, softmax_row_fast   1 where a score row's softmax has one (the same).
 */
#ifndef BI_KERNELS_COMMON_H
#define BI_KERNELS_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

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
    int32_t kv_first;  /* 1: rows may share a sequence (speculative decoding's verification
                        * rows): every row's K/V is written before any row attends */
} bi_model;

static inline int num_groups(const bi_linear *l) { return l->k / GROUP; }

/* Where group g of tile `tile` of a quantized linear's packed weights starts (`q4`: its
 * kind is BI_Q4: 8 chunks of 32 bytes a group, else 16). */
static inline const uint8_t *group_bytes(const bi_linear *l, int q4, int tile, int g) {
    return (const uint8_t *)l->weight + ((int64_t)tile * num_groups(l) + g) * (q4 ? 256 : 512);
}

static inline int tile_of(const bi_linear *l) { return l->kind == BI_F32 ? TILE_F32 : TILE_Q; }

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

/* A group whose largest |x| is below this is taken as zeros by the 8-bit rounding (127 / top
 * would overflow). */
#define TINY_GROUP 1e-30f

/* The 16-bit inputs' scale of a group whose largest |x| is `top`: the power of two 2^j at or
 * above top / 32767, j in [INPUT_EXP_MIN, INPUT_EXP_MAX] (a smaller top: the group is taken
 * as zeros, scale 1; a larger one saturates); `*inv` = 2^-j, or 0 for zeros. Multiplying by a
 * power of two is exact, so the held-weight kernels may apply it to a weight scale as an
 * integer add to its exponent (the AVX-512 `scaled`), where a float multiply would take an issue
 * slot of the integer products' vector units; and every level rounds x * 2^-j alike. The
 * rounding error is at most 2^(j-1), under top / 32767. The weights' scales are kept where
 * that add stays a float's exact product: 0 or |s| in [2^-66, 2^31) (`pack_q4`,
 * `pack_q8_groups` see to it; 2^-66 * 2^INPUT_EXP_MIN is still a normal float). */
#define INPUT_EXP_MIN (-60)
#define INPUT_EXP_MAX 96
static inline float input_scale16(float top, float *inv) {
    uint32_t bits;
    memcpy(&bits, &top, sizeof bits);
    /* top = 1.m * 2^(e - 127); 32767 * 2^j >= top first holds at j = e - 141 where 1.m <=
     * 2 - 2^-14 (m <= 0x7ffe00), else at e - 140 */
    const int e = (int)((bits >> 23) & 0xff);
    int j = e - ((bits & 0x7fffff) <= 0x7ffe00 ? 141 : 140);
    if (j < INPUT_EXP_MIN) {
        *inv = 0.f;
        return 1.f;
    }
    if (j > INPUT_EXP_MAX) j = INPUT_EXP_MAX;
    const uint32_t scale_bits = (uint32_t)(127 + j) << 23, inv_bits = (uint32_t)(127 - j) << 23;
    float scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    memcpy(inv, &inv_bits, sizeof *inv);
    return scale;
}


static inline void finish(float *y, int j, float v, const float *bias, int accumulate) {
    if (bias) v += bias[j];
    if (accumulate) y[j] += v; else y[j] = v;
}

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

/* The vector parts the driver's loops call: inlined where they are called, as one body. */
#define BI_INLINE static inline __attribute__((always_inline))

/* Query rows the packed attention scores per pass. */
#define QROWS 4

/* CALL(r0, R) over rows [0, rows): HELD_ROWS at a time, then the remainder (1..3); R is a
 * constant in each call, so that the held kernels keep their accumulators in registers. */
#define FOR_HELD_ROWS(rows, CALL)                                                         \
    do {                                                                                  \
        int r0_ = 0;                                                                      \
        for (; r0_ + HELD_ROWS <= (rows); r0_ += HELD_ROWS) CALL(r0_, HELD_ROWS);         \
        switch ((rows) - r0_) {                                                           \
        case 3: CALL(r0_, 3); break;                                                      \
        case 2: CALL(r0_, 2); break;                                                      \
        case 1: CALL(r0_, 1); break;                                                      \
        default: break;                                                                   \
        }                                                                                 \
    } while (0)

/* One tile for `rows` (1..4) input rows; constant row counts let the compiler keep every
 * accumulator in a register. */
#define DISPATCH_ROWS(call_rows) \
    switch (rows) { case 1: call_rows(1); break; case 2: call_rows(2); break; \
                    case 3: call_rows(3); break; default: call_rows(4); break; }

#endif
