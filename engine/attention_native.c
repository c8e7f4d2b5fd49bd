/* Decode attention over the paged full-precision KV cache, read in place (see engine/kv_native.py).
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
 * weighted sum of values; bfloat16 results are rounded to nearest even.
 *
 * Threads: the (sequence, KV head) pairs are shared by OpenMP. The library is linked against
 * libgomp.so.1, which the process has already loaded with torch, so these are torch's own
 * OpenMP workers, not a second pool fighting them for the cores. Vectorised by the compiler
 * (omp simd) for the -march the library is built for.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_load(const uint16_t *p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) { /* round to nearest even; inputs are finite */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (a score minus its row's maximum), within 2e-7 relative: x = n ln2 + r,
 * |r| <= ln2 / 2, exp(r) by its Taylor polynomial to degree 7, 2^n built in the exponent bits.
 * Plain arithmetic, so that a simd loop vectorises it (libm's expf would be called per element). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x; /* exp(-87) ~ 1.6e-38: the smallest normal range, 0 to a softmax */
    float n = __builtin_rintf(x * 1.44269504088896341f); /* to nearest: one vector instruction */
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f; /* ln2, split for exactness */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#define TILE 64 /* keys whose values are weighed together (converted to float32 once) */

typedef struct {
    const void *query, *keys, *values; /* [seqs][kv_heads * groups][dim], [slots][kv_heads][dim] x 2 */
    int64_t kv_heads, groups, dim;
    float scale;
    int fp32; /* 1: float32 tensors, 0: bfloat16 */
    void *out;
} attention;

/* Row `row` of `dim` channels of a tensor as float32: the tensor's own memory when it is float32,
 * else converted into `buffer`. A cache row of (slot, KV head) is row slot * kv_heads + kv. */
static inline const float *row_f32(const attention *a, const void *base, int64_t row, float *buffer) {
    if (a->fp32)
        return (const float *)base + row * a->dim;
    const uint16_t *p = (const uint16_t *)base + row * a->dim;
#pragma omp simd
    for (int64_t d = 0; d < a->dim; d++)
        buffer[d] = bf16_load(p, d);
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

/* Scores of query head `head` against 16 keys from slots[0..m), m <= 16: dim a multiple of 32. */
static inline void scores16(const attention *a, int64_t head, int64_t kv, const int64_t *slots, int64_t m,
                            float *out) {
    __m512 part[16];
    for (int64_t j = 0; j < 16; j++) {
        __m512 s = _mm512_setzero_ps();
        if (j < m) {
            int64_t at = (slots[j] * a->kv_heads + kv) * a->dim, q = head * a->dim;
            if (a->fp32) {
                const float *k = (const float *)a->keys + at, *qf = (const float *)a->query + q;
                for (int64_t d = 0; d < a->dim; d += 16)
                    s = _mm512_fmadd_ps(_mm512_loadu_ps(qf + d), _mm512_loadu_ps(k + d), s);
            } else { /* pairs of bfloat16 products, exact in float32, summed in float32 */
                const uint16_t *k = (const uint16_t *)a->keys + at, *qh = (const uint16_t *)a->query + q;
                for (int64_t d = 0; d < a->dim; d += 32)
                    s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(qh + d),
                                         (__m512bh)_mm512_loadu_si512(k + d));
            }
        }
        part[j] = s;
    }
    __m512 sums = _mm512_mul_ps(sum_lanes16(part), _mm512_set1_ps(a->scale));
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << m) - 1u), sums);
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

/* The portable paths of the same two steps (any dim). */
static void scores_generic(const attention *a, int64_t head, int64_t kv, const int64_t *slots, int64_t m,
                           float *q, float *row, float *out) {
    const float *qf = row_f32(a, a->query, head, q);
    for (int64_t j = 0; j < m; j++) {
        const float *k = row_f32(a, a->keys, slots[j] * a->kv_heads + kv, row);
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < a->dim; d++)
            s += qf[d] * k[d];
        out[j] = s * a->scale;
    }
}

static void weigh_generic(const float *const *rows, const float *p, int64_t m, int64_t dim, float *acc) {
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
 * hardware prefetcher loses the thread at every block). */
static inline void prefetch_rows(const attention *a, const void *base, const int64_t *slots, int64_t m, int64_t kv) {
    int64_t size = a->fp32 ? 4 : 2, bytes = a->dim * size;
    for (int64_t j = 0; j < m; j++) {
        const char *row = (const char *)base + (slots[j] * a->kv_heads + kv) * bytes;
        for (int64_t b = 0; b < bytes; b += 64)
            __builtin_prefetch(row + b);
    }
}

/* Floats of work space one pair needs, for histories of up to `longest` tokens. */
static int64_t work_floats(int64_t groups, int64_t dim, int64_t longest) {
    return groups * longest + groups * dim + 2 * dim + TILE * dim;
}

/* One (sequence, KV head) pair: its `groups` query heads over the `n` cached tokens at `slots`. */
static void attend_pair(const attention *a, int64_t seq, int64_t kv, const int64_t *slots, int64_t n, float *work) {
    int64_t groups = a->groups, dim = a->dim, first = seq * a->kv_heads * groups + kv * groups;
    float *scores = work;               /* [groups][n] */
    float *acc = scores + groups * n;   /* [groups][dim] */
    float *q = acc + groups * dim;      /* [dim] */
    float *row = q + dim;               /* [dim] */
    float *tile = row + dim;            /* [TILE][dim]: values as float32 */
#if ATT_AVX512
    int fast = dim % 64 == 0;
#endif
    for (int64_t t = 0; t < n; t += 16) { /* a tile of keys at a time, every query head: read once */
        int64_t m = n - t < 16 ? n - t : 16;
        if (t + 16 < n)
            prefetch_rows(a, a->keys, slots + t + 16, n - t - 16 < 16 ? n - t - 16 : 16, kv);
        for (int64_t g = 0; g < groups; g++) {
#if ATT_AVX512
            if (fast) {
                scores16(a, first + g, kv, slots + t, m, scores + g * n + t);
                continue;
            }
#endif
            scores_generic(a, first + g, kv, slots + t, m, q, row, scores + g * n + t);
        }
    }
    for (int64_t g = 0; g < groups; g++)
        softmax(scores + g * n, n);
    memset(acc, 0, (size_t)(groups * dim) * sizeof(float));
    const float *rows[TILE];
    for (int64_t t = 0; t < n; t += TILE) {
        int64_t m = n - t < TILE ? n - t : TILE;
        if (t + TILE < n)
            prefetch_rows(a, a->values, slots + t + TILE, n - t - TILE < TILE ? n - t - TILE : TILE, kv);
        for (int64_t j = 0; j < m; j++)
            rows[j] = row_f32(a, a->values, slots[t + j] * a->kv_heads + kv, tile + j * dim);
        for (int64_t g = 0; g < groups; g++) {
#if ATT_AVX512
            if (fast) {
                weigh(rows, scores + g * n + t, m, dim, acc + g * dim);
                continue;
            }
#endif
            weigh_generic(rows, scores + g * n + t, m, dim, acc + g * dim);
        }
    }
    for (int64_t g = 0; g < groups; g++) {
        int64_t at = (first + g) * dim;
        if (a->fp32)
            memcpy((float *)a->out + at, acc + g * dim, (size_t)dim * sizeof(float));
        else
            for (int64_t d = 0; d < dim; d++)
                ((uint16_t *)a->out)[at + d] = bf16_round(acc[g * dim + d]);
    }
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
 * cached tokens: those of sequence i at slots[starts[i] .. starts[i + 1]), in order, of the
 * layer's keys and values (num_slots, kv_heads, dim). Returns 0; -1 when a slot is out of
 * range or a sequence has no tokens (nothing written), or memory for the scores is not to be had. */
int kv_decode_attention(const void *query, const void *keys, const void *values, const int64_t *slots,
                        const int64_t *starts, int64_t seqs, int64_t kv_heads, int64_t groups, int64_t dim,
                        int64_t num_slots, float scale, int fp32, void *out) {
    int64_t longest = 0;
    for (int64_t i = 0; i < seqs; i++) {
        int64_t n = starts[i + 1] - starts[i];
        if (n <= 0)
            return -1;
        longest = n > longest ? n : longest;
    }
    for (int64_t j = 0; j < starts[seqs]; j++)
        if (slots[j] < 0 || slots[j] >= num_slots)
            return -1;
    attention a = {query, keys, values, kv_heads, groups, dim, scale, fp32, out};
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *work = malloc((size_t)work_floats(groups, dim, longest) * sizeof(float));
        failed = work == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t pair = 0; pair < seqs * kv_heads; pair++)
            if (work != NULL)
                attend_pair(&a, pair / kv_heads, pair % kv_heads, slots + starts[pair / kv_heads],
                            starts[pair / kv_heads + 1] - starts[pair / kv_heads], work);
        free(work);
    }
    return failed ? -1 : 0;
}
