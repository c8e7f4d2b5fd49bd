/* Portable readers of packed KV codes, shared by kv_native.c and attention_native.c (the layouts
 * are engine/kv_quant.py's). */
#ifndef KV_CODES_H
#define KV_CODES_H

#include <stdint.h>

/* Channel d of one token's 6-bit codes (a row of dim * 3 / 4 bytes), uncentred (0..63): its low
 * four bits packed as 4-bit codes are (channel d in the low nibble of byte d, channel d + dim / 2
 * in the high one), then its top two bits four to a byte (byte dim / 2 + j holds channels j,
 * j + dim / 4, j + dim / 2 and j + 3 dim / 4, from its low bits up). */
static inline int kv_code6(const uint8_t *token, int64_t dim, int64_t d) {
    int64_t half = dim / 2, quarter = dim / 4;
    uint8_t nibbles = token[d < half ? d : d - half];
    int low = d < half ? (nibbles & 0x0F) : (nibbles >> 4);
    return low | (((token[half + d % quarter] >> (2 * (d / quarter))) & 3) << 4);
}

/* Whether kv_heads heads' codes in these bits, from these starts, fit `stride` bytes a block of
 * `block` tokens of `dim` channels: each head's codes inside the block, none overlapping. */
static inline int kv_parts_ok(int64_t kv_heads, const int64_t *bits, const int64_t *starts, int64_t stride,
                              int64_t block, int64_t dim) {
    int64_t end = 0;
    for (int64_t h = 0; h < kv_heads; h++) {
        int64_t b = bits[h];
        if ((b != 8 && b != 6 && b != 4) || (b == 4 && dim % 2) || (b == 6 && dim % 4) || starts[h] < end)
            return 0;
        end = starts[h] + block * dim * b / 8;
    }
    return kv_heads > 0 && end <= stride;
}

#endif /* KV_CODES_H */
