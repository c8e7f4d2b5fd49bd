/* A decoder layer's element-wise work in one pass each (see engine/fused.py): RMSNorm, the MLP's
 * SiLU(gate) * up, and the rotary embedding of queries and keys. Torch's eager CPU path runs them
 * as chains of operators, each a pass over memory with a bf16 rounding between (RMSNorm:
 * conversion, square, mean, rsqrt, two products, conversion; the MLP: SiLU, then a product over the
 * 4,864-wide intermediate; RoPE: two slices, a negation, a concatenation, three products and a sum,
 * for the queries and again for the keys).
 *
 * Each result is rounded where transformers' modules round it, so that bf16 results are torch's
 * to within float32 arithmetic order: RMSNorm gives bf16(weight * bf16(x * rsqrt(mean(x^2) + eps)))
 * with the mean in float32, SiLU * up gives bf16(bf16(silu(gate)) * up), RoPE gives
 * bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)). float32 tensors are
 * computed in float32 throughout. Rows (RMSNorm) or stretches of elements (SiLU * up) are shared by
 * torch's OpenMP workers (see attention_native.c); the loops are vectorised by the compiler.
 */
#include <math.h>
#include <stdint.h>

#include "kv_bf16.h"

#define STRETCH 4096 /* elements of SiLU * up a thread takes at a time */

static inline float load(const void *base, int64_t i, int fp32) {
    return fp32 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
}

/* x * sigmoid(x), sigmoid from exp(-|x|) (never overflows): 1 / (1 + e) for x >= 0, else e / (1 + e). */
static inline float silu(float x) {
    float e = exp_nonpositive(x < 0.0f ? x : -x);
    return x * (x < 0.0f ? e : 1.0f) / (1.0f + e);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define LAYERS_AVX512 1
static inline __m512 load16(const uint16_t *p) { return bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
static inline __m512 rounded(__m512 v) { return bf16x16_to_f32(to_bf16(v)); } /* through bf16 and back */

static inline __m512 silu16(__m512 x) { /* as silu() below */
    __m512 e = exp16(_mm512_min_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), x))); /* exp(-|x|) */
    __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_div_ps(_mm512_mask_mul_ps(x, negative, x, e), _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
}

/* silu_mul's loop, 16 lanes at a time; returns where the scalar loop takes over. */
static int64_t silu_mul16(const void *gate, const void *up, int64_t begin, int64_t end, int fp32, void *out) {
    int64_t i = begin;
    for (; fp32 && i + 16 <= end; i += 16) {
        __m512 s = silu16(_mm512_loadu_ps((const float *)gate + i));
        _mm512_storeu_ps((float *)out + i, _mm512_mul_ps(s, _mm512_loadu_ps((const float *)up + i)));
    }
    for (; !fp32 && i + 16 <= end; i += 16) {
        __m512 s = rounded(silu16(load16((const uint16_t *)gate + i)));
        __m256i o = to_bf16(_mm512_mul_ps(s, load16((const uint16_t *)up + i)));
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), o);
    }
    return i;
}

/* kv_rms_norm's bf16 row, 16 lanes at a time; n a multiple of 16. */
static void rms_row16(const uint16_t *v, const uint16_t *w, int64_t n, float eps, uint16_t *o) {
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __m512 x = load16(v + i);
        squares = _mm512_fmadd_ps(x, x, squares);
    }
    __m512 inverse = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)(o + i), to_bf16(_mm512_mul_ps(load16(w + i), rounded(_mm512_mul_ps(load16(v + i), inverse)))));
}
#else
#define LAYERS_AVX512 0
#endif

/* out (rows, n) = RMSNorm of x (rows, n) with weight (n,): float32 or bfloat16 alike. */
void kv_rms_norm(const void *x, const void *weight, int64_t rows, int64_t n, float eps, int fp32, void *out) {
#pragma omp parallel for schedule(static) if (rows * n >= 16384)
    for (int64_t r = 0; r < rows; r++) {
#if LAYERS_AVX512
        if (!fp32 && n % 16 == 0) {
            rms_row16((const uint16_t *)x + r * n, (const uint16_t *)weight, n, eps, (uint16_t *)out + r * n);
            continue;
        }
#endif
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < n; i++) {
            float v = load(x, r * n + i, fp32);
            squares += v * v;
        }
        float inverse = 1.0f / sqrtf(squares / (float)n + eps);
        if (fp32) {
            const float *w = (const float *)weight, *v = (const float *)x + r * n;
            float *o = (float *)out + r * n;
#pragma omp simd
            for (int64_t i = 0; i < n; i++)
                o[i] = w[i] * (v[i] * inverse);
        } else {
            const uint16_t *w = (const uint16_t *)weight, *v = (const uint16_t *)x + r * n;
            uint16_t *o = (uint16_t *)out + r * n;
#pragma omp simd
            for (int64_t i = 0; i < n; i++)
                o[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(v[i]) * inverse)));
        }
    }
}

/* out = silu(gate) * up, `count` elements of float32 or bfloat16 each. */
void kv_silu_mul(const void *gate, const void *up, int64_t count, int fp32, void *out) {
    int64_t stretches = (count + STRETCH - 1) / STRETCH;
#pragma omp parallel for schedule(static) if (count >= 2 * STRETCH)
    for (int64_t s = 0; s < stretches; s++) {
        int64_t begin = s * STRETCH, end = begin + STRETCH < count ? begin + STRETCH : count;
#if LAYERS_AVX512
        begin = silu_mul16(gate, up, begin, end, fp32, out);
#endif
        if (fp32) {
            const float *g = (const float *)gate, *u = (const float *)up;
            float *o = (float *)out;
#pragma omp simd
            for (int64_t i = begin; i < end; i++)
                o[i] = silu(g[i]) * u[i];
        } else {
            const uint16_t *g = (const uint16_t *)gate, *u = (const uint16_t *)up;
            uint16_t *o = (uint16_t *)out;
#pragma omp simd
            for (int64_t i = begin; i < end; i++)
                o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu(bf16_to_f32(g[i])))) * bf16_to_f32(u[i]));
        }
    }
}

/* x (rows, stride): the first heads * dim elements of each row, `heads` heads of `dim`, turned in
 * place by the rotary embedding as transformers' apply_rotary_pos_emb does: x * cos +
 * rotate_half(x) * sin, where rotate_half of a head (x1, x2) is (-x2, x1); cos and sin (rows, dim),
 * one row of angles per row of x. Each head's halves are read before either is written. */
void kv_rotary(void *x, int64_t rows, int64_t stride, int64_t heads, int64_t dim, const void *cos, const void *sin,
               int fp32) {
    int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < heads; h++) {
            int64_t at = r * stride + h * dim;
            if (fp32) {
                float *v = (float *)x + at;
                const float *c = (const float *)cos + r * dim, *s = (const float *)sin + r * dim;
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    float a = v[i], b = v[i + half];
                    v[i] = a * c[i] + -b * s[i];
                    v[i + half] = b * c[i + half] + a * s[i + half];
                }
            } else {
                uint16_t *v = (uint16_t *)x + at;
                const uint16_t *c = (const uint16_t *)cos + r * dim, *s = (const uint16_t *)sin + r * dim;
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    float a = bf16_to_f32(v[i]), b = bf16_to_f32(v[i + half]);
                    float lo = bf16_to_f32(f32_to_bf16(a * bf16_to_f32(c[i])));
                    float lo_turn = bf16_to_f32(f32_to_bf16(-b * bf16_to_f32(s[i])));
                    float hi = bf16_to_f32(f32_to_bf16(b * bf16_to_f32(c[i + half])));
                    float hi_turn = bf16_to_f32(f32_to_bf16(a * bf16_to_f32(s[i + half])));
                    v[i] = f32_to_bf16(lo + lo_turn);
                    v[i + half] = f32_to_bf16(hi + hi_turn);
                }
            }
        }
    }
}

/* "avx512-bf16" where the loops above run 16 lanes at a time, else "loops" (what the compiler made
 * of them: RMSNorm vectorises; SiLU's exp and branches do not, ~10x slower than torch there). */
const char *kv_layers_isa(void) { return LAYERS_AVX512 ? "avx512-bf16" : "loops"; }
