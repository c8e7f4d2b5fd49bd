/* Decode attention's AVX-512 BF16 loops (included once by attention_native.c, after
 * attention_chunk.h, whose pair_everywhere they use): a tile of bf16 keys scored for every query
 * head of a KV head at once (score_tile_bf16), a tile of bf16 values weighed likewise
 * (weigh_tile_bf16, unmix), and a quantised block's tokens dequantised to bf16 rows for them
 * (cold_rows_bf16). Both loops keep up to 8 query heads' sums in registers and multiply bf16 pairs
 * by dpbf16 (both products exact, summed in float32). */
#ifndef ATTENTION_VECTORS_H
#define ATTENTION_VECTORS_H

#if ATT_AVX512
/* Lane j of t[r] = 32-bit element r of rows[j] (16 x 16 elements transposed in registers). */
static inline void transpose16(const __m512i rows[16], __m512i t[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) { /* per 128-bit lane: rows 2i, 2i + 1 interleaved by element */
        a[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* b[4i + m], 128-bit lane L: element 4L + m of rows 4i .. 4i + 3 */
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int m = 0; m < 4; m++) { /* 128-bit lane L of b[m], b[4 + m], b[8 + m], b[12 + m] -> t[4L + m] */
        __m512i p = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x44); /* lanes 0, 1 of each */
        __m512i q = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xEE); /* lanes 2, 3 of each */
        __m512i r = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0x44);
        __m512i s = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0xEE);
        t[m] = _mm512_shuffle_i32x4(p, r, 0x88);
        t[4 + m] = _mm512_shuffle_i32x4(p, r, 0xDD);
        t[8 + m] = _mm512_shuffle_i32x4(q, s, 0x88);
        t[12 + m] = _mm512_shuffle_i32x4(q, s, 0xDD);
    }
}

/* out[g * stride + j] (j < 16) = scale * (query head g . keys[j]) for `count` (<= 8, a constant where
 * it is inlined) query heads from `query` (bf16, `dim` channels each, heads `dim` apart): keys
 * given transposed in pairs (lane j of keys[r] = channels 2r, 2r + 1 of key j), each query pair
 * broadcast against them by dpbf16; the sums stay in registers. */
static inline __attribute__((always_inline)) void score_heads(const __m512i *keys, const uint16_t *query,
                                                              int64_t dim, const int count, float scale,
                                                              __mmask16 keep, float *out, int64_t stride) {
    __m512 sums[8];
    for (int g = 0; g < count; g++)
        sums[g] = _mm512_setzero_ps();
    for (int64_t r = 0; r < dim / 2; r++) {
        __m512bh k = (__m512bh)_mm512_loadu_si512(keys + r);
        for (int g = 0; g < count; g++)
            sums[g] = _mm512_dpbf16_ps(sums[g], pair_everywhere(query + g * dim + 2 * r), k);
    }
    for (int g = 0; g < count; g++)
        _mm512_mask_storeu_ps(out + g * stride, keep, _mm512_mul_ps(sums[g], _mm512_set1_ps(scale)));
}

/* scores[g * n + j] = scale * (query head first + g . key j) for the k <= 16 bf16 keys at
 * rows[0 .. k), every query head g < groups: the keys transposed into pairs in registers (to
 * `keys`, dim / 2 vectors of work space) and scored 16 at a time, a query's pair broadcast against
 * them (products of pairs exact in float32, summed in float32). */
static void score_tile_bf16(const attention *a, int64_t first, const uint16_t *const *rows, int64_t k,
                            int64_t groups, int64_t n, float *scores, __m512i *keys) {
    int64_t dim = a->dim;
    __m512i lines[16], pairs[16];
    for (int64_t c = 0; c < dim / 32; c++) { /* 32 channels (16 pairs) of the 16 keys at a time */
        for (int64_t j = 0; j < 16; j++)
            lines[j] = j < k ? _mm512_loadu_si512(rows[j] + 32 * c) : _mm512_setzero_si512();
        transpose16(lines, pairs);
        for (int r = 0; r < 16; r++)
            _mm512_storeu_si512(keys + 16 * c + r, pairs[r]);
    }
    const uint16_t *query = (const uint16_t *)a->query + first * dim;
    __mmask16 keep = (__mmask16)(k >= 16 ? 0xFFFF : (1u << k) - 1u);
    for (int64_t g = 0; g < groups; g += 8) {
        const uint16_t *q = query + g * dim;
        float *out = scores + g * n;
        switch (groups - g < 8 ? groups - g : 8) {
        case 1: score_heads(keys, q, dim, 1, a->scale, keep, out, n); break;
        case 2: score_heads(keys, q, dim, 2, a->scale, keep, out, n); break;
        case 3: score_heads(keys, q, dim, 3, a->scale, keep, out, n); break;
        case 4: score_heads(keys, q, dim, 4, a->scale, keep, out, n); break;
        case 5: score_heads(keys, q, dim, 5, a->scale, keep, out, n); break;
        case 6: score_heads(keys, q, dim, 6, a->scale, keep, out, n); break;
        case 7: score_heads(keys, q, dim, 7, a->scale, keep, out, n); break;
        default: score_heads(keys, q, dim, 8, a->scale, keep, out, n); break;
        }
    }
}

/* Sums of one 16-channel slot of a tile's interleaved values for `count` (<= 8, a constant where
 * it is inlined) query heads: acc[g] += over key pairs i < npairs, (weights[g][i] . pairs[i][slot])
 * by dpbf16; the accumulators stay in registers. */
static inline __attribute__((always_inline)) void weigh_slot(const uint16_t *pairs, int64_t slots,
                                                             int64_t slot, const uint32_t *weights, int64_t npairs,
                                                             const int count, float *acc, int64_t stride) {
    __m512 sums[8];
    for (int g = 0; g < count; g++)
        sums[g] = _mm512_setzero_ps();
    for (int64_t i = 0; i < npairs; i++) {
        __m512bh v = (__m512bh)_mm512_loadu_si512(pairs + (i * slots + slot) * 32);
        for (int g = 0; g < count; g++)
            sums[g] = _mm512_dpbf16_ps(sums[g], (__m512bh)_mm512_set1_epi32((int)weights[g * (TILE / 2) + i]), v);
    }
    for (int g = 0; g < count; g++)
        _mm512_storeu_ps(acc + g * stride, _mm512_add_ps(_mm512_loadu_ps(acc + g * stride), sums[g]));
}

/* mixed[g][0 .. dim) += the k <= TILE bf16 values at rows[0 .. k) weighed by probs[g * n + 0 .. k)
 * for every query head g < groups: the probabilities rounded to bf16 first, as torch's bf16 path
 * casts its softmax to the values' dtype before their product, and the products of a pair of keys
 * summed in float32 by dpbf16. `pairs` (TILE * dim bf16) and `weights` (groups * TILE / 2 pairs)
 * are work space. `mixed` is in the interleaved order that unpacking a pair of value rows leaves:
 * channel 32c + 8L + 4h + i in lane 4L + i of its slot 2c + h; `unmix` puts it back. */
static void weigh_tile_bf16(const attention *a, const uint16_t *const *rows, int64_t k, const float *probs,
                            int64_t n, int64_t groups, uint16_t *pairs, uint32_t *weights, float *mixed) {
    int64_t dim = a->dim, nslots = dim / 16, npairs = (k + 1) / 2;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t j = 0; j < k; j += 32) { /* 32 probabilities to 16 pairs of bf16, zero past k */
            __mmask16 low = (__mmask16)(k - j >= 16 ? 0xFFFF : (1u << (k - j)) - 1u);
            __mmask16 high = (__mmask16)(k - j >= 32 ? 0xFFFF : k - j <= 16 ? 0 : (1u << (k - j - 16)) - 1u);
            __m512 lo = _mm512_maskz_loadu_ps(low, probs + g * n + j);
            __m512 hi = _mm512_maskz_loadu_ps(high, probs + g * n + j + 16);
            _mm512_storeu_si512(weights + g * (TILE / 2) + j / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    for (int64_t i = 0; i < npairs; i++) { /* keys 2i, 2i + 1 (the first twice past k: weight 0) */
        const uint16_t *ra = rows[2 * i], *rb = 2 * i + 1 < k ? rows[2 * i + 1] : ra;
        for (int64_t c = 0; c < dim / 32; c++) {
            __m512i va = _mm512_loadu_si512(ra + 32 * c), vb = _mm512_loadu_si512(rb + 32 * c);
            _mm512_storeu_si512(pairs + (i * nslots + 2 * c) * 32, _mm512_unpacklo_epi16(va, vb));
            _mm512_storeu_si512(pairs + (i * nslots + 2 * c + 1) * 32, _mm512_unpackhi_epi16(va, vb));
        }
    }
    for (int64_t s = 0; s < nslots; s++)
        for (int64_t g = 0; g < groups; g += 8) {
            const uint32_t *w = weights + g * (TILE / 2);
            float *out = mixed + g * dim + s * 16;
            switch (groups - g < 8 ? groups - g : 8) {
            case 1: weigh_slot(pairs, nslots, s, w, npairs, 1, out, dim); break;
            case 2: weigh_slot(pairs, nslots, s, w, npairs, 2, out, dim); break;
            case 3: weigh_slot(pairs, nslots, s, w, npairs, 3, out, dim); break;
            case 4: weigh_slot(pairs, nslots, s, w, npairs, 4, out, dim); break;
            case 5: weigh_slot(pairs, nslots, s, w, npairs, 5, out, dim); break;
            case 6: weigh_slot(pairs, nslots, s, w, npairs, 6, out, dim); break;
            case 7: weigh_slot(pairs, nslots, s, w, npairs, 7, out, dim); break;
            default: weigh_slot(pairs, nslots, s, w, npairs, 8, out, dim); break;
            }
        }
}

/* Tokens t .. t + k of row r (a block of one KV head) of a quantised layer as bf16 rows, its keys
 * or (`values`) its values, into out[j * dim]: centred code * scale + offset by one fused
 * multiply-add in float32, rounded once, as kv_native.c's reader dequantises them (bf16 scales and
 * offsets: keys' per channel of the row, values' per token; 4-bit codes two to a byte, channel d
 * in the low nibble and d + dim / 2 in the high one, centre 8; 6-bit codes as kv_codes.h lays them
 * out, centre 32). dim a multiple of 32. */
/* Channels d .. d + 16 of one token's 6-bit codes (kv_codes.h), centred: one load of nibbles and
 * one of top bits where the 16 lie in one quarter of the channels (dim a multiple of 64). */
static inline __m512 six_bits16(const uint8_t *p, int64_t dim, int64_t d) {
    int64_t half = dim / 2, quarter = dim / 4;
    if (quarter % 16) {
        int32_t codes[16];
        for (int64_t i = 0; i < 16; i++)
            codes[i] = kv_code6(p, dim, d + i) - 32;
        return _mm512_cvtepi32_ps(_mm512_loadu_si512(codes));
    }
    __m512i byte = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + (d < half ? d : d - half))));
    __m512i low = d < half ? _mm512_and_si512(byte, _mm512_set1_epi32(15)) : _mm512_srli_epi32(byte, 4);
    __m512i pairs = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + half + d % quarter)));
    __m512i top = _mm512_and_si512(_mm512_srl_epi32(pairs, _mm_cvtsi32_si128((int)(2 * (d / quarter)))),
                                   _mm512_set1_epi32(3));
    __m512i code = _mm512_or_si512(low, _mm512_slli_epi32(top, 4));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(code, _mm512_set1_epi32(32)));
}

static void cold_rows_bf16(const cold_layer *c, int64_t r, int64_t t, int64_t k, int64_t dim, int values,
                           uint16_t *out) {
    const uint16_t *scales = (const uint16_t *)(values ? c->value_scale : c->key_scale);
    const uint16_t *offsets = (const uint16_t *)(values ? c->value_offset : c->key_offset);
    int64_t bits;
    const uint8_t *row = cold_codes(c, values, r, &bits);
    for (int64_t j = 0; j < k; j++) {
        const uint8_t *token = row + (t + j) * (dim * bits / 8);
        __m512 scale = _mm512_setzero_ps(), offset = _mm512_setzero_ps();
        if (values) {
            scale = _mm512_set1_ps(bf16_to_f32(scales[r * c->block + t + j]));
            offset = _mm512_set1_ps(bf16_to_f32(offsets[r * c->block + t + j]));
        }
        for (int64_t d = 0; d < dim; d += 16) {
            __m512 code; /* channels d .. d + 16, centred, as codes_f32 gives them */
            if (bits == 8) {
                const int8_t *p = (const int8_t *)token + d;
                code = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
            } else if (bits == 6) {
                code = six_bits16(token, dim, d);
            } else if (d < dim / 2) { /* low nibbles: the first half of the channels */
                const uint8_t *p = token + d;
                __m512i byte = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
                code = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(byte, _mm512_set1_epi32(15)),
                                                           _mm512_set1_epi32(8)));
            } else { /* high nibbles: the second half */
                const uint8_t *p = token + d - dim / 2;
                __m512i byte = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
                code = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(byte, 4), _mm512_set1_epi32(8)));
            }
            if (!values) {
                scale = bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(scales + r * dim + d)));
                offset = bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(offsets + r * dim + d)));
            }
            __m512 x = _mm512_fmadd_ps(code, scale, offset);
            _mm256_storeu_si256((__m256i *)(out + j * dim + d), (__m256i)_mm512_cvtneps_pbh(x));
        }
    }
}

/* acc[g][..] += mixed[g][..] put back in channel order (see weigh_tile_bf16). */
static void unmix(const float *mixed, int64_t groups, int64_t dim, float *acc) {
    for (int64_t g = 0; g < groups; g++)
        for (int64_t c = 0; c < dim / 32; c++)
            for (int64_t h = 0; h < 2; h++)
                for (int64_t lane = 0; lane < 16; lane++) {
                    int64_t at = g * dim + 32 * c;
                    acc[at + 8 * (lane / 4) + 4 * h + lane % 4] += mixed[at + 16 * h + lane];
                }
}
#endif

#endif /* ATTENTION_VECTORS_H */
