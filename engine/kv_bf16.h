/* What the engine's C kernels share (kv_native.c, attention_native.c, layers_native.c): bfloat16 <->
 * float32, and exp of a non-positive float32 that a simd loop vectorises. */
#ifndef DEEPANALYZE_KV_BF16_H
#define DEEPANALYZE_KV_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) { /* a bf16 is the top half of a float32 */
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch; inputs are finite */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (e.g. a score minus its row's maximum), within 2e-7 relative: x = n ln2 + r,
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

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp(x) of 16 lanes, x <= 0: exp_nonpositive's polynomial, vectorised. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* 16 bf16 <-> 16 float32 lanes (to nearest even, as f32_to_bf16). */
static inline __m512 bf16x16_to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
#endif

#endif
