/* bfloat16 <-> float32 for the engine's C kernels (kv_native.c, attention_native.c). */
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

#endif
