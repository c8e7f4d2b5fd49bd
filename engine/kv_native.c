/* Gather-and-dequantise of quantised KV rows on the CPU, in one pass (see engine/kv_native.py).
 *
 * A row is one (block, KV head) of the quantised store: `block` tokens of `dim` channels. Row r's
 * codes lie at block r / kv_heads's `stride` bytes, from byte starts[head] on (head = r % kv_heads),
 * in bits[head]: a KV head's codes may hold their own format.
 * Codes are 8-bit (int8, already centred), 4-bit (two to a byte: the low nibble holds
 * channel d, the high nibble channel d + dim/2; stored uncentred, 0..15, centre 8) or 6-bit
 * (their low nibbles as 4-bit codes, then their top two bits four to a byte: kv_codes.h; centre
 * 32). Each
 * element is x = centred(code) * scale + offset, with (scale, offset) per channel of the row
 * (keys) or per token of the row (values), in the cache's dtype: bfloat16 or float32.
 * Arithmetic is float32 with one fused multiply-add; bfloat16 results are rounded to nearest
 * even, as torch rounds.
 *
 * Torch's eager CPU path needs a gather, a conversion and a broadcast multiply-add, each a pass
 * over memory; this is one. Single-threaded on the calling thread: a second thread pool would
 * fight torch's OpenMP workers for the same cores.
 *
 * Three paths, chosen when compiling (-march): AVX-512 BF16 (16 channels a step), AVX2 with FMA
 * (8), and a portable loop (row_generic) for other CPUs and for head sizes the vectors do not
 * divide. The two vector paths are one reader (row_simd) over a few per-instruction-set helpers.
 */
#include <stdint.h>
#include <string.h>

#include "kv_bf16.h"
#include "kv_codes.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KV_AVX512 1
#define KV_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KV_AVX512 0
#define KV_AVX2 1
#else
#define KV_AVX512 0
#define KV_AVX2 0
#endif

typedef struct {
    const void *codes;      /* [blocks][stride]: each KV head's [block][width] in turn */
    const void *scale;      /* [rows][dim] per channel, or [rows][block] per token */
    const void *offset;     /* same shape as scale */
    int64_t kv_heads;       /* rows are (block, KV head) */
    const int64_t *bits;    /* per KV head: 8, 6 or 4 */
    const int64_t *starts;  /* per KV head: its codes' first byte within a block */
    int64_t stride;         /* bytes of a block's codes */
    int per_token;          /* 1: (scale, offset) per token of the row, 0: per channel */
    int fp32;               /* 1: scale, offset and out are float32, 0: bfloat16 */
    int64_t block, dim;
} kv_layer;

/* Row r's codes and their bits. */
static inline const uint8_t *row_codes(const kv_layer *l, int64_t r, int *bits) {
    int64_t head = r % l->kv_heads;
    *bits = (int)l->bits[head];
    return (const uint8_t *)l->codes + (r / l->kv_heads) * l->stride + l->starts[head];
}

static inline float load1(const void *p, int64_t i, int fp32) {
    return fp32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void store1(void *p, int64_t i, float x, int fp32) {
    if (fp32)
        ((float *)p)[i] = x;
    else
        ((uint16_t *)p)[i] = f32_to_bf16(x);
}

static inline int code_at(const kv_layer *l, int bits, const uint8_t *row, int64_t t, int64_t d) {
    if (bits == 8)
        return ((const int8_t *)row)[t * l->dim + d];
    if (bits == 6)
        return kv_code6(row + t * (l->dim * 3 / 4), l->dim, d) - 32;
    int64_t half = l->dim / 2;
    uint8_t byte = row[t * half + (d < half ? d : d - half)];
    return (d < half ? (byte & 0x0F) : (byte >> 4)) - 8;
}

static void row_generic(const kv_layer *l, int64_t r, void *out, int64_t o) {
    int bits;
    const uint8_t *row = row_codes(l, r, &bits);
    for (int64_t t = 0; t < l->block; t++)
        for (int64_t d = 0; d < l->dim; d++) {
            int64_t k = l->per_token ? r * l->block + t : r * l->dim + d;
            float x = (float)code_at(l, bits, row, t, d) * load1(l->scale, k, l->fp32) + load1(l->offset, k, l->fp32);
            store1(out, o + t * l->dim + d, x, l->fp32);
        }
}

#if KV_AVX512 || KV_AVX2
/* One vector of LANES floats, and the few operations the row reader needs, for each instruction
 * set; row_simd below is written once over them. */
#if KV_AVX512
#define LANES 16
typedef __m512 vfloat;
typedef __m512i vint;
static inline vfloat v_set1(float x) { return _mm512_set1_ps(x); }
static inline vfloat v_fmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
static inline vfloat v_load_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store_f32(float *p, vfloat x) { _mm512_storeu_ps(p, x); }
static inline vfloat v_load_bf16(const uint16_t *p) { /* a bf16 is the top half of a float32 */
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline void v_store_bf16(uint16_t *p, vfloat x) { /* rounds to nearest even */
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
}
static inline vfloat v_from_int8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vint v_widen_uint8(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline vfloat v_nibble(vint c, int high) { /* the low or high nibble of each lane, centred */
    vint n = high ? _mm512_srli_epi32(c, 4) : _mm512_and_si512(c, _mm512_set1_epi32(0x0F));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(n, _mm512_set1_epi32(8)));
}
static inline vfloat v_six(vint c, int high, vint top, int shift) { /* a nibble, two top bits; centred */
    vint n = high ? _mm512_srli_epi32(c, 4) : _mm512_and_si512(c, _mm512_set1_epi32(0x0F));
    vint t = _mm512_and_si512(_mm512_srl_epi32(top, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(3));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(n, _mm512_slli_epi32(t, 4)), _mm512_set1_epi32(32)));
}
#else
#define LANES 8
typedef __m256 vfloat;
typedef __m256i vint;
static inline vfloat v_set1(float x) { return _mm256_set1_ps(x); }
static inline vfloat v_fmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
static inline vfloat v_load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store_f32(float *p, vfloat x) { _mm256_storeu_ps(p, x); }
static inline vfloat v_load_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline void v_store_bf16(uint16_t *p, vfloat x) { /* rounds to nearest even, as f32_to_bf16 */
    __m256i u = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    /* packus works within 128-bit lanes: (lo, hi) give (lo4, lo4, hi4, hi4) as 64-bit parts 0-3 */
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
static inline __m128i load_bytes8(const void *p) {
    int64_t v;
    memcpy(&v, p, sizeof v);
    return _mm_cvtsi64_si128(v);
}
static inline vfloat v_from_int8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_bytes8(p)));
}
static inline vint v_widen_uint8(const uint8_t *p) { return _mm256_cvtepu8_epi32(load_bytes8(p)); }
static inline vfloat v_nibble(vint c, int high) {
    vint n = high ? _mm256_srli_epi32(c, 4) : _mm256_and_si256(c, _mm256_set1_epi32(0x0F));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(n, _mm256_set1_epi32(8)));
}
static inline vfloat v_six(vint c, int high, vint top, int shift) {
    vint n = high ? _mm256_srli_epi32(c, 4) : _mm256_and_si256(c, _mm256_set1_epi32(0x0F));
    vint t = _mm256_and_si256(_mm256_srl_epi32(top, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(3));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(n, _mm256_slli_epi32(t, 4)), _mm256_set1_epi32(32)));
}
#endif

static inline vfloat load_v(const void *p, int64_t i, int fp32) {
    return fp32 ? v_load_f32((const float *)p + i) : v_load_bf16((const uint16_t *)p + i);
}

static inline void store_v(void *p, int64_t i, vfloat x, int fp32) {
    if (fp32)
        v_store_f32((float *)p + i, x);
    else
        v_store_bf16((uint16_t *)p + i, x);
}

/* LANES channels' scale and offset for token t of row r (broadcast when per token). */
static inline void params_v(const kv_layer *l, int64_t r, int64_t t, int64_t d, vfloat *s, vfloat *b) {
    if (l->per_token) {
        *s = v_set1(load1(l->scale, r * l->block + t, l->fp32));
        *b = v_set1(load1(l->offset, r * l->block + t, l->fp32));
    } else {
        *s = load_v(l->scale, r * l->dim + d, l->fp32);
        *b = load_v(l->offset, r * l->dim + d, l->fp32);
    }
}

/* row_generic, LANES channels at a time: dim a multiple of LANES (8-bit), 2 * LANES (4-bit) or
 * 4 * LANES (6-bit: then a step's channels lie in one quarter, whose top bits share a shift). */
static void row_simd(const kv_layer *l, int64_t r, void *out, int64_t o) {
    vfloat s, b, s2, b2;
    int bits;
    const uint8_t *codes = row_codes(l, r, &bits);
    if (bits == 8) {
        const int8_t *row = (const int8_t *)codes;
        for (int64_t t = 0; t < l->block; t++)
            for (int64_t d = 0; d < l->dim; d += LANES) {
                params_v(l, r, t, d, &s, &b);
                store_v(out, o + t * l->dim + d, v_fmadd(v_from_int8(row + t * l->dim + d), s, b), l->fp32);
            }
        return;
    }
    /* 4-bit codes: nibbles of channels d and d + half in byte d; 6-bit: those nibbles, then the top
     * two bits of channel j + q * quarter in byte half + j at bit 2q */
    int64_t half = l->dim / 2, quarter = l->dim / 4, width = bits == 6 ? l->dim * 3 / 4 : half;
    const uint8_t *row = codes;
    for (int64_t t = 0; t < l->block; t++)
        for (int64_t d = 0; d < half; d += LANES) {
            params_v(l, r, t, d, &s, &b);
            params_v(l, r, t, d + half, &s2, &b2);
            vint c = v_widen_uint8(row + t * width + d);
            vfloat low = v_nibble(c, 0), high = v_nibble(c, 1);
            if (bits == 6) {
                vint top = v_widen_uint8(row + t * width + half + d % quarter);
                int shift = (int)(2 * (d / quarter));
                low = v_six(c, 0, top, shift), high = v_six(c, 1, top, shift + 4);
            }
            store_v(out, o + t * l->dim + d, v_fmadd(low, s, b), l->fp32);
            store_v(out, o + t * l->dim + d + half, v_fmadd(high, s2, b2), l->fp32);
        }
}
#endif

/* The instruction set the rows are read with: "avx512-bf16", "avx2" or "generic". */
const char *kv_native_isa(void) { return KV_AVX512 ? "avx512-bf16" : KV_AVX2 ? "avx2" : "generic"; }

/* out[i] = row rows[i] of the layer (of num_rows = blocks * kv_heads), dequantised: out is
 * [n][block][dim]. Returns 0, or -1 (and writes nothing) when a row is out of range or the layout
 * is not one kv_native.c reads. */
int kv_dequantize_rows(const void *codes, const void *scale, const void *offset, int64_t kv_heads,
                       const int64_t *bits, const int64_t *starts, int64_t stride, int per_token, int fp32,
                       int64_t block, int64_t dim, int64_t num_rows, const int64_t *rows, int64_t n, void *out) {
    if (!kv_parts_ok(kv_heads, bits, starts, stride, block, dim))
        return -1;
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= num_rows)
            return -1;
    kv_layer l = {codes, scale, offset, kv_heads, bits, starts, stride, per_token, fp32, block, dim};
    for (int64_t i = 0; i < n; i++) {
#if KV_AVX512 || KV_AVX2
        int64_t b = bits[rows[i] % kv_heads];
        if (dim % (b == 8 ? LANES : b == 4 ? 2 * LANES : 4 * LANES) == 0) {
            row_simd(&l, rows[i], out, i * block * dim);
            continue;
        }
#endif
        row_generic(&l, rows[i], out, i * block * dim);
    }
    return 0;
}
