/* Decode attention over the paged KV cache, read in place, and prompt-chunk attention by AMX tiles
 * (see engine/kv_native.py). On a CPU with AMX, bf16 history goes through the tiles
 * (attention_amx.h: decodes, quantised blocks dequantised to bf16 rows first, and prompt chunks);
 * elsewhere the AVX-512 tiles or the compiler's loops described here.
 *
 * Each decoding sequence has one new query token; its history is a list of cache slots (paged:
 * not contiguous). Torch's path gathers every sequence's keys and values into a padded copy
 * before its batched products, so the history crosses memory three times (read, write, read);
 * here each key and value row is read once, where it lies.
 *
 * Layout: keys and values of one layer are [slots][kv_heads][dim]; queries [seqs][heads][dim],
 * head kv * groups + g attending with KV head kv (grouped-query attention, as the model's
 * repeat_kv arranges them); out like the queries. bfloat16 or float32, arithmetic in float32:
 * scores, a softmax with its maximum subtracted (two passes over the scores, as torch's), the
 * weighted sum of values (bf16 values on the AVX-512 BF16 and AMX builds: weighed by the
 * probabilities rounded to bf16, as torch's path casts its softmax to the values' dtype first);
 * bfloat16 results are rounded to nearest even.
 *
 * Threads: the (sequence, KV head) pairs are shared by OpenMP: the pairs of sequences that share
 * a history (a decode and its draft tokens) to one thread, so that one core reads that history,
 * and these groups dealt to the threads in turn, so that each thread knows the pair it takes
 * next and asks for its rows (into the second-level cache) while it works on this one. A
 * history's blocks lie scattered over the pool, where the hardware's prefetcher does not follow
 * them: without that, a decode waits on memory for most of its time. The library is linked
 * against libgomp.so.1, which the process has already loaded with torch, so these are torch's
 * own OpenMP workers, not a second pool fighting them for the cores. Vectorised by the compiler
 * (omp simd) for the -march the library is built for.
 */
#define _DEFAULT_SOURCE /* syscall(), for the AMX permission */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kv_bf16.h"
#include "kv_codes.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define TILE 64 /* keys whose values are weighed together (converted to float32 once) */

typedef struct {
    const void *query, *keys, *values; /* [seqs][kv_heads * groups][dim], [slots][kv_heads][dim] x 2 */
    int64_t kv_heads, groups, dim;
    float scale;
    int fp32; /* 1: float32 tensors, 0: bfloat16 */
    int tiles; /* 1: bfloat16 full-precision history through the AMX tiles (see amx_scores) */
    void *out;
} attention;

/* A layer of the quantised store, and which of its blocks each sequence's history holds (see
 * kv_native.c for the format: rows are (block, KV head); value = centred code * scale + offset,
 * keys' (scale, offset) per channel of a row, values' per token). */
typedef struct {
    const void *key_codes, *key_scale, *key_offset; /* [blocks][key_stride], [rows][dim] x 2 */
    const void *value_codes, *value_scale, *value_offset; /* [blocks][value_stride], [rows][block] x 2 */
    int64_t kv_heads; /* rows are (block, KV head); a block's codes are each head's [block][width] in turn */
    /* per KV head: its codes' bits (8: int8, centred; 6: kv_codes.h, centre 32; 4: two to a byte,
     * centre 8) and first byte within a block; bytes of a block's codes */
    const int64_t *key_bits, *key_starts;
    int64_t key_stride;
    const int64_t *value_bits, *value_starts;
    int64_t value_stride;
    int64_t block, num_blocks;   /* tokens a block, blocks in the store */
    const int64_t *blocks;       /* sequence i's blocks (in order): blocks[starts[i] .. starts[i + 1]) */
    const int64_t *starts;
} cold_layer;

/* Row r's key (values = 0) or value codes, token 0, and their bits. */
static inline const uint8_t *cold_codes(const cold_layer *c, int values, int64_t r, int64_t *bits) {
    int64_t head = r % c->kv_heads, block = r / c->kv_heads;
    *bits = (values ? c->value_bits : c->key_bits)[head];
    return (const uint8_t *)(values ? c->value_codes : c->key_codes) + block * (values ? c->value_stride : c->key_stride) +
           (values ? c->value_starts : c->key_starts)[head];
}

/* Token t of row r of a quantised layer's key (values = 0) or value codes, centred, as float32. */
static inline void codes_f32(const cold_layer *c, int values, int64_t r, int64_t t, int64_t dim, float *out) {
    int64_t bits;
    const uint8_t *codes = cold_codes(c, values, r, &bits);
    if (bits == 8) {
        const int8_t *p = (const int8_t *)codes + t * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++)
            out[d] = (float)p[d];
        return;
    }
    if (bits == 6) {
        const uint8_t *p = codes + t * (dim * 3 / 4);
        for (int64_t d = 0; d < dim; d++)
            out[d] = (float)(kv_code6(p, dim, d) - 32);
        return;
    }
    int64_t half = dim / 2;
    const uint8_t *p = codes + t * half;
#pragma omp simd
    for (int64_t d = 0; d < half; d++) {
        out[d] = (float)((int)(p[d] & 0x0F) - 8);
        out[d + half] = (float)((int)(p[d] >> 4) - 8);
    }
}

/* Whether a quantised layer's heads lie in its blocks as this file reads them (see cold_layer). */
static int cold_ok(const cold_layer *c, int64_t kv_heads, int64_t dim) {
    return c->kv_heads == kv_heads &&
           kv_parts_ok(kv_heads, c->key_bits, c->key_starts, c->key_stride, c->block, dim) &&
           kv_parts_ok(kv_heads, c->value_bits, c->value_starts, c->value_stride, c->block, dim);
}

static inline float param(const void *base, int64_t i, int fp32) {
    return fp32 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
}

/* Row `row` of `dim` channels of a tensor as float32: the tensor's own memory when it is float32,
 * else converted into `buffer`. A cache row of (slot, KV head) is row slot * kv_heads + kv. */
static inline const float *row_f32(const attention *a, const void *base, int64_t row, float *buffer) {
    if (a->fp32)
        return (const float *)base + row * a->dim;
    const uint16_t *p = (const uint16_t *)base + row * a->dim;
#pragma omp simd
    for (int64_t d = 0; d < a->dim; d++)
        buffer[d] = bf16_to_f32(p[d]);
    return buffer;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ATT_AVX512 1

/* Lane i of the result: the sum of the 16 lanes of v[i] (a transpose folded into the additions). */
static inline __m512 sum_lanes16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: (p0+p2, q0+q2, p1+p3, q1+q3) */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the lane's sums of four vectors, in order */
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes 0+1 and 2+3 of b[2i], then of b[2i+1] */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* out[j] = (sum of the lanes of part[j]) * scale + bias for j < m <= 16. */
static inline void store16(const __m512 part[16], int64_t m, float scale, float bias, float *out) {
    __m512 sums = _mm512_fmadd_ps(sum_lanes16(part), _mm512_set1_ps(scale), _mm512_set1_ps(bias));
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << m) - 1u), sums);
}

/* out[j] = (q . rows[j]) * scale + bias for j < m <= 16: float32 rows, dim a multiple of 16. */
static inline void scores16_f32(const float *q, const float *const *rows, int64_t m, int64_t dim, float scale,
                                float bias, float *out) {
    __m512 part[16];
    for (int64_t j = 0; j < 16; j++) {
        __m512 s = _mm512_setzero_ps();
        for (int64_t d = 0; j < m && d < dim; d += 16)
            s = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(rows[j] + d), s);
        part[j] = s;
    }
    store16(part, m, scale, bias, out);
}

/* acc[0..dim) += sum over j < m of p[j] * rows[j][0..dim): dim a multiple of 64. */
static inline void weigh(const float *const *rows, const float *p, int64_t m, int64_t dim, float *acc) {
    for (int64_t c = 0; c < dim; c += 64) {
        __m512 x0 = _mm512_loadu_ps(acc + c), x1 = _mm512_loadu_ps(acc + c + 16);
        __m512 x2 = _mm512_loadu_ps(acc + c + 32), x3 = _mm512_loadu_ps(acc + c + 48);
        for (int64_t j = 0; j < m; j++) {
            __m512 w = _mm512_set1_ps(p[j]);
            const float *r = rows[j] + c;
            x0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(r), x0);
            x1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(r + 16), x1);
            x2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(r + 32), x2);
            x3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(r + 48), x3);
        }
        _mm512_storeu_ps(acc + c, x0);
        _mm512_storeu_ps(acc + c + 16, x1);
        _mm512_storeu_ps(acc + c + 32, x2);
        _mm512_storeu_ps(acc + c + 48, x3);
    }
}

#else
#define ATT_AVX512 0
#endif

static inline void prefetch_rows(const attention *a, const void *base, const int64_t *slots, int64_t m,
                                 int64_t kv);

#include "attention_chunk.h"   /* prompt chunks: their layout, history rows and AVX-512 BF16 blocks */
#include "attention_vectors.h" /* decodes by AVX-512 BF16: tiles of keys and of values */
#include "attention_amx.h"     /* the AMX tiles: defines ATT_AMX */

/* out[j] = (q . rows[j]) * scale + bias for j < m <= 16: float32 rows, any dim. */
static void score_rows(const float *q, const float *const *rows, int64_t m, int64_t dim, float scale, float bias,
                       float *out) {
#if ATT_AVX512
    if (dim % 16 == 0) {
        scores16_f32(q, rows, m, dim, scale, bias, out);
        return;
    }
#endif
    for (int64_t j = 0; j < m; j++) {
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < dim; d++)
            s += q[d] * rows[j][d];
        out[j] = s * scale + bias;
    }
}

/* acc[0..dim) += sum over j < m of p[j] * rows[j][0..dim): float32 rows, any dim. */
static void weigh_rows(const float *const *rows, const float *p, int64_t m, int64_t dim, float *acc) {
#if ATT_AVX512
    if (dim % 64 == 0) {
        weigh(rows, p, m, dim, acc);
        return;
    }
#endif
    for (int64_t j = 0; j < m; j++)
#pragma omp simd
        for (int64_t d = 0; d < dim; d++)
            acc[d] += p[j] * rows[j][d];
}

/* Softmax of a row of scores in place: its maximum subtracted, float32. */
static void softmax(float *s, int64_t n) {
    float top = s[0], total = 0.0f;
#pragma omp simd reduction(max : top)
    for (int64_t t = 1; t < n; t++)
        top = s[t] > top ? s[t] : top;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - top);
        total += s[t];
    }
    float inverse = 1.0f / total;
#pragma omp simd
    for (int64_t t = 0; t < n; t++)
        s[t] *= inverse;
}

/* Asks for the cache rows of the next tile's keys or values (the history is paged, so the
 * hardware prefetcher loses the thread at every block): into every level, or with `l2` into the
 * second-level cache only (rows wanted after the next few thousand cycles). */
static inline void fetch_rows(const attention *a, const void *base, const int64_t *slots, int64_t m, int64_t kv,
                              int l2) {
    int64_t size = a->fp32 ? 4 : 2, bytes = a->dim * size;
    for (int64_t j = 0; j < m; j++) {
        const char *row = (const char *)base + (slots[j] * a->kv_heads + kv) * bytes;
        for (int64_t b = 0; b < bytes; b += 64) {
            if (l2)
                __builtin_prefetch(row + b, 0, 2);
            else
                __builtin_prefetch(row + b);
        }
    }
}

static inline void prefetch_rows(const attention *a, const void *base, const int64_t *slots, int64_t m, int64_t kv) {
    fetch_rows(a, base, slots, m, kv, 0);
}

/* Floats of work space one pair needs, for histories of up to `longest` tokens. */
static int64_t work_floats(int64_t groups, int64_t dim, int64_t longest, int64_t block) {
    int64_t rows = block > TILE ? block : TILE;
    return groups * longest + groups * dim + 4 * dim + rows * dim + TILE + groups + 2 * rows
           + TILE * dim / 2 + groups * TILE / 2 + groups * dim; /* weigh_tile_bf16's pairs, weights, sums */
}

/* The pair's quantised blocks: scores into scores[g][0 .. m * block) (row stride n), read where
 * they lie. Keys' scale and offset are per channel of a block, so a block's scores are
 * (q * scale) . codes + q . offset: the codes converted once, never dequantised. */
static void cold_scores(const attention *a, const cold_layer *c, const int64_t *blocks, int64_t m, int64_t kv,
                        int64_t first, int64_t n, float *scores, float *q, float *qs, float *params, float *tile) {
    int64_t groups = a->groups, dim = a->dim;
    const float *rows[16];
    for (int64_t b = 0; b < m; b++) {
        int64_t r = blocks[b] * a->kv_heads + kv; /* the key scales and offsets are [rows][dim] */
        const float *scale = row_f32(a, c->key_scale, r, params), *offset = row_f32(a, c->key_offset, r, params + dim);
        for (int64_t t = 0; t < c->block; t++)
            codes_f32(c, 0, r, t, dim, tile + t * dim);
        for (int64_t g = 0; g < groups; g++) {
            const float *qg = row_f32(a, a->query, first + g, q);
            float bias = 0.0f;
#pragma omp simd reduction(+ : bias)
            for (int64_t d = 0; d < dim; d++) {
                qs[d] = qg[d] * scale[d];
                bias += qg[d] * offset[d];
            }
            for (int64_t t = 0; t < c->block; t += 16) {
                int64_t k = c->block - t < 16 ? c->block - t : 16;
                for (int64_t j = 0; j < k; j++)
                    rows[j] = tile + (t + j) * dim;
                score_rows(qs, rows, k, dim, a->scale, bias * a->scale, scores + g * n + b * c->block + t);
            }
        }
    }
}

/* The pair's quantised blocks weighed into acc[g] by probs[g][0 .. m * block) (row stride n).
 * Values' scale and offset are per token: the weight of a token's codes is p * scale, and its
 * offset adds p * offset to every channel (summed into offsets[g]). */
static void cold_values(const attention *a, const cold_layer *c, const int64_t *blocks, int64_t m, int64_t kv,
                        int64_t n, const float *probs, float *acc, float *offsets, float *params, float *tile,
                        float *w) {
    int64_t groups = a->groups, dim = a->dim;
    const float *rows[TILE];
    float *scale = params, *offset = params + c->block; /* of the block's tokens, as float32 */
    for (int64_t b = 0; b < m; b++) {
        int64_t r = blocks[b] * a->kv_heads + kv;
        for (int64_t t = 0; t < c->block; t++) {
            codes_f32(c, 1, r, t, dim, tile + t * dim);
            scale[t] = param(c->value_scale, r * c->block + t, a->fp32);
            offset[t] = param(c->value_offset, r * c->block + t, a->fp32);
        }
        for (int64_t t = 0; t < c->block; t += TILE) {
            int64_t k = c->block - t < TILE ? c->block - t : TILE;
            for (int64_t j = 0; j < k; j++)
                rows[j] = tile + (t + j) * dim;
            for (int64_t g = 0; g < groups; g++) {
                const float *p = probs + g * n + b * c->block + t;
                float added = 0.0f;
#pragma omp simd reduction(+ : added)
                for (int64_t j = 0; j < k; j++) {
                    w[j] = p[j] * scale[t + j];
                    added += p[j] * offset[t + j];
                }
                offsets[g] += added;
                weigh_rows(rows, w, k, dim, acc + g * dim);
            }
        }
    }
}


/* One (sequence, KV head) pair: its `groups` query heads over its history, the `m` quantised
 * blocks at `blocks` (none without `c`) and then the `hot` full-precision tokens at `slots`.
 * bf16 history on the AVX-512 BF16 build without tiles is scored and weighed as bf16 rows by
 * score_tile_bf16 and weigh_tile_bf16, quantised blocks dequantised to bf16 rows first (as
 * torch's path reads them); elsewhere as float32 rows (quantised ones by cold_scores and
 * cold_values, in their own format). */
static void attend_pair(const attention *a, const cold_layer *c, int64_t seq, int64_t kv, const int64_t *blocks,
                        int64_t m, const int64_t *slots, int64_t hot, const int64_t *next, int64_t next_hot,
                        int64_t next_kv, float *work, uint8_t *space) {
    int64_t groups = a->groups, dim = a->dim, first = seq * a->kv_heads * groups + kv * groups;
    int64_t cold = c != NULL ? m * c->block : 0, n = cold + hot;
    int64_t block = c != NULL && c->block > TILE ? c->block : TILE;
    float *scores = work;               /* [groups][n]: quantised history first */
    float *acc = scores + groups * n;   /* [groups][dim] */
    float *q = acc + groups * dim;      /* [dim]: a query head as float32 */
    float *qs = q + dim;                /* [dim]: the same times a quantised block's key scales */
    float *tile = qs + dim;             /* [block][dim]: rows as float32 */
    float *w = tile + block * dim;      /* [TILE]: weights of quantised values */
    float *offsets = w + TILE;          /* [groups]: what values' offsets add to every channel */
    float *params = offsets + groups;   /* [max(2 * dim, 2 * block)]: a block's scales and offsets */
    uint16_t *pairs = (uint16_t *)(params + 2 * dim + 2 * block); /* [TILE / 2][dim][2]: weigh_tile_bf16 */
    uint32_t *weights = (uint32_t *)(pairs + TILE * dim);  /* [groups][TILE / 2] */
    float *mixed = (float *)(weights + groups * TILE / 2); /* [groups][dim]: its sums, interleaved */
    int tiles = space != NULL && !a->fp32 && dim % 64 == 0 && groups <= 16; /* bf16 keys and values by AMX */
    int vectors = ATT_AVX512 && !tiles && !a->fp32 && dim % 32 == 0; /* bf16 by AVX-512 BF16's dpbf16 */
    const float *rows[TILE];
    const uint16_t *lines[TILE];      /* with vectors: bf16 rows where they lie, or dequantised */
    uint16_t *dequantised_rows = (uint16_t *)tile; /* with vectors: 16 tokens of a quantised block */
#if !ATT_AVX512
    (void)lines, (void)dequantised_rows, (void)mixed; /* vectors is 0 */
#endif
    if (cold && !tiles && !vectors)
        cold_scores(a, c, blocks, m, kv, first, n, scores, q, qs, params, tile);
#if ATT_AVX512
    for (int64_t b = 0; cold && vectors && b < m; b++) /* quantised blocks as bf16 rows, 16 tokens at a time */
        for (int64_t t = 0; t < c->block; t += 16) {
            int64_t k = c->block - t < 16 ? c->block - t : 16;
            cold_rows_bf16(c, blocks[b] * a->kv_heads + kv, t, k, dim, 0, dequantised_rows);
            for (int64_t j = 0; j < k; j++)
                lines[j] = dequantised_rows + j * dim;
            score_tile_bf16(a, first, lines, k, groups, n, scores + b * c->block + t, (__m512i *)pairs);
        }
#endif
#if ATT_AMX
    attention dequantised = *a; /* with tiles, the quantised blocks as bf16 rows past the tiles' space */
    int64_t *order = NULL;
    if (cold && tiles) {
        dequantised = amx_cold_rows(a, c, blocks, m, kv, (uint16_t *)(space + tile_bytes(dim)), &order);
        amx_scores(&dequantised, first, 0, order, cold, n, scores, space);
    }
    if (tiles)
        amx_scores(a, first, kv, slots, hot, n, scores + cold, space);
#endif
    /* Keys: the first two tiles now, later ones two tiles ahead; and with each tile a share of the
     * next pair's keys (`next`, `next_hot` tokens of KV head `next_kv`), into the second level. */
    if (!tiles)
        prefetch_rows(a, a->keys, slots, hot < 32 ? hot : 32, kv);
    int64_t share = (next_hot + (hot + 15) / 16 - 1) / ((hot + 15) / 16);
    for (int64_t t = 0; !tiles && t < hot; t += 16) { /* a tile of keys at a time, every query head: read once */
        int64_t k = hot - t < 16 ? hot - t : 16, ahead = t / 16 * share;
        if (t + 32 < hot)
            prefetch_rows(a, a->keys, slots + t + 32, hot - t - 32 < 16 ? hot - t - 32 : 16, kv);
        if (ahead < next_hot)
            fetch_rows(a, a->keys, next + ahead, next_hot - ahead < share ? next_hot - ahead : share, next_kv, 1);
#if ATT_AVX512
        if (vectors) {
            for (int64_t j = 0; j < k; j++)
                lines[j] = (const uint16_t *)a->keys + (slots[t + j] * a->kv_heads + kv) * dim;
            score_tile_bf16(a, first, lines, k, groups, n, scores + cold + t, (__m512i *)pairs);
            continue;
        }
#endif
        for (int64_t j = 0; j < k; j++)
            rows[j] = row_f32(a, a->keys, slots[t + j] * a->kv_heads + kv, tile + j * dim);
        for (int64_t g = 0; g < groups; g++) {
            float *out = scores + g * n + cold + t;
            score_rows(row_f32(a, a->query, first + g, q), rows, k, dim, a->scale, 0.0f, out);
        }
    }
    for (int64_t g = 0; g < groups; g++)
        softmax(scores + g * n, n);
    memset(acc, 0, (size_t)(groups * dim) * sizeof(float));
    memset(offsets, 0, (size_t)groups * sizeof(float));
    if (cold && !tiles && !vectors)
        cold_values(a, c, blocks, m, kv, n, scores, acc, offsets, params, tile, w);
#if ATT_AVX512
    if (vectors)
        memset(mixed, 0, (size_t)(groups * dim) * sizeof(float));
    for (int64_t b = 0; cold && vectors && b < m; b++)
        for (int64_t t = 0; t < c->block; t += 16) {
            int64_t k = c->block - t < 16 ? c->block - t : 16;
            cold_rows_bf16(c, blocks[b] * a->kv_heads + kv, t, k, dim, 1, dequantised_rows);
            for (int64_t j = 0; j < k; j++)
                lines[j] = dequantised_rows + j * dim;
            weigh_tile_bf16(a, lines, k, scores + b * c->block + t, n, groups, pairs, weights, mixed);
        }
#endif
#if ATT_AMX
    if (cold && tiles)
        amx_values(&dequantised, 0, order, cold, n, scores, acc, space);
    if (tiles)
        amx_values(a, kv, slots, hot, n, scores + cold, acc, space);
#endif
    share = (next_hot + (hot + TILE - 1) / TILE - 1) / ((hot + TILE - 1) / TILE); /* values likewise */
    if (!tiles)
        prefetch_rows(a, a->values, slots, hot < TILE ? hot : TILE, kv);
    for (int64_t t = 0; !tiles && t < hot; t += TILE) {
        int64_t k = hot - t < TILE ? hot - t : TILE, ahead = t / TILE * share;
        if (t + TILE < hot)
            prefetch_rows(a, a->values, slots + t + TILE, hot - t - TILE < TILE ? hot - t - TILE : TILE, kv);
        if (ahead < next_hot)
            fetch_rows(a, a->values, next + ahead, next_hot - ahead < share ? next_hot - ahead : share, next_kv, 1);
#if ATT_AVX512
        if (vectors) {
            for (int64_t j = 0; j < k; j++)
                lines[j] = (const uint16_t *)a->values + (slots[t + j] * a->kv_heads + kv) * dim;
            weigh_tile_bf16(a, lines, k, scores + cold + t, n, groups, pairs, weights, mixed);
            continue;
        }
#endif
        for (int64_t j = 0; j < k; j++)
            rows[j] = row_f32(a, a->values, slots[t + j] * a->kv_heads + kv, tile + j * dim);
        for (int64_t g = 0; g < groups; g++)
            weigh_rows(rows, scores + g * n + cold + t, k, dim, acc + g * dim);
    }
#if ATT_AVX512
    if (vectors)
        unmix(mixed, groups, dim, acc);
#endif
    for (int64_t g = 0; g < groups; g++) {
        int64_t at = (first + g) * dim;
        const float *ag = acc + g * dim;
        if (a->fp32)
            for (int64_t d = 0; d < dim; d++)
                ((float *)a->out)[at + d] = ag[d] + offsets[g];
        else
            for (int64_t d = 0; d < dim; d++)
                ((uint16_t *)a->out)[at + d] = f32_to_bf16(ag[d] + offsets[g]);
    }
}

/* 1 when this build computes bf16 attention with AMX tiles and Linux grants this process their
 * state; then kv_decode_attention takes `tiles`. */
int kv_attention_tiles(void) {
#if ATT_AMX
    return tiles_permitted();
#else
    return 0;
#endif
}

/* The instruction set the scores and sums are computed with: "avx512-bf16" (the tiles above), else
 * the portable loops as the compiler vectorised them for the build's target: "avx2" or "generic". */
const char *kv_attention_isa(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return ATT_AVX512 ? "avx512-bf16" : "avx2";
#else
    return ATT_AVX512 ? "avx512-bf16" : "generic";
#endif
}

/* out (seqs, kv_heads * groups, dim) = attention of each sequence's query (same shape) to its
 * cached tokens: with `cold` (else NULL), its quantised blocks first, then its full-precision tokens,
 * those of sequence i at slots[starts[i] .. starts[i + 1]), in order, of the layer's keys and values
 * (num_slots, kv_heads, dim). Returns 0; -1 when a slot or block is out of range, a sequence has
 * no full-precision token or the format is unknown (nothing written), or memory for the scores is
 * not to be had. */
int kv_decode_attention(const void *query, const void *keys, const void *values, const int64_t *slots,
                        const int64_t *starts, int64_t seqs, int64_t kv_heads, int64_t groups, int64_t dim,
                        int64_t num_slots, float scale, int fp32, int tiles, const cold_layer *cold, void *out) {
    int64_t longest = 0;
    if (cold != NULL && !cold_ok(cold, kv_heads, dim))
        return -1;
    for (int64_t i = 0; i < seqs; i++) {
        int64_t n = starts[i + 1] - starts[i];
        if (n <= 0)
            return -1;
        if (cold != NULL) {
            int64_t m = cold->starts[i + 1] - cold->starts[i];
            if (m < 0)
                return -1;
            n += m * cold->block;
        }
        longest = n > longest ? n : longest;
    }
    for (int64_t j = 0; j < starts[seqs]; j++)
        if (slots[j] < 0 || slots[j] >= num_slots)
            return -1;
    if (cold != NULL)
        for (int64_t j = 0; j < cold->starts[seqs]; j++)
            if (cold->blocks[j] < 0 || cold->blocks[j] >= cold->num_blocks)
                return -1;
    tiles = ATT_AMX && tiles && !fp32 && dim % 64 == 0 && groups <= 16;
    attention a = {query, keys, values, kv_heads, groups, dim, scale, fp32, tiles, out};
    /* Groups of consecutive sequences that share a history (a decode and its draft tokens: the
     * same first slot), sequences firsts[u] .. firsts[u + 1]: one thread reads a history once. */
    int64_t *firsts = malloc((size_t)(seqs + 1) * sizeof(int64_t)), units = 0;
    if (firsts == NULL)
        return -1;
    for (int64_t i = 0; i < seqs; i++)
        if (i == 0 || slots[starts[i]] != slots[starts[i - 1]])
            firsts[units++] = i;
    firsts[units] = seqs;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *work = malloc((size_t)work_floats(groups, dim, longest, cold ? cold->block : 0) * sizeof(float));
        uint8_t *space = NULL;
#if ATT_AMX
        if (tiles) {
            int64_t cold_tokens = 0; /* the most quantised tokens of any sequence */
            for (int64_t i = 0; cold != NULL && i < seqs; i++) {
                int64_t count = (cold->starts[i + 1] - cold->starts[i]) * cold->block;
                cold_tokens = count > cold_tokens ? count : cold_tokens;
            }
            int64_t bytes = tile_bytes(dim) + (cold != NULL ? cold_row_bytes(cold_tokens, dim) : 0);
            space = aligned_alloc(64, (size_t)(bytes + 63) / 64 * 64);
            tiles_begin();
        }
#endif
        failed = work == NULL || (tiles && space == NULL);
        int64_t threads = 1;
#ifdef _OPENMP
        threads = omp_get_num_threads();
#endif
#pragma omp for schedule(static, 1) /* groups dealt in turn, each whole to one thread */
        for (int64_t u = 0; u < units; u++) {
            for (int64_t pair = firsts[u] * kv_heads; pair < firsts[u + 1] * kv_heads && !failed; pair++) {
                int64_t seq = pair / kv_heads, after = pair + 1; /* this thread's next pair */
                if (after == firsts[u + 1] * kv_heads)
                    after = u + threads < units ? firsts[u + threads] * kv_heads : -1;
                int64_t next_seq = after / kv_heads;
                int64_t next_hot = after >= 0 ? starts[next_seq + 1] - starts[next_seq] : 0;
                attend_pair(&a, cold, seq, pair % kv_heads, cold ? cold->blocks + cold->starts[seq] : NULL,
                            cold ? cold->starts[seq + 1] - cold->starts[seq] : 0, slots + starts[seq],
                            starts[seq + 1] - starts[seq], next_hot ? slots + starts[next_seq] : NULL, next_hot,
                            after >= 0 ? after % kv_heads : 0, work, space);
            }
        }
#if ATT_AMX
        if (tiles)
            _tile_release();
#endif
        free(space);
        free(work);
    }
    free(firsts);
    return failed ? -1 : 0;
}


/* out (q_len, kv_heads * groups, dim) = attention of a prompt chunk's q_len bf16 queries (query
 * head h's token i at query + h * head_stride + i * token_stride elements) to its sequence's
 * history: with `cold` (else NULL), the quantised blocks blocks[starts[0] .. starts[1]) first,
 * then the `hot` tokens at slots[0 .. hot) of the layer's keys and values (num_slots, kv_heads,
 * dim), the chunk's own tokens last. Of the kv_len tokens in all, chunk token i sits at position
 * kv_len - q_len + i and sees the keys up to it (bottom-right causal). Keys and values are
 * gathered once per call (quantised ones dequantised to bf16, as torch's path reads them; values
 * transposed), then blocks of 16 queries of one head are shared by the threads: by AMX tiles with
 * `tiles` (the AMX build), else by AVX-512 BF16 (attention_chunk.h). Needs the AVX-512 BF16 build,
 * dim a multiple of 64, at most 16 query heads a KV head and 1 <= q_len <= kv_len; returns 0, or
 * -1 (nothing written) when those do not hold, a slot or block is out of range, the format is
 * unknown or memory is not to be had. */
int kv_prefill_attention(const void *query, int64_t head_stride, int64_t token_stride, const void *keys,
                         const void *values, const int64_t *slots, int64_t hot, int64_t q_len, int64_t kv_heads,
                         int64_t groups, int64_t dim, int64_t num_slots, float scale, int tiles,
                         const cold_layer *cold, void *out) {
#if ATT_AVX512
    int64_t cold_len = cold != NULL ? (cold->starts[1] - cold->starts[0]) * cold->block : 0, kv_len = cold_len + hot;
    if (dim % 64 || groups > 16 || q_len < 1 || q_len > kv_len || cold_len < 0 || (tiles && !ATT_AMX))
        return -1;
    if (cold != NULL && !cold_ok(cold, kv_heads, dim))
        return -1;
    for (int64_t j = 0; j < hot; j++)
        if (slots[j] < 0 || slots[j] >= num_slots)
            return -1;
    for (int64_t b = 0; cold != NULL && b < cold->starts[1] - cold->starts[0]; b++)
        if (cold->blocks[cold->starts[0] + b] < 0 || cold->blocks[cold->starts[0] + b] >= cold->num_blocks)
            return -1;
    int64_t kv_pad = (kv_len + 31) / 32 * 32;
    /* keys [kv_heads][kv_pad][dim], values [kv_heads][dim][kv_pad], and a value row per KV head */
    uint16_t *gathered = aligned_alloc(64, (size_t)((2 * kv_pad + 1) * kv_heads * dim) * 2);
    int64_t block = cold != NULL ? cold->block : 1; /* a quantised block's values, per KV head: */
    uint16_t *block_values = malloc((size_t)(kv_heads * block * dim) * 2);
    if (gathered == NULL || block_values == NULL) {
        free(gathered);
        free(block_values);
        return -1;
    }
    uint16_t *k = gathered, *vt = gathered + kv_heads * kv_pad * dim;
    attention a = {query, keys, values, kv_heads, groups, dim, scale, 0, tiles, out};
#pragma omp parallel for schedule(static)
    for (int64_t h = 0; h < kv_heads; h++) {
        uint16_t *row = vt + kv_heads * dim * kv_pad + h * dim;
        int64_t lead = hot < 16 ? hot : 16;
        prefetch_rows(&a, a.keys, slots, lead, h);
        prefetch_rows(&a, a.values, slots, lead, h);
        for (int64_t j = 0; j < kv_pad; j++) {
            uint16_t *key = k + (h * kv_pad + j) * dim;
            if (j >= kv_len) {
                memset(key, 0, (size_t)dim * 2);
                for (int64_t d = 0; d < dim; d++)
                    vt[(h * dim + d) * kv_pad + j] = 0;
                continue;
            }
            if (j + 16 >= cold_len && j + 16 < kv_len) { /* the rows 16 tokens on: scattered blocks */
                prefetch_rows(&a, a.keys, slots + (j + 16 - cold_len), 1, h);
                prefetch_rows(&a, a.values, slots + (j + 16 - cold_len), 1, h);
            }
            const uint16_t *value = row;
            if (j < cold_len) { /* quantised: a block at a time, its keys straight into their rows */
                uint16_t *values_h = block_values + h * block * dim;
                if (j % block == 0) {
                    int64_t r = cold->blocks[cold->starts[0] + j / block] * kv_heads + h;
                    cold_rows_bf16(cold, r, 0, block, dim, 0, key);
                    cold_rows_bf16(cold, r, 0, block, dim, 1, values_h);
                }
                value = values_h + j % block * dim;
            } else {
                history_row(&a, cold, cold_len, slots, h, j, NULL, key, row);
            }
            for (int64_t d = 0; d < dim; d++)
                vt[(h * dim + d) * kv_pad + j] = value[d];
        }
    }
    free(block_values);
    chunk c = {(const uint16_t *)query, head_stride, token_stride, k, vt, kv_len, kv_pad, q_len, kv_heads,
               groups, dim, scale, (uint16_t *)out};
    int64_t blocks = (q_len + 15) / 16, items = kv_heads * groups * blocks;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        uint8_t *space = aligned_alloc(64, (size_t)chunk_bytes(kv_pad, dim));
        failed = space == NULL;
#if ATT_AMX
        if (!failed && tiles)
            tiles_begin();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (failed)
                continue;
#if ATT_AMX
            if (tiles) {
                amx_chunk_block(&c, item / blocks, item % blocks * 16, space);
                continue;
            }
#endif
            vec_chunk_block(&c, item / blocks, item % blocks * 16, space);
        }
#if ATT_AMX
        if (space != NULL && tiles)
            _tile_release();
#endif
        free(space);
    }
    free(gathered);
    return failed ? -1 : 0;
#else
    (void)query, (void)head_stride, (void)token_stride, (void)keys, (void)values, (void)slots, (void)hot;
    (void)q_len, (void)kv_heads, (void)groups, (void)dim, (void)num_slots, (void)scale, (void)tiles, (void)cold;
    (void)out;
    return -1;
#endif
}
