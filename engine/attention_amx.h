/* The AMX section of attention_native.c (included there once, after its shared types and helpers:
 * `attention`, `cold_layer`, codes_f32, param, the AVX-512 helpers and kv_bf16.h): decode attention
 * over bf16 history by tiles, quantised blocks dequantised to bf16 rows first, and prompt chunks.
 * Defines ATT_AMX: 1 where the build targets AMX (with AVX-512 BF16, on Linux), else 0. */
#ifndef ATTENTION_AMX_H
#define ATTENTION_AMX_H

#if ATT_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define ATT_AMX 1
/* AMX: eight tile registers of up to 16 rows x 64 bytes; a bf16 product adds A (16 x 32 bf16) times
 * B (16 rows of 16 bf16 pairs, "VNNI" order) into C (16 x 16 float32), each float32 sum of pairs
 * of products exact, as dpbf16's. Every tile here is 16 x 64 bytes: tmm0-3 weigh values into four
 * 16-channel column blocks, tmm4-6 hold the operands (keys, queries, values, probabilities), tmm7
 * a tile of scores. Probabilities are weighed as bf16 (rounded to nearest even), as torch's own
 * paths do (the gathered decode, and its flash attention for prompts). The tile state is per
 * thread: each OpenMP thread loads the configuration before its work and releases it after. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void tiles_begin(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* Linux hands a process the AMX tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XTILEDATA); 1 when granted (torch's oneDNN will usually have asked already). */
static int tiles_permitted(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

/* Work space (bytes, a multiple of 64) of one thread's tiles for `dim` channels. */
static int64_t tile_bytes(int64_t dim) {
    return 16 * dim * 2      /* keys of a tile of 16 tokens when their slots do not follow each other */
           + 16 * dim * 2    /* the queries transposed, 32 channels a tile: [dim / 32][16 pairs][16 heads x 2] */
           + 16 * 16 * 4     /* a tile of scores, [16 tokens][16 heads] */
           + 16 * 32 * 2     /* probabilities of 32 tokens as bf16, [16 heads][32 tokens] */
           + 4 * 16 * 32 * 2 /* values of 32 tokens in pairs, [4 column blocks][16 pairs][16 channels x 2] */
           + 16 * 64 * 4;    /* four column blocks of weighed values, [16 heads][64 channels] */
}

/* The pair's full-precision scores by tiles: scores[g][t] (row stride n) for its `hot` tokens at
 * `slots`, bf16 keys scored against its <= 16 query heads; dim a multiple of 32. A tile of 16 keys
 * whose slots follow each other (a block's) is loaded where it lies, with the cache's row stride. */
static void amx_scores(const attention *a, int64_t first, int64_t kv, const int64_t *slots, int64_t hot,
                       int64_t n, float *scores, uint8_t *space) {
    int64_t groups = a->groups, dim = a->dim, chunks = dim / 32, row = a->kv_heads * dim * 2;
    uint16_t *keys = (uint16_t *)space, *qt = keys + 16 * dim;
    float *tile = (float *)(qt + 16 * dim);
    const uint16_t *q = (const uint16_t *)a->query + first * dim, *cache = (const uint16_t *)a->keys;
    memset(qt, 0, (size_t)(16 * dim) * 2);
    for (int64_t c = 0; c < chunks; c++) /* qt[c][r][2h + e] = q[h][32c + 2r + e] */
        for (int64_t g = 0; g < groups; g++)
            for (int64_t r = 0; r < 16; r++)
                for (int64_t e = 0; e < 2; e++)
                    qt[(c * 16 + r) * 32 + 2 * g + e] = q[g * dim + c * 32 + 2 * r + e];
    for (int64_t t = 0; t < hot; t += 16) {
        int64_t m = hot - t < 16 ? hot - t : 16;
        if (t + 16 < hot)
            prefetch_rows(a, a->keys, slots + t + 16, hot - t - 16 < 16 ? hot - t - 16 : 16, kv);
        const uint16_t *base = cache + (slots[t] * a->kv_heads + kv) * dim;
        int64_t stride = row;
        int follow = m == 16;
        for (int64_t j = 1; follow && j < 16; j++)
            follow = slots[t + j] == slots[t] + j;
        if (!follow) { /* gathered into `keys`, zeros past m */
            for (int64_t j = 0; j < 16; j++)
                if (j < m)
                    memcpy(keys + j * dim, cache + (slots[t + j] * a->kv_heads + kv) * dim, (size_t)dim * 2);
                else
                    memset(keys + j * dim, 0, (size_t)dim * 2);
            base = keys;
            stride = dim * 2;
        }
        _tile_zero(7);
        for (int64_t c = 0; c < chunks; c++) {
            _tile_loadd(4, base + c * 32, stride);
            _tile_loadd(5, qt + c * 16 * 32, 64);
            _tile_dpbf16ps(7, 4, 5);
        }
        _tile_stored(7, tile, 64);
        for (int64_t g = 0; g < groups; g++)
            for (int64_t j = 0; j < m; j++)
                scores[g * n + t + j] = tile[j * 16 + g] * a->scale;
    }
}

/* acc[g][0..dim) += the pair's full-precision values at `slots` weighed by probs[g][0..hot) (row
 * stride n) rounded to bf16, by tiles; dim a multiple of 64. */
static void amx_values(const attention *a, int64_t kv, const int64_t *slots, int64_t hot, int64_t n,
                       const float *probs, float *acc, uint8_t *space) {
    int64_t groups = a->groups, dim = a->dim;
    uint16_t *probs16 = (uint16_t *)(space + 16 * dim * 4 + 16 * 16 * 4), *pairs = probs16 + 16 * 32;
    float *weighed = (float *)(pairs + 4 * 16 * 32);
    const uint16_t *cache = (const uint16_t *)a->values;
    const __m512i lower = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                           6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i upper = _mm512_add_epi16(lower, _mm512_set1_epi16(16));
    memset(probs16, 0, 16 * 32 * 2);
    for (int64_t half = 0; half < dim; half += 64) { /* 64 channels a pass: four column blocks */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t = 0; t < hot; t += 32) {
            int64_t m = hot - t < 32 ? hot - t : 32;
            if (t + 32 < hot)
                prefetch_rows(a, a->values, slots + t + 32, hot - t - 32 < 32 ? hot - t - 32 : 32, kv);
            __mmask16 first = (__mmask16)(m >= 16 ? 0xFFFF : (1u << m) - 1u);
            __mmask16 second = (__mmask16)(m >= 32 ? 0xFFFF : m > 16 ? (1u << (m - 16)) - 1u : 0u);
            for (int64_t g = 0; g < groups; g++) { /* to nearest even, as f32_to_bf16 */
                __m512 p0 = _mm512_maskz_loadu_ps(first, probs + g * n + t);
                __m512 p1 = _mm512_maskz_loadu_ps(second, probs + g * n + t + 16);
                _mm512_storeu_si512(probs16 + g * 32, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            }
            for (int64_t r = 0; r < 16; r++) { /* pairs[k][r] = channels 16k.. of tokens 2r, 2r + 1 */
                __m512i x[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                __m512i y[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                if (2 * r < m) {
                    const uint16_t *v = cache + (slots[t + 2 * r] * a->kv_heads + kv) * dim + half;
                    x[0] = _mm512_loadu_si512(v);
                    x[1] = _mm512_loadu_si512(v + 32);
                }
                if (2 * r + 1 < m) {
                    const uint16_t *v = cache + (slots[t + 2 * r + 1] * a->kv_heads + kv) * dim + half;
                    y[0] = _mm512_loadu_si512(v);
                    y[1] = _mm512_loadu_si512(v + 32);
                }
                for (int64_t b = 0; b < 2; b++) {
                    _mm512_storeu_si512(pairs + ((2 * b) * 16 + r) * 32, _mm512_permutex2var_epi16(x[b], lower, y[b]));
                    _mm512_storeu_si512(pairs + ((2 * b + 1) * 16 + r) * 32,
                                        _mm512_permutex2var_epi16(x[b], upper, y[b]));
                }
            }
            _tile_loadd(4, probs16, 64);
            _tile_loadd(5, pairs, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, pairs + 16 * 32, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, pairs + 2 * 16 * 32, 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, pairs + 3 * 16 * 32, 64);
            _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, weighed, 256);
        _tile_stored(1, weighed + 16, 256);
        _tile_stored(2, weighed + 32, 256);
        _tile_stored(3, weighed + 48, 256);
        for (int64_t g = 0; g < groups; g++)
#pragma omp simd
            for (int64_t d = 0; d < 64; d++)
                acc[g * dim + half + d] += weighed[g * 64 + d];
    }
}

/* Query head `head`'s tokens first .. first + 16 (those < q_len) against the keys they may see:
 * token i sits at position kv_len - q_len + i and attends to keys 0 .. that position. Scores by
 * tiles (keys x queries), a softmax per query in float32, values weighed by tiles (channels x
 * queries; the values transposed once per call, the probabilities as bf16 pairs). */
static void amx_chunk_block(const chunk *c, int64_t head, int64_t first, uint8_t *space) {
    int64_t dim = c->dim, kv = head / c->groups, rows = c->q_len - first < 16 ? c->q_len - first : 16;
    int64_t position = c->kv_len - c->q_len + first, seen = position + rows; /* keys the last query sees */
    int64_t tiles = (seen + 31) / 32 * 2;                                   /* of 16 keys, even */
    float *scores = (float *)space;
    uint16_t *qt = (uint16_t *)(scores + c->kv_pad * 16), *pairs = qt + dim * 16;
    float *weighed = (float *)(pairs + 16 * 32);
    const uint16_t *keys = c->keys + kv * c->kv_pad * dim, *values = c->values_t + kv * dim * c->kv_pad;
    chunk_queries(c, head, first, rows, qt); /* pair r of chunk k of query i: qt[k][r][i] */
    if (dim == 64) { /* both chunks of the queries stay in tmm5, tmm6 */
        _tile_loadd(5, qt, 64);
        _tile_loadd(6, qt + 16 * 32, 64);
    }
    for (int64_t t = 0; dim == 64 && t < tiles; t++) {
        _tile_zero(7);
        _tile_loadd(4, keys + t * 16 * dim, dim * 2);
        _tile_dpbf16ps(7, 4, 5);
        _tile_loadd(4, keys + t * 16 * dim + 32, dim * 2);
        _tile_dpbf16ps(7, 4, 6);
        _tile_stored(7, scores + t * 16 * 16, 64);
    }
    for (int64_t t = 0; dim != 64 && t < tiles; t++) {
        _tile_zero(7);
        for (int64_t k = 0; k < dim / 32; k++) {
            _tile_loadd(4, keys + t * 16 * dim + k * 32, dim * 2);
            _tile_loadd(5, qt + k * 16 * 32, 64);
            _tile_dpbf16ps(7, 4, 5);
        }
        _tile_stored(7, scores + t * 16 * 16, 64);
    }
    const __m512 scale = _mm512_set1_ps(c->scale);
    const __m512 shift = _mm512_mul_ps(chunk_mask(scores, position, tiles * 16), scale);
    __m512 total = _mm512_setzero_ps();
    for (int64_t half = 0; half < dim; half += 64) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t = 0; t < tiles * 16; t += 32) {
            for (int64_t k = 0; k < 16; k++) { /* probabilities of keys t + 2k, t + 2k + 1, in pairs */
                const float *row = scores + (t + 2 * k) * 16;
                __m512 a = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(row), scale, shift));
                __m512 b = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(row + 16), scale, shift));
                if (half == 0)
                    total = _mm512_add_ps(total, _mm512_add_ps(a, b));
                _mm512_storeu_si512(pairs + k * 32, bf16_pair(a, b));
            }
            _tile_loadd(5, pairs, 64);
            const uint16_t *v = values + half * c->kv_pad + t;
            int64_t stride = c->kv_pad * 2;
            _tile_loadd(4, v, stride);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, v + 16 * c->kv_pad, stride);
            _tile_dpbf16ps(1, 6, 5);
            _tile_loadd(4, v + 32 * c->kv_pad, stride);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, v + 48 * c->kv_pad, stride);
            _tile_dpbf16ps(3, 6, 5);
        }
        _tile_stored(0, weighed, 64);
        _tile_stored(1, weighed + 16 * 16, 64);
        _tile_stored(2, weighed + 32 * 16, 64);
        _tile_stored(3, weighed + 48 * 16, 64);
        float sums[16];
        _mm512_storeu_ps(sums, total);
        chunk_store(c, head, first, rows, half, 64, weighed, sums);
    }
}

/* The pair's `m` quantised blocks dequantised to bf16 rows in `rows` (as torch's reader does):
 * keys [m * block][dim], values likewise, then `order` (0, 1, ...). Returned as a cache of one KV
 * head whose slots are `order`, for amx_scores and amx_values to read as full-precision tokens. */
static attention amx_cold_rows(const attention *a, const cold_layer *c, const int64_t *blocks, int64_t m,
                               int64_t kv, uint16_t *rows, int64_t **order) {
    int64_t dim = a->dim, count = m * c->block, starts[2] = {0, m};
    uint16_t *keys = rows, *values = rows + count * dim;
    *order = (int64_t *)(values + count * dim);
    float *codes = (float *)(*order + count);
    cold_layer own = *c;
    own.blocks = blocks, own.starts = starts;
    for (int64_t j = 0; j < count; j++) {
        history_row(a, &own, count, NULL, kv, j, codes, keys + j * dim, values + j * dim);
        (*order)[j] = j;
    }
    attention b = *a;
    b.keys = keys, b.values = values, b.kv_heads = 1;
    return b;
}

/* Bytes of rows amx_cold_rows needs for `count` quantised tokens. */
static int64_t cold_row_bytes(int64_t count, int64_t dim) { return count * (2 * dim * 2 + 8) + dim * 4 + 64; }
#else
#define ATT_AMX 0
#endif

#endif /* ATTENTION_AMX_H */
