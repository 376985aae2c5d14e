/* Checks one build of the native kernels against another (the portable level), entry point by
 * entry point, on random inputs at odd shapes: the linears (float32, q4, q8; 1-70 rows, 1-3
 * threads, bias, accumulation), the cache widening, SiLU, GELU, the packed attention (1-130
 * tokens, head sizes 16-128) and whole decode steps (every weight kind; every cache type at
 * head sizes 64 and 128); and a level's 8-bit-input products (`bi_linear_forward8`, 3-130
 * rows) against this file's own scalar reference of their rounding, and its decode steps with
 * 8-bit inputs against the portable 16-bit ones to within that rounding's error.
 * tests/test_native_levels.py builds both libraries and this program and runs it: natively
 * for the levels this CPU runs, under qemu-user for Arm NEON.
 *
 *   native_levels_check LEVEL.so PORTABLE.so    prints "ok NAME" per check; exit 1 on a mismatch
 */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

typedef int (*linear_fn)(const bi_linear *, int, const float *, float *, int, int);
typedef void (*kv_load_fn)(const void *, int64_t, int, float *);
typedef void (*kv_store_fn)(const float *, int64_t, int, float, void *);
typedef void (*silu_fn)(const float *, int, int, float *, int);
typedef int (*packed_fn)(int, const int64_t *, const int64_t *, int, int, int, int,
                         const float *, int64_t, const float *, int64_t, const float *, int64_t,
                         float *, int64_t, float, int, int);
typedef int64_t (*work_fn)(const bi_model *, int, int);
typedef void (*decode_fn)(const bi_model *, int, const int64_t *, const int64_t *,
                          const int64_t *, const int64_t *, const int64_t *, const int64_t *,
                          float *, float *, int);
typedef const char *(*isa_fn)(void);
typedef int (*flag_fn)(void);
typedef void (*gelu_fn)(float *, int64_t, int);

typedef struct {
    linear_fn linear;
    kv_load_fn kv_load;
    kv_store_fn kv_store;
    silu_fn silu;
    packed_fn packed;
    work_fn work;
    decode_fn decode;
    isa_fn isa;
    linear_fn linear8;
    flag_fn act8;
    gelu_fn gelu;
} kernels;

static int failures = 0;

static void *must(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "missing %s: %s\n", name, dlerror());
        exit(2);
    }
    return f;
}

static kernels open_kernels(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "cannot load %s: %s\n", path, dlerror());
        exit(2);
    }
    kernels k = {(linear_fn)must(lib, "bi_linear_forward"), (kv_load_fn)must(lib, "bi_kv_load"),
                 (kv_store_fn)must(lib, "bi_kv_store"), (silu_fn)must(lib, "bi_silu_mul_rows"),
                 (packed_fn)must(lib, "bi_packed_attention"),
                 (work_fn)must(lib, "bi_work_floats"), (decode_fn)must(lib, "bi_decode"),
                 (isa_fn)must(lib, "bi_isa"), (linear_fn)must(lib, "bi_linear_forward8"),
                 (flag_fn)must(lib, "bi_act8"), (gelu_fn)must(lib, "bi_gelu")};
    return k;
}

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint32_t next_u32(void) {  /* xorshift64* */
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return (uint32_t)((state * 0x2545F4914F6CDD1Dull) >> 32);
}
static float uniform(void) { return (float)next_u32() / 4294967296.f * 2.f - 1.f; }
static float *random_floats(int64_t n, float scale) {
    float *x = malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) x[i] = uniform() * scale;
    return x;
}
static void *random_bytes(int64_t n) {
    uint8_t *b = malloc((size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) b[i] = (uint8_t)next_u32();
    return b;
}

/* Reports whether `got` matches `want` to within `tol` of the larger of 1 and want's largest
 * magnitude (NaNs must sit at the same places). */
static void compare(const char *name, const float *got, const float *want, int64_t n, float tol) {
    float top = 1.f, worst = 0.f;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(want[i]) && fabsf(want[i]) > top) top = fabsf(want[i]);
    int64_t at = -1;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(want[i]) || isnan(got[i])) {
            if (isnan(want[i]) != isnan(got[i])) { worst = INFINITY; at = i; }
            continue;
        }
        const float err = want[i] == got[i] ? 0.f : fabsf(got[i] - want[i]);
        if (err > worst) { worst = err; at = i; }
    }
    if (worst > tol * top) {
        failures++;
        printf("FAIL %s: error %g at %lld (want %g, got %g; scale %g)\n", name, worst,
               (long long)at, want[at], got[at], top);
    } else {
        printf("ok %s\n", name);
    }
}

static bi_linear random_linear(int kind, int n, int k, int bias) {
    bi_linear l = {kind, n, k, 0, NULL, NULL, NULL, NULL};
    const int64_t tiles = n / TILE_Q, groups = k / GROUP;
    if (kind == BI_F32) {
        l.weight = random_floats((int64_t)n * k, 0.2f);
    } else {
        l.weight = random_bytes(tiles * groups * (kind == BI_Q4 ? 256 : 512));
        /* q8 weights span -127..127: a scale of an eighth of q4's keeps the outputs alike */
        l.scale = random_floats(tiles * groups * TILE_Q, kind == BI_Q4 ? 0.01f : 0.00125f);
        if (kind == BI_Q4) l.offset = random_floats(tiles * groups * TILE_Q, 0.05f);
    }
    if (bias) l.bias = random_floats(n, 0.5f);
    return l;
}

/* Weight j's integer for input i of a q4 or q8 linear, read from the packed layout. */
static int packed_weight(const bi_linear *l, int j, int i) {
    const int64_t at = (int64_t)(j / TILE_Q) * (l->k / GROUP) + i / GROUP;
    const int jj = j % TILE_Q, c = i % GROUP;
    if (l->kind == BI_Q4) {  /* chunk c % 16 / 2 holds inputs c (low nibble) and c + 16 (high) */
        const uint8_t *chunk = (const uint8_t *)l->weight + at * 256 + 32 * (c % 16 / 2);
        const uint8_t b = chunk[2 * jj + c % 2];
        return c < 16 ? b & 15 : b >> 4;
    }
    return ((const int8_t *)l->weight)[at * 512 + 32 * (c / 2) + 2 * jj + c % 2];
}

/* What a product with 8-bit inputs computes: each input group of 32 rounded to int8 by its
 * largest |x| / 127 (to nearest, as the kernels round), the integer products scaled by the
 * weight's and the input's scales, plus (q4) the offsets times the group's unrounded sum. */
static void linear8_reference(const bi_linear *l, int rows, const float *x, float *y,
                              int accumulate) {
    const int groups = l->k / GROUP;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < l->n; j++) {
            float total = 0.f;
            for (int g = 0; g < groups; g++) {
                const float *v = x + (int64_t)r * l->k + g * GROUP;
                float top = 0.f, sum = 0.f;
                for (int i = 0; i < GROUP; i++) {
                    top = fabsf(v[i]) > top ? fabsf(v[i]) : top;
                    sum += v[i];
                }
                const float inv = top > TINY_GROUP ? 127.f / top : 0.f;
                int32_t dot = 0;
                for (int i = 0; i < GROUP; i++)
                    dot += (int32_t)lrintf(v[i] * inv) * packed_weight(l, j, g * GROUP + i);
                const int64_t at = ((int64_t)(j / TILE_Q) * groups + g) * TILE_Q + j % TILE_Q;
                total += (float)dot * (l->scale[at] * (top / 127.f));
                if (l->kind == BI_Q4) total += l->offset[at] * sum;
            }
            if (l->bias) total += l->bias[j];
            float *out = y + (int64_t)r * l->n + j;
            *out = accumulate ? *out + total : total;
        }
}

/* The product of random weights of `kind` (n x k) for `rows` rows on `threads` threads, a bias
 * and accumulation by turns: level a's `bi_linear_forward` against b's; or (`eight`) a's
 * `bi_linear_forward8` against this file's reference of the 8-bit rounding where a has 8-bit
 * products at that many rows, else against a's own 16-bit product, bit for bit. */
static void check_linear(kernels a, kernels b, int eight, int kind, int n, int k, int rows,
                         int threads) {
    const char *kinds[] = {"f32", "q4", "q8"};
    const int bias = (rows + threads) % 2, accumulate = threads == 2;
    const int rounded = eight && a.act8() && rows >= MIN_HELD_ROWS;
    bi_linear l = random_linear(kind, n, k, bias);
    float *x = random_floats((int64_t)rows * k, 2.f);
    float *y0 = random_floats((int64_t)rows * n, 1.f);
    float *y1 = malloc(sizeof(float) * rows * n);
    memcpy(y1, y0, sizeof(float) * rows * n);
    char name[96];
    snprintf(name, sizeof name, "%s %s n=%d k=%d rows=%d threads=%d%s%s%s",
             eight ? "linear8" : "linear", kinds[kind], n, k, rows, threads, bias ? " bias" : "",
             accumulate ? " accumulate" : "", eight && !rounded ? " (16-bit)" : "");
    int failed = (eight ? a.linear8 : a.linear)(&l, rows, x, y0, accumulate, threads);
    if (rounded)
        linear8_reference(&l, rows, x, y1, accumulate);
    else
        failed |= (eight ? a : b).linear(&l, rows, x, y1, accumulate, threads);
    if (failed) {
        printf("FAIL %s: no scratch\n", name);
        failures++;
    } else {
        compare(name, y0, y1, (int64_t)rows * n, eight && !rounded ? 0.f : 2e-5f);
    }
    free((void *)l.weight); free((void *)l.scale); free((void *)l.offset);
    free((void *)l.bias); free(x); free(y0); free(y1);
}

static void check_linears(kernels a, kernels b) {
    /* n, k: one to five tiles of 16 (the held kernels take four at a time), and float32's
     * remainders */
    const int shapes[][2] = {{48, 96}, {80, 64}, {16, 32}, {32, 160}, {20, 37}, {12, 45}};
    /* rows: the few-row kernels (remainders of 4), the held ones with their remainders of 4,
     * blocks of 32 rows and their remainders (of 8, 16 and 32); all of them for the first two
     * shapes, some for the others */
    enum { counts = 17, some = 5 };
    const int row_counts[counts] = {1, 5, 9, 33, 130, 2, 3, 4, 7, 8, 12, 15, 17, 31, 64, 65, 97};
    for (int kind = BI_F32; kind <= BI_Q8; kind++)
        for (int s = 0; s < 6; s++) {
            const int n = shapes[s][0], k = shapes[s][1];
            if (kind != BI_F32 && (n % TILE_Q || k % GROUP)) continue;
            for (int ri = 0; ri < (s < 2 ? counts : some); ri++)
                for (int threads = 1; threads <= 3; threads++)
                    check_linear(a, b, 0, kind, n, k, row_counts[ri], threads);
        }
}

/* `bi_linear_forward8` of a level: with 8-bit inputs (a level with `bi_act8`), the rounded
 * products at 8+ rows (held tiles 1-4 at a time, the rows' remainders of 4, blocks of 32, 1-3
 * threads); the 16-bit product below 8 rows and on a level without. */
static void check_linears8(kernels a) {
    const int shapes[][2] = {{48, 96}, {112, 160}, {16, 32}, {80, 64}};
    enum { counts = 14, some = 6 };
    const int row_counts[counts] = {3, 8, 13, 33, 70, 130, 7, 9, 10, 11, 17, 31, 64, 97};
    for (int kind = BI_Q4; kind <= BI_Q8; kind++)
        for (int s = 0; s < 4; s++)
            for (int ri = 0; ri < (s < 2 ? counts : some); ri++)
                for (int threads = 1; threads <= 3; threads++)
                    check_linear(a, a, 1, kind, shapes[s][0], shapes[s][1], row_counts[ri],
                                 threads);
}

static void check_elementwise(kernels a, kernels b) {
    const char *types[] = {"f32", "f16", "bf16", "e4m3", "e5m2"};
    for (int type = 0; type < 5; type++) {
        const int64_t n = 77;
        void *src = random_bytes(n * 4);
        float *y0 = malloc(sizeof(float) * n), *y1 = malloc(sizeof(float) * n);
        a.kv_load(src, n, type, y0);
        b.kv_load(src, n, type, y1);
        char name[64];
        snprintf(name, sizeof name, "kv_load %s", types[type]);
        compare(name, y0, y1, n, 0.f);  /* widening is exact */
        free(src); free(y0); free(y1);
    }
    for (int inter = 3; inter <= 67; inter += 32) {
        const int rows = 9;
        float *gu = random_floats((int64_t)rows * 2 * inter, 6.f);
        float *y0 = malloc(sizeof(float) * rows * inter), *y1 = malloc(sizeof(float) * rows * inter);
        a.silu(gu, rows, inter, y0, 2);
        b.silu(gu, rows, inter, y1, 2);
        char name[64];
        snprintf(name, sizeof name, "silu_mul inter=%d", inter);
        compare(name, y0, y1, (int64_t)rows * inter, 1e-5f);
        free(gu); free(y0); free(y1);
    }
    for (int64_t n = 13; n <= 4 * 4096 + 37; n += 4 * 4096 + 24) {  /* one chunk; five, threaded */
        float *y0 = random_floats(n, 6.f), *y1 = malloc(sizeof(float) * n);
        memcpy(y1, y0, sizeof(float) * n);
        a.gelu(y0, n, 2);
        b.gelu(y1, n, 2);
        char name[64];
        snprintf(name, sizeof name, "gelu n=%lld", (long long)n);
        compare(name, y0, y1, n, 1.5e-7f);
        free(y0); free(y1);
    }
}

/* Sentences of 1 to 130 tokens (query rows in fours and a remainder, keys in sixteens and a
 * remainder), with a gap before one of them, at head sizes with and without vector forms. */
static void check_packed_attention(kernels a, kernels b) {
    enum { seqs = 9 };
    const int64_t lengths[seqs] = {1, 7, 33, 18, 64, 130, 3, 65, 4};
    int64_t starts[seqs];
    int total = 0;
    for (int s = 0; s < seqs; s++) {
        total += s == 3;  /* a row no sentence holds */
        starts[s] = total;
        total += (int)lengths[s];
    }
    const int heads = 4, kv_heads = 2, dims[] = {16, 24, 32, 64, 128};
    for (int di = 0; di < 5; di++)
        for (int causal = 0; causal < 2; causal++) {
            const int d = dims[di], threads = 1 + (di + causal) % 3;
            float *q = random_floats((int64_t)total * heads * d, 1.f);
            float *k = random_floats((int64_t)total * kv_heads * d, 1.f);
            float *v = random_floats((int64_t)total * kv_heads * d, 1.f);
            float *o0 = calloc((size_t)total * heads * d, sizeof(float));
            float *o1 = calloc((size_t)total * heads * d, sizeof(float));
            const float scale = 1.f / sqrtf((float)d);
            a.packed(seqs, starts, lengths, 130, heads, kv_heads, d, q, heads * d, k,
                     kv_heads * d, v, kv_heads * d, o0, heads * d, scale, causal, threads);
            b.packed(seqs, starts, lengths, 130, heads, kv_heads, d, q, heads * d, k,
                     kv_heads * d, v, kv_heads * d, o1, heads * d, scale, causal, threads);
            char name[64];
            snprintf(name, sizeof name, "packed_attention d=%d%s threads=%d", d,
                     causal ? " causal" : "", threads);
            compare(name, o0, o1, (int64_t)total * heads * d, 1e-5f);
            free(q); free(k); free(v); free(o0); free(o1);
        }
}

/* A two-layer model of random weights of `kind` and a KV cache of `kv_type` (filled by the
 * reference's own stores, so both libraries read the same bytes). */
typedef struct {
    bi_model m;
    bi_layer layers[2];
    int64_t cache_bytes;
} tiny_model;

static tiny_model tiny(int kind, int kv_type, int head_dim, int num_blocks, kernels ref) {
    tiny_model t;
    memset(&t, 0, sizeof t);
    bi_model *m = &t.m;
    m->num_layers = 2; m->hidden = 64; m->num_heads = 4; m->num_kv_heads = 2;
    m->head_dim = head_dim;
    m->intermediate = 96; m->vocab = 80; m->block_size = 16; m->eps = 1e-5f;
    m->kv_type = kv_type; m->num_blocks = num_blocks;
    const int max_positions = 128, half = m->head_dim / 2;
    m->embed = random_floats((int64_t)m->vocab * m->hidden, 1.f);
    m->final_norm = random_floats(m->hidden, 1.f);
    float *cos_t = malloc(sizeof(float) * max_positions * half);
    float *sin_t = malloc(sizeof(float) * max_positions * half);
    for (int p = 0; p < max_positions; p++)
        for (int i = 0; i < half; i++) {
            const float angle = p * powf(10000.f, -2.f * i / m->head_dim);
            cos_t[p * half + i] = cosf(angle);
            sin_t[p * half + i] = sinf(angle);
        }
    m->rope_cos = cos_t;
    m->rope_sin = sin_t;
    const int qkv_n = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    for (int li = 0; li < 2; li++) {
        bi_layer *L = t.layers + li;
        L->input_norm = random_floats(m->hidden, 1.f);
        L->post_norm = random_floats(m->hidden, 1.f);
        L->qkv = random_linear(kind, qkv_n, m->hidden, li == 0);
        L->o = random_linear(kind, m->hidden, m->num_heads * m->head_dim, 0);
        L->gate_up = random_linear(kind, 2 * m->intermediate, m->hidden, 0);
        L->down = random_linear(kind, m->hidden, m->intermediate, 0);
    }
    m->lm_head = random_linear(BI_F32, m->vocab, m->hidden, 0);
    const int64_t elements = 2 * m->num_blocks * 2 * m->num_kv_heads * m->block_size * m->head_dim;
    const int64_t eb = kv_type == BI_KV_F32 ? 4 : kv_type <= BI_KV_BF16 ? 2 : 1;
    t.cache_bytes = elements * eb;
    float *values = random_floats(elements, 1.f);
    m->kv_cache = malloc((size_t)t.cache_bytes);
    ref.kv_store(values, elements, kv_type, 1.f, m->kv_cache);
    free(values);
    return t;
}

/* Three sequences of 5, 17 and 40 tokens (blocks [0], [1, 2], [3, 4, 5]) decoded by both
 * libraries, each on its own copy of the cache. */
static void decode_case(kernels a, kernels b, int kind, int kv_type, int head_dim, int threads,
                        const char *name) {
    tiny_model t = tiny(kind, kv_type, head_dim, 8, b);
    t.m.layers = t.layers;  /* this copy's own layers */
    void *cache = t.m.kv_cache, *copy = malloc((size_t)t.cache_bytes);
    memcpy(copy, cache, (size_t)t.cache_bytes);
    const int rows = 3;
    const int64_t tokens[] = {3, 41, 77}, context[] = {5, 17, 40};
    const int64_t block_ids[] = {0, 1, 2, 3, 4, 5}, block_starts[] = {0, 1, 3};
    int64_t positions[3], slots[3];
    for (int r = 0; r < rows; r++) {
        positions[r] = context[r] - 1;
        slots[r] = block_ids[block_starts[r] + positions[r] / 16] * 16 + positions[r] % 16;
    }
    float *l0 = malloc(sizeof(float) * rows * t.m.vocab);
    float *l1 = malloc(sizeof(float) * rows * t.m.vocab);
    float *w0 = malloc(sizeof(float) * a.work(&t.m, rows, threads));
    float *w1 = malloc(sizeof(float) * b.work(&t.m, rows, threads));
    t.m.kv_cache = cache;
    a.decode(&t.m, rows, tokens, positions, slots, context, block_ids, block_starts, w0, l0,
             threads);
    t.m.kv_cache = copy;
    b.decode(&t.m, rows, tokens, positions, slots, context, block_ids, block_starts, w1, l1,
             threads);
    compare(name, l0, l1, (int64_t)rows * t.m.vocab, 1e-4f);
    free(l0); free(l1); free(w0); free(w1); free(cache); free(copy);
}

/* Decode steps of every weight kind over float32 and float16 caches (head size 32), and of q4
 * weights over every cache type at head sizes 64 and 128 (the attention's fixed-size
 * kernels). */
static void check_decode(kernels a, kernels b) {
    const char *names[] = {"f32", "q4", "q8"};
    const char *kv_names[] = {"f32", "f16", "bf16", "e4m3", "e5m2"};
    char name[80];
    for (int kind = BI_F32; kind <= BI_Q8; kind++)
        for (int kv_type = BI_KV_F32; kv_type <= BI_KV_F16; kv_type++)
            for (int threads = 1; threads <= 3; threads += 2) {
                snprintf(name, sizeof name, "decode %s weights, %s cache, threads=%d",
                         names[kind], kv_names[kv_type], threads);
                decode_case(a, b, kind, kv_type, 32, threads, name);
            }
    for (int head_dim = 64; head_dim <= 128; head_dim *= 2)
        for (int kv_type = BI_KV_F32; kv_type <= BI_KV_E5M2; kv_type++) {
            snprintf(name, sizeof name, "decode head=%d q4 weights, %s cache, threads=2",
                     head_dim, kv_names[kv_type]);
            decode_case(a, b, BI_Q4, kv_type, head_dim, 2, name);
        }
}

/* Decode steps of 10 sequences (8+: their layers' products take 8-bit inputs where the level
 * has them and `bi_model.act8` asks): with act8 on, against the portable level's 16-bit step
 * to within the 8-bit rounding's error, and (a level with 8-bit products) apart from its own
 * 16-bit step, which must match the portable one as ever. */
static void check_decode8(kernels a, kernels b) {
    const int kinds[] = {BI_Q4, BI_Q8};
    const char *names[] = {"q4", "q8"};
    enum { ROWS = 10 };
    const int64_t tokens[ROWS] = {3, 41, 77, 5, 9, 60, 12, 33, 70, 1};
    const int64_t context[ROWS] = {5, 17, 40, 1, 16, 33, 9, 48, 2, 31};
    int64_t positions[ROWS], slots[ROWS], block_starts[ROWS], block_ids[64];
    int blocks = 0;
    for (int r = 0; r < ROWS; r++) {
        block_starts[r] = blocks;
        for (int64_t t = 0; t < context[r]; t += 16) block_ids[blocks] = blocks, blocks++;
        positions[r] = context[r] - 1;
        slots[r] = block_ids[block_starts[r] + positions[r] / 16] * 16 + positions[r] % 16;
    }
    for (int ki = 0; ki < 2; ki++)
        for (int threads = 1; threads <= 2; threads++) {
            tiny_model t = tiny(kinds[ki], BI_KV_F16, 32, blocks, b);
            t.m.layers = t.layers;
            float *logits[3];
            for (int run = 0; run < 3; run++) {  /* level 8-bit, level 16-bit, portable */
                kernels k = run == 2 ? b : a;
                void *cache = malloc((size_t)t.cache_bytes);
                memcpy(cache, t.m.kv_cache, (size_t)t.cache_bytes);
                float *work = malloc(sizeof(float) * k.work(&t.m, ROWS, threads));
                logits[run] = malloc(sizeof(float) * ROWS * t.m.vocab);
                bi_model m = t.m;
                m.kv_cache = cache;
                m.act8 = run == 0;
                k.decode(&m, ROWS, tokens, positions, slots, context, block_ids, block_starts,
                         work, logits[run], threads);
                free(cache); free(work);
            }
            char name[80];
            const int64_t n = (int64_t)ROWS * t.m.vocab;
            snprintf(name, sizeof name, "decode8 %s weights, threads=%d", names[ki], threads);
            float diff = 0.f, top = 0.f;
            for (int64_t i = 0; i < n; i++) {
                diff = fmaxf(diff, fabsf(logits[0][i] - logits[1][i]));
                top = fmaxf(top, fabsf(logits[1][i]));
            }
            printf("# %s: 8-bit against 16-bit %g of %g\n", name, diff, top);
            compare(name, logits[0], logits[2], n, a.act8() ? 2e-2f : 1e-4f);
            snprintf(name, sizeof name, "decode16 %s weights, threads=%d", names[ki], threads);
            compare(name, logits[1], logits[2], n, 1e-4f);
            if (a.act8() && diff < 1e-4f * top) {
                printf("FAIL decode8 %s weights, threads=%d: 8-bit inputs did not reach the "
                       "layers\n", names[ki], threads);
                failures++;
            }
            for (int run = 0; run < 3; run++) free(logits[run]);
        }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s LEVEL.so PORTABLE.so\n", argv[0]);
        return 2;
    }
    const kernels level = open_kernels(argv[1]), portable = open_kernels(argv[2]);
    printf("levels %s %s\n", level.isa(), portable.isa());
    printf("act8 %d\n", level.act8());
    check_linears(level, portable);
    check_linears8(level);
    check_elementwise(level, portable);
    check_packed_attention(level, portable);
    check_decode(level, portable);
    check_decode8(level, portable);
    return failures ? 1 : 0;
}
