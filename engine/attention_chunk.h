/* Prompt-chunk attention's shared part (included once by attention_native.c, after its shared types
 * and AVX-512 helpers, before attention_amx.h): a chunk's layout, its history gathered as bf16 rows,
 * and the block of 16 queries of one head computed by AVX-512 BF16 (`vec_chunk_block`), which
 * attention_amx.h's `amx_chunk_block` does by tiles. Both score the keys a block's queries may see
 * (bf16 pairs of products summed in float32), mask them causally, take a float32 softmax and weigh
 * the values with the probabilities rounded to bf16, as torch's flash attention does; only the
 * order of the float32 sums differs. Needs the AVX-512 BF16 build (ATT_AVX512). */
#ifndef ATTENTION_CHUNK_H
#define ATTENTION_CHUNK_H

#if ATT_AVX512
/* 32-bit lane i of the result: the bf16 pair (a_i, b_i), each rounded to nearest even. */
static inline __m512i bf16_pair(__m512 a, __m512 b) {
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* The bf16 pair at p (two adjacent channels or keys) in all 16 lanes. */
static inline __m512bh pair_everywhere(const uint16_t *p) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

typedef struct {
    const uint16_t *query; /* bf16, query head h's token i at h * head_stride + i * token_stride */
    int64_t head_stride, token_stride;
    const uint16_t *keys, *values_t; /* per KV head: [kv_pad][dim] and [dim][kv_pad], zero-padded */
    int64_t kv_len, kv_pad, q_len, kv_heads, groups, dim;
    float scale;
    uint16_t *out; /* [q_len][kv_heads * groups][dim] */
} chunk;

/* Work space (bytes) of one thread for a chunk (either block's). */
static int64_t chunk_bytes(int64_t kv_pad, int64_t dim) {
    return kv_pad * 16 * 4   /* scores, then probabilities, [keys][16 queries] */
           + dim * 16 * 2    /* the queries transposed, [dim / 32][16 pairs][16 queries x 2] */
           + 16 * 32 * 2     /* probabilities of 32 keys as bf16 pairs, [16 pairs][16 queries x 2] */
           + 64 * 16 * 4;    /* weighed values of 64 channels, [64][16 queries] */
}

/* Token j of KV head h of a chunk's history, into key[0 .. dim) and value[0 .. dim) as bf16: the
 * quantised blocks first (dequantised as kv_native.c's reader does: centred code * scale + offset
 * in float32, rounded once), then the full-precision slots. `codes` is dim floats of work space. */
static void history_row(const attention *a, const cold_layer *c, int64_t cold_len, const int64_t *slots, int64_t h,
                        int64_t j, float *codes, uint16_t *key, uint16_t *value) {
    int64_t dim = a->dim;
    if (j >= cold_len) {
        int64_t row = slots[j - cold_len] * a->kv_heads + h;
        memcpy(key, (const uint16_t *)a->keys + row * dim, (size_t)dim * 2);
        memcpy(value, (const uint16_t *)a->values + row * dim, (size_t)dim * 2);
        return;
    }
    int64_t r = c->blocks[c->starts[0] + j / c->block] * a->kv_heads + h, t = j % c->block;
    codes_f32(c, 0, r, t, dim, codes);
    for (int64_t d = 0; d < dim; d++)
        key[d] = f32_to_bf16(codes[d] * param(c->key_scale, r * dim + d, 0) + param(c->key_offset, r * dim + d, 0));
    codes_f32(c, 1, r, t, dim, codes);
    float scale = param(c->value_scale, r * c->block + t, 0), offset = param(c->value_offset, r * c->block + t, 0);
    for (int64_t d = 0; d < dim; d++)
        value[d] = f32_to_bf16(codes[d] * scale + offset);
}

/* The block's queries transposed into pairs: qt[r][i] (32 bits) = channels 2r, 2r + 1 of query i,
 * zero for i >= rows. */
static void chunk_queries(const chunk *c, int64_t head, int64_t first, int64_t rows, uint16_t *qt) {
    memset(qt, 0, (size_t)(c->dim * 16) * 2);
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *q = c->query + head * c->head_stride + (first + i) * c->token_stride;
        for (int64_t r = 0; r < c->dim / 2; r++)
            memcpy(qt + (r * 16 + i) * 2, q + 2 * r, 4);
    }
}

/* scores[j][i] (keys j < n, queries i < 16) masked causally in place: key j is seen by query i when
 * j <= position + i, -inf otherwise. Returns each query's largest score. */
static __m512 chunk_mask(float *scores, int64_t position, int64_t n) {
    const __m512 lanes = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 top = _mm512_set1_ps(-INFINITY);
    int64_t open = position < n ? position : n; /* keys 0 .. open are seen by every query: no mask */
    for (int64_t j = 0; j < open; j++)
        top = _mm512_max_ps(top, _mm512_loadu_ps(scores + j * 16));
    for (int64_t j = open; j < n; j++) {
        __mmask16 seen_by = _mm512_cmp_ps_mask(lanes, _mm512_set1_ps((float)(j - position)), _CMP_GE_OQ);
        __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen_by, _mm512_loadu_ps(scores + j * 16));
        _mm512_storeu_ps(scores + j * 16, s);
        top = _mm512_max_ps(top, s);
    }
    return top;
}

/* Writes channels half .. half + width of the block's `rows` queries: weighed[d][i] / sums[i]. */
static void chunk_store(const chunk *c, int64_t head, int64_t first, int64_t rows, int64_t half, int64_t width,
                        const float *weighed, const float *sums) {
    int64_t heads = c->kv_heads * c->groups;
    for (int64_t i = 0; i < rows; i++) {
        uint16_t *o = c->out + ((first + i) * heads + head) * c->dim + half;
        float inverse = 1.0f / sums[i];
        for (int64_t d = 0; d < width; d++)
            o[d] = f32_to_bf16(weighed[d * 16 + i] * inverse);
    }
}

/* out[m][i] (m < count, i < 16) = the sum over r < n of rows[m * stride + 2r .. + 2) . vectors[r][i]:
 * each row's bf16 pair broadcast to every lane and multiplied into the 16 lanes of pairs of
 * vectors[r] (dpbf16: both products exact, summed in float32). `count` <= 16 accumulators stay in
 * registers (a constant where it is inlined). */
static inline void pair_products(const uint16_t *rows, int64_t stride, const uint16_t *vectors, int64_t n, int count,
                                 float *out) {
    __m512 acc[16];
    for (int m = 0; m < count; m++)
        acc[m] = _mm512_setzero_ps();
    for (int64_t r = 0; r < n; r++) {
        __m512bh v = (__m512bh)_mm512_loadu_si512(vectors + r * 32);
        for (int m = 0; m < count; m++)
            acc[m] = _mm512_dpbf16_ps(acc[m], pair_everywhere(rows + m * stride + 2 * r), v);
    }
    for (int m = 0; m < count; m++)
        _mm512_storeu_ps(out + m * 16, acc[m]);
}

/* Query head `head`'s tokens first .. first + 16 (those < q_len) against the keys they may see,
 * 16 queries to a vector: a key's channel pair is broadcast to every lane and multiplied into the
 * queries' pairs (dpbf16), eight keys at a time; the values likewise, a pair of keys' channel
 * broadcast against the queries' probability pairs, sixteen channels at a time. */
static void vec_chunk_block(const chunk *c, int64_t head, int64_t first, uint8_t *space) {
    int64_t dim = c->dim, kv = head / c->groups, rows = c->q_len - first < 16 ? c->q_len - first : 16;
    int64_t position = c->kv_len - c->q_len + first, seen = position + rows; /* keys the last query sees */
    int64_t n = (seen + 31) / 32 * 32;                                      /* keys scored: whole pairs */
    float *scores = (float *)space;
    uint16_t *qt = (uint16_t *)(scores + c->kv_pad * 16);
    float *weighed = (float *)(qt + dim * 16 + 16 * 32);
    const uint16_t *keys = c->keys + kv * c->kv_pad * dim, *values = c->values_t + kv * dim * c->kv_pad;
    chunk_queries(c, head, first, rows, qt);
    for (int64_t j = 0; j < n; j += 8) /* eight keys at a time, 16 queries to a vector */
        pair_products(keys + j * dim, dim, qt, dim / 2, 8, scores + j * 16);
    const __m512 scale = _mm512_set1_ps(c->scale), shift = _mm512_mul_ps(chunk_mask(scores, position, n), scale);
    __m512 total = _mm512_setzero_ps();
    uint16_t *pairs = (uint16_t *)scores; /* pair k of keys 2k, 2k + 1 over rows 2k, 2k + 1: read first */
    for (int64_t k = 0; k < n / 2; k++) {
        __m512 a = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(scores + 2 * k * 16), scale, shift));
        __m512 b = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(scores + (2 * k + 1) * 16), scale, shift));
        total = _mm512_add_ps(total, _mm512_add_ps(a, b));
        _mm512_storeu_si512(pairs + k * 32, bf16_pair(a, b));
    }
    float sums[16];
    _mm512_storeu_ps(sums, total);
    for (int64_t half = 0; half < dim; half += 16) { /* sixteen channels at a time */
        pair_products(values + half * c->kv_pad, c->kv_pad, pairs, n / 2, 16, weighed);
        chunk_store(c, head, first, rows, half, 16, weighed, sums);
    }
}
#endif

#endif /* ATTENTION_CHUNK_H */
