/* GGUF quantization blocks split into what their decoders compute from: each value's whole
 * number q (every type's fits an int8) and, per 16 values, a float32 scale and offset, each
 * value then scale * q + offset, or scale * q - offset where the type subtracts its offset
 * (the K types' minimums). The scales are the float32 products the gguf package's numpy code
 * forms (a float16 d times a 6-bit scale for the K types), so the values so computed (never
 * fused: -ffp-contract=off) are its bits. A type without an offset has -0.0, which adds
 * nothing to any value. Used by the block decoder (dequantize.c) and by the linear kernels,
 * which hold a weight's blocks so split (kernels.c, quantized_blocks.h).
 *
 * Layouts (GGML). Of 32 weights, a nibble byte i holding weight i (low 4 bits) and weight
 * i + 16 (high 4 bits):
 *   Q8_0:   scale d (f16), 32 int8 q                              -> d * q
 *   Q4_0:   d (f16), 16 bytes of nibbles                          -> d * (q - 8)
 *   Q4_1:   d (f16), min m (f16), 16 bytes of nibbles             -> d * q + m
 *   Q5_0:   d (f16), 32 fifth bits (u32), 16 bytes of nibbles     -> d * (q - 16)
 *   Q5_1:   d (f16), m (f16), 32 fifth bits, 16 bytes of nibbles -> d * q + m
 *   IQ4_NL: d (f16), 16 bytes of nibbles                          -> d * NONLINEAR[q]
 * Of 256 weights ("K" super-blocks):
 *   Q2_K: 16 bytes of 4-bit scale | 4-bit min, 64 bytes of 2-bit q, d, dmin (f16)
 *         -> (d * scale) * q - dmin * min, groups of 16
 *   Q3_K: 32 bytes of third bits h, 64 bytes of 2-bit q, 12 bytes of 6-bit scales, d (f16)
 *         -> (d * (scale - 32)) * (q - 4 * !h), groups of 16
 *   Q4_K: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
 *         -> (d * scale) * q - dmin * min, groups of 32
 *   Q5_K: as Q4_K with 32 bytes of fifth bits before the nibbles
 *   Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d (f16)
 *         -> (d * scale) * (q - 32), groups of 16
 */
#ifndef SHARDLINE_GGUF_BLOCKS_H
#define SHARDLINE_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "half.h"

enum { GGUF_BLOCK = 32, GGUF_SUPER_BLOCK = 256, GGUF_SPLIT = 16 };

/* One block split: q of each value, scale and offset of each 16 values. */
typedef struct {
    int8_t q[GGUF_SUPER_BLOCK];
    float scale[GGUF_SUPER_BLOCK / GGUF_SPLIT], offset[GGUF_SUPER_BLOCK / GGUF_SPLIT];
} GGUFSplit;

typedef struct {
    const char *name;
    long block_bytes, block_values;
    int subtracts; /* value = scale * q - offset, else + offset */
    void (*split)(const unsigned char *block, GGUFSplit *out);
} GGUFType;

/* A block's float16 at bytes (little-endian) as float32. */
static inline float gguf_half(const unsigned char *bytes) {
    return shardline_half_to_float((uint16_t)(bytes[0] | bytes[1] << 8));
}

/* The 32-weight types: one scale and offset for both halves. */
static inline void gguf_same_halves(GGUFSplit *out, float scale, float offset) {
    out->scale[0] = out->scale[1] = scale;
    out->offset[0] = out->offset[1] = offset;
}

/* Nibbles of 32 weights as q, less `less`. */
static inline void gguf_nibbles(const unsigned char *q, int less, int8_t *out) {
    for (int i = 0; i < GGUF_BLOCK / 2; i++) {
        out[i] = (int8_t)((q[i] & 0x0f) - less);
        out[i + GGUF_BLOCK / 2] = (int8_t)((q[i] >> 4) - less);
    }
}

/* Nibbles and fifth bits (u32, little-endian) of 32 weights as q, less `less`. */
static inline void gguf_five_bits(const unsigned char *fifth, const unsigned char *nibbles,
                                  int less, int8_t *out) {
    uint32_t high = (uint32_t)fifth[0] | (uint32_t)fifth[1] << 8 | (uint32_t)fifth[2] << 16 |
                    (uint32_t)fifth[3] << 24;
    for (int i = 0; i < GGUF_BLOCK / 2; i++) {
        out[i] = (int8_t)(((nibbles[i] & 0x0f) | (int)((high >> i) & 1) << 4) - less);
        out[i + GGUF_BLOCK / 2] =
            (int8_t)(((nibbles[i] >> 4) | (int)((high >> (i + GGUF_BLOCK / 2)) & 1) << 4) - less);
    }
}

static void gguf_q8_0(const unsigned char *block, GGUFSplit *out) {
    gguf_same_halves(out, gguf_half(block), -0.0f);
    memcpy(out->q, block + 2, GGUF_BLOCK);
}

static void gguf_q4_0(const unsigned char *block, GGUFSplit *out) {
    gguf_same_halves(out, gguf_half(block), -0.0f);
    gguf_nibbles(block + 2, 8, out->q);
}

static void gguf_q4_1(const unsigned char *block, GGUFSplit *out) {
    gguf_same_halves(out, gguf_half(block), gguf_half(block + 2));
    gguf_nibbles(block + 4, 0, out->q);
}

static void gguf_q5_0(const unsigned char *block, GGUFSplit *out) {
    gguf_same_halves(out, gguf_half(block), -0.0f);
    gguf_five_bits(block + 2, block + 6, 16, out->q);
}

static void gguf_q5_1(const unsigned char *block, GGUFSplit *out) {
    gguf_same_halves(out, gguf_half(block), gguf_half(block + 2));
    gguf_five_bits(block + 4, block + 8, 0, out->q);
}

/* IQ4_NL's 16 levels (GGML's kvalues_iq4nl). */
static const int8_t GGUF_NONLINEAR[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};

static void gguf_iq4_nl(const unsigned char *block, GGUFSplit *out) {
    gguf_same_halves(out, gguf_half(block), -0.0f);
    const unsigned char *q = block + 2;
    for (int i = 0; i < GGUF_BLOCK / 2; i++) {
        out->q[i] = GGUF_NONLINEAR[q[i] & 0x0f];
        out->q[i + GGUF_BLOCK / 2] = GGUF_NONLINEAR[q[i] >> 4];
    }
}

/* Value i's 2 bits in the K types' 64 bytes of 2-bit q (Q2_K, Q3_K). */
static inline int gguf_two_bits(const unsigned char *q, int i) {
    return q[i / 128 * 32 + i % 32] >> (2 * (i % 128 / 32)) & 3;
}

static void gguf_q2_k(const unsigned char *block, GGUFSplit *out) {
    const unsigned char *scales = block, *q = block + 16;
    float d = gguf_half(block + 80), dmin = gguf_half(block + 82);
    for (int group = 0; group < GGUF_SUPER_BLOCK / GGUF_SPLIT; group++) {
        out->scale[group] = d * (float)(scales[group] & 0x0f);
        out->offset[group] = dmin * (float)(scales[group] >> 4);
    }
    for (int i = 0; i < GGUF_SUPER_BLOCK; i++) out->q[i] = (int8_t)gguf_two_bits(q, i);
}

static void gguf_q3_k(const unsigned char *block, GGUFSplit *out) {
    const unsigned char *high = block, *q = block + 32, *scales = block + 96;
    float d = gguf_half(block + 108);
    for (int group = 0; group < GGUF_SUPER_BLOCK / GGUF_SPLIT; group++) {
        int low_bits = scales[group % 8] >> (4 * (group / 8)) & 0x0f;
        int high_bits = scales[8 + group % 4] >> (2 * (group / 4)) & 3;
        out->scale[group] = d * (float)((low_bits | high_bits << 4) - 32);
        out->offset[group] = -0.0f;
    }
    for (int i = 0; i < GGUF_SUPER_BLOCK; i++)
        out->q[i] = (int8_t)(gguf_two_bits(q, i) - ((high[i % 32] >> (i / 32) & 1) ? 0 : 4));
}

/* Q4_K without fifth bits (fifth NULL), Q5_K with them: 8 groups of 32, each with a 6-bit
 * scale and min packed in 12 bytes. */
static void gguf_k_4_or_5(const unsigned char *block, const unsigned char *fifth,
                          const unsigned char *nibbles, GGUFSplit *out) {
    float d = gguf_half(block), dmin = gguf_half(block + 2);
    const unsigned char *packed = block + 4;
    for (int group = 0; group < 8; group++) {
        int g = group % 4, scale, minimum;
        if (group < 4) {
            scale = packed[g] & 0x3f;
            minimum = packed[g + 4] & 0x3f;
        } else {
            scale = (packed[g + 8] & 0x0f) | (packed[g] >> 2 & 0x30);
            minimum = (packed[g + 8] >> 4) | (packed[g + 4] >> 2 & 0x30);
        }
        out->scale[2 * group] = out->scale[2 * group + 1] = d * (float)scale;
        out->offset[2 * group] = out->offset[2 * group + 1] = dmin * (float)minimum;
        for (int l = 0; l < GGUF_BLOCK; l++) {
            int value = nibbles[group / 2 * 32 + l] >> (4 * (group % 2)) & 0x0f;
            if (fifth != NULL) value |= (fifth[l] >> group & 1) << 4;
            out->q[group * GGUF_BLOCK + l] = (int8_t)value;
        }
    }
}

static void gguf_q4_k(const unsigned char *block, GGUFSplit *out) {
    gguf_k_4_or_5(block, NULL, block + 16, out);
}

static void gguf_q5_k(const unsigned char *block, GGUFSplit *out) {
    gguf_k_4_or_5(block, block + 16, block + 48, out);
}

static void gguf_q6_k(const unsigned char *block, GGUFSplit *out) {
    const unsigned char *low = block, *high = block + 128;
    const signed char *scales = (const signed char *)(block + 192);
    float d = gguf_half(block + 208);
    for (int group = 0; group < GGUF_SUPER_BLOCK / GGUF_SPLIT; group++) {
        out->scale[group] = d * (float)scales[group];
        out->offset[group] = -0.0f;
    }
    for (int i = 0; i < GGUF_SUPER_BLOCK; i++) {
        int half = i / 128, r = i % 128;
        int value = (low[half * 64 + r % 64] >> (4 * (r / 64)) & 0x0f) |
                    (high[half * 32 + r % 32] >> (2 * (r / 32)) & 3) << 4;
        out->q[i] = (int8_t)(value - 32);
    }
}

#define GGUF_TYPE_NAMES "Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"

static const GGUFType GGUF_TYPES[] = {
    {"Q8_0", 34, GGUF_BLOCK, 0, gguf_q8_0},
    {"Q4_0", 18, GGUF_BLOCK, 0, gguf_q4_0},
    {"Q4_1", 20, GGUF_BLOCK, 0, gguf_q4_1},
    {"Q5_0", 22, GGUF_BLOCK, 0, gguf_q5_0},
    {"Q5_1", 24, GGUF_BLOCK, 0, gguf_q5_1},
    {"IQ4_NL", 18, GGUF_BLOCK, 0, gguf_iq4_nl},
    {"Q2_K", 84, GGUF_SUPER_BLOCK, 1, gguf_q2_k},
    {"Q3_K", 110, GGUF_SUPER_BLOCK, 0, gguf_q3_k},
    {"Q4_K", 144, GGUF_SUPER_BLOCK, 1, gguf_q4_k},
    {"Q5_K", 176, GGUF_SUPER_BLOCK, 1, gguf_q5_k},
    {"Q6_K", 210, GGUF_SUPER_BLOCK, 0, gguf_q6_k},
};

/* The block type named name, or NULL. */
static inline const GGUFType *gguf_type(const char *name) {
    for (size_t i = 0; i < sizeof GGUF_TYPES / sizeof GGUF_TYPES[0]; i++)
        if (strcmp(name, GGUF_TYPES[i].name) == 0) return &GGUF_TYPES[i];
    return NULL;
}

/* Value i of a split block of type, as the type's decoder computes it. */
static inline float gguf_value(const GGUFType *type, const GGUFSplit *split, int i) {
    float scaled = split->scale[i / GGUF_SPLIT] * (float)split->q[i];
    return type->subtracts ? scaled - split->offset[i / GGUF_SPLIT]
                           : scaled + split->offset[i / GGUF_SPLIT];
}

#endif
