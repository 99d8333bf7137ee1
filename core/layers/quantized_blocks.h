/* Linear weights held in GGUF's quantization blocks, for kernels.c: what a weight of each
 * kind holds, and how a float32 weight is found to be one (portable C; the kernels that read
 * them are quantized_linear.h, AVX-512, and quantized_linear_avx2.h, AVX2 with F16C).
 *
 * A weight of float32 values that GGUF's Q8_0, Q4_0 or Q4_1 blocks hold exactly (a GGUF
 * file's weights as dequantize.c decodes them: scale * q, scale * (q - 8), scale * q + min)
 * is found again from its values (pack_quantized_weight: a scale, and a minimum for Q4_1,
 * for each 32 inputs of each output, and each input's q, checked to give back every value
 * bit for bit) and held so: 1.06, 0.56 or 0.63 bytes a weight instead of 4. The kernels
 * widen each weight as dequantize.c does (one float32 multiply, for Q4_1 one add; kernels.c
 * is built with -ffp-contract=off, so never fused) and multiply as the float32 kernel does:
 * each output's sum has the same terms in the same order, so a layer's results are the
 * float32 layer's, bit for bit, from a fraction of the bytes.
 *
 * A weight of any other GGUF block type (gguf_blocks.h: Q5_1, IQ4_NL, the K types), or of
 * several types (a merged projection's parts), is held from the file's bytes instead
 * (pack_split_weight): INT8_SCALED, each block split into int8 q and a float32 scale and
 * offset per 16 inputs, widened as scale * q + offset (a subtracted offset held negated: the
 * same sum), checked against the values loaded: 1.5 bytes a weight.
 *
 * Layout: block after block of LINEAR_BLOCK outputs (the last padded with outputs of scale 0,
 * never stored), each group of QUANT_GROUP inputs in turn: the block's scales (float16), for
 * Q4_1 its minimums (float16), then the values, input by input, the block's outputs side by
 * side: Q8_0 one int8 each; Q4_0 and Q4_1 a byte for each pair of inputs, the first in its low
 * nibble. INT8_SCALED: the scales (float32) of the group's first 16 inputs, then of its last
 * 16, the offsets so, then one int8 each. */

#include "gguf_blocks.h"

/* How a blocked weight holds its values (the module's WEIGHT_* constants). */
enum {
    WEIGHT_FLOAT32,
    WEIGHT_BFLOAT16,
    WEIGHT_Q8_0,
    WEIGHT_Q4_0,
    WEIGHT_Q4_1,
    WEIGHT_INT8_SCALED,
    WEIGHT_KINDS
};

#define QUANT_GROUP 32
#define QUANT_HALF (QUANT_GROUP / 2)

static inline int is_quantized(int kind) { return kind >= WEIGHT_Q8_0 && kind < WEIGHT_KINDS; }

/* Whether a kind holds one byte an input (else a nibble). */
static inline int holds_bytes(int kind) {
    return kind == WEIGHT_Q8_0 || kind == WEIGHT_INT8_SCALED;
}

/* Bytes of one block's group: scales (and minimums), then the values. */
static inline long quantized_header_bytes(int kind) {
    if (kind == WEIGHT_INT8_SCALED) return 4 * (int)sizeof(float) * LINEAR_BLOCK;
    return (kind == WEIGHT_Q4_1 ? 4 : 2) * LINEAR_BLOCK;
}
static inline long quantized_group_bytes(int kind) {
    long values = holds_bytes(kind) ? QUANT_GROUP * LINEAR_BLOCK : QUANT_GROUP / 2 * LINEAR_BLOCK;
    return quantized_header_bytes(kind) + values;
}

/* Bytes of a quantized weight of out x in (in a multiple of QUANT_GROUP). */
static inline long quantized_bytes(int kind, long out, long in) {
    return (out + LINEAR_BLOCK - 1) / LINEAR_BLOCK * (in / QUANT_GROUP) *
           quantized_group_bytes(kind);
}

/* One weight from its block's scale, minimum and q, as dequantize.c computes it. */
static inline float widened(int kind, float scale, float minimum, int q) {
    if (kind == WEIGHT_Q4_1) return scale * (float)q + minimum;
    if (kind == WEIGHT_Q4_0) return scale * (float)(q - 8);
    return scale * (float)q;
}

static inline uint32_t bits_of(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* The float16 bit patterns nearest value (sign kept): the largest not above its magnitude
 * (a normal one's exponent and leading mantissa bits; below float16's normals, a search) and
 * its two neighbours; how many (0 where value is NaN or beyond float16's range). */
static int halves_near(float value, uint16_t found[3]) {
    uint16_t sign = value < 0 ? 0x8000u : 0;
    float magnitude = fabsf(value);
    if (!(magnitude <= 65504.0f)) return 0;
    unsigned low;
    if (magnitude >= 0x1p-14f) {
        low = (bits_of(magnitude) >> 13) - (112u << 10);
    } else {
        unsigned high = 0x3ff;
        low = 0;
        while (low < high) {
            unsigned middle = (low + high + 1) / 2;
            if (shardline_half_to_float((uint16_t)middle) <= magnitude)
                low = middle;
            else
                high = middle - 1;
        }
    }
    int count = 0;
    found[count++] = (uint16_t)(sign | low);
    if (low < 0x7bff) found[count++] = (uint16_t)(sign | (low + 1));
    if (low > 0) found[count++] = (uint16_t)(sign | (low - 1));
    return count;
}

/* q for each of QUANT_GROUP values such that widened(kind, scale, minimum, q) is the value,
 * bit for bit; 0 if some value has none. Each q is guessed to the nearest whole number (the
 * guess need not round as any quantizer did: the check decides). */
static int values_of_group(int kind, const float *values, float scale, float minimum, int *q) {
    int lowest = kind == WEIGHT_Q8_0 ? -128 : 0, highest = kind == WEIGHT_Q8_0 ? 127 : 15;
    float inverse = scale == 0.0f ? 0.0f : 1.0f / scale;
    for (int i = 0; i < QUANT_GROUP; i++) {
        float guess = (values[i] - minimum) * inverse;
        if (!(fabsf(guess) < 1024.0f)) return 0;
        long k = (long)(guess + 1024.5f) - 1024 + (kind == WEIGHT_Q4_0 ? 8 : 0);
        q[i] = (int)(k < lowest ? lowest : k > highest ? highest : k);
        if (bits_of(widened(kind, scale, minimum, q[i])) != bits_of(values[i])) return 0;
    }
    return 1;
}

/* The scale (and minimum) bits and q of one output's group of values as a block of kind;
 * 0 if no block of kind holds them exactly. The scale is the one GGUF's quantizer derives
 * (largest magnitude / 127; the value of largest magnitude / -8; (max - min) / 15) as the
 * values give it back, tried with its float16 neighbours; for Q8_0 also Q5_0's (the value of
 * largest magnitude / -16: a Q5_0 block's values d * (q - 16) are those of a Q8_0 block of
 * scale d, its sign included, which decides the sign of the zeros). */
static int group_of(int kind, const float *values, uint16_t *scale, uint16_t *minimum, int *q) {
    float low = values[0], high = values[0], widest = values[0];
    for (int i = 1; i < QUANT_GROUP; i++) {
        low = values[i] < low ? values[i] : low;
        high = values[i] > high ? values[i] : high;
        widest = fabsf(values[i]) > fabsf(widest) ? values[i] : widest;
    }
    float target, minimum_value = 0.0f;
    *minimum = 0;
    if (kind == WEIGHT_Q4_1) {
        uint16_t near[3];
        int count = halves_near(low, near);
        if (count == 0 || bits_of(shardline_half_to_float(near[0])) != bits_of(low)) return 0;
        *minimum = near[0], minimum_value = low;
        target = (high - low) / 15.0f;
    } else if (kind == WEIGHT_Q4_0) {
        target = widest / -8.0f;
    } else {
        target = fabsf(widest) / 127.0f;
    }
    for (int tried = 0; tried < (kind == WEIGHT_Q8_0 ? 2 : 1); tried++) {
        uint16_t candidates[3];
        int count = halves_near(tried == 0 ? target : widest / -16.0f, candidates);
        for (int c = 0; c < count; c++)
            if (values_of_group(kind, values, shardline_half_to_float(candidates[c]),
                                minimum_value, q)) {
                *scale = candidates[c];
                return 1;
            }
    }
    return 0;
}

/* weight (float32, out x in, rows contiguous) into dest (quantized_bytes(kind, out, in)
 * bytes) as blocks of kind; 1, or 0 where in is not a multiple of QUANT_GROUP or some group's
 * values are not a block of kind exactly (dest then holds part of it). */
static int pack_quantized_weight(int kind, const float *weight, long out, long in,
                                 uint8_t *dest) {
    if (!is_quantized(kind) || kind == WEIGHT_INT8_SCALED || in % QUANT_GROUP != 0) return 0;
    long groups = in / QUANT_GROUP, header = quantized_header_bytes(kind);
    long group_bytes = quantized_group_bytes(kind);
    int q[QUANT_GROUP];
    for (long block = 0; block * LINEAR_BLOCK < out; block++)
        for (long g = 0; g < groups; g++) {
            uint8_t *at = dest + (block * groups + g) * group_bytes;
            memset(at, 0, (size_t)group_bytes);
            uint16_t *scales = (uint16_t *)at, *minimums = scales + LINEAR_BLOCK;
            uint8_t *values = at + header;
            for (long o = 0; o < LINEAR_BLOCK && block * LINEAR_BLOCK + o < out; o++) {
                const float *row = weight + (block * LINEAR_BLOCK + o) * in + g * QUANT_GROUP;
                uint16_t scale, minimum;
                if (!group_of(kind, row, &scale, &minimum, q)) return 0;
                scales[o] = scale;
                if (kind == WEIGHT_Q4_1) minimums[o] = minimum;
                for (int i = 0; i < QUANT_GROUP; i++) {
                    if (kind == WEIGHT_Q8_0)
                        values[i * LINEAR_BLOCK + o] = (uint8_t)(int8_t)q[i];
                    else
                        values[i / 2 * LINEAR_BLOCK + o] |= (uint8_t)(q[i] << (4 * (i % 2)));
                }
            }
        }
    return 1;
}

/* Rows [first, first + rows) of a weight (out x in, in whole blocks of type) held as
 * INT8_SCALED in dest (quantized_bytes(WEIGHT_INT8_SCALED, out, in), zeroed by the caller),
 * from the file's blocks of those rows (row r's at raw + (r - first) * raw_stride); 1, or 0
 * where a value so held is not the loaded weight's (float32, rows contiguous), bit for bit
 * (any NaN for a NaN). */
static int pack_split_rows(const GGUFType *type, const uint8_t *raw, long raw_stride, long first,
                           long rows, long out, long in, const float *weight, uint8_t *dest) {
    if (in % type->block_values != 0 || in % QUANT_GROUP != 0 || first < 0 || rows < 0 ||
        first + rows > out)
        return 0;
    long groups = in / QUANT_GROUP, group_bytes = quantized_group_bytes(WEIGHT_INT8_SCALED);
    long header = quantized_header_bytes(WEIGHT_INT8_SCALED);
    GGUFSplit split;
    for (long o = first; o < first + rows; o++) {
        const uint8_t *row = raw + (o - first) * raw_stride;
        long lane = o % LINEAR_BLOCK;
        for (long start = 0; start < in; start += type->block_values) {
            type->split(row + start / type->block_values * type->block_bytes, &split);
            for (long i = start; i < start + type->block_values; i++) {
                long within = i - start, g = i / QUANT_GROUP, half = i % QUANT_GROUP / QUANT_HALF;
                uint8_t *group = dest + (o / LINEAR_BLOCK * groups + g) * group_bytes;
                float *scales = (float *)group, *offsets = scales + 2 * LINEAR_BLOCK;
                float scale = split.scale[within / GGUF_SPLIT];
                float offset = split.offset[within / GGUF_SPLIT];
                scales[half * LINEAR_BLOCK + lane] = scale;
                offsets[half * LINEAR_BLOCK + lane] = type->subtracts ? -offset : offset;
                int8_t q = split.q[within];
                group[header + i % QUANT_GROUP * LINEAR_BLOCK + lane] = (uint8_t)q;
                float held = scale * (float)q + offsets[half * LINEAR_BLOCK + lane];
                float loaded = weight[o * in + i];
                if (bits_of(held) != bits_of(loaded) && !(held != held && loaded != loaded))
                    return 0;
            }
        }
    }
    return 1;
}

/* The block kernels of one instruction set (TARGET: its function attribute; ROW and ROWS:
 * its kernels of one row and of several rows against one block, given the kind as a
 * constant): NAME##_q8_0, _q4_0 and _q4_1, and NAME(kind, weight, x, y, bias, rows, out, in,
 * first, end), which computes y's outputs in blocks [first, end) with the kind's. One row
 * widens as it reads; several widen each group once for all (row by row where the scratch
 * cannot be had: the same sums). */
#define DEFINE_QUANTIZED_BLOCKS_OF_KIND(TARGET, NAME, KIND, ROW, ROWS)                       \
    TARGET static void NAME(const uint8_t *weight, const float *x, float *y,                  \
                            const float *bias, long rows, long out, long in, long first,     \
                            long end) {                                                      \
        long groups = in / QUANT_GROUP, block_bytes = groups * quantized_group_bytes(KIND); \
        float *scratch = rows > 1 ? aligned_alloc(64, sizeof(float) *                        \
                                                          (size_t)((QUANT_GROUP + rows) *    \
                                                                   LINEAR_BLOCK))            \
                                  : NULL;                                                    \
        for (long b = first; b < end; b++) {                                                 \
            const uint8_t *block = weight + b * block_bytes;                                 \
            long width = out - b * LINEAR_BLOCK < LINEAR_BLOCK ? out - b * LINEAR_BLOCK     \
                                                               : LINEAR_BLOCK;               \
            const float *block_bias = bias ? bias + b * LINEAR_BLOCK : NULL;                 \
            if (scratch == NULL)                                                             \
                for (long r = 0; r < rows; r++)                                              \
                    ROW(KIND, block, groups, x + r * in, y + r * out + b * LINEAR_BLOCK,     \
                        width, block_bias);                                                  \
            else                                                                             \
                ROWS(KIND, block, groups, x, in, y + b * LINEAR_BLOCK, out, rows, width,     \
                     block_bias, scratch, scratch + QUANT_GROUP * LINEAR_BLOCK);             \
        }                                                                                    \
        free(scratch);                                                                       \
    }

#define DEFINE_QUANTIZED_BLOCKS(TARGET, NAME, ROW, ROWS)                                      \
    DEFINE_QUANTIZED_BLOCKS_OF_KIND(TARGET, NAME##_q8_0, WEIGHT_Q8_0, ROW, ROWS)              \
    DEFINE_QUANTIZED_BLOCKS_OF_KIND(TARGET, NAME##_q4_0, WEIGHT_Q4_0, ROW, ROWS)              \
    DEFINE_QUANTIZED_BLOCKS_OF_KIND(TARGET, NAME##_q4_1, WEIGHT_Q4_1, ROW, ROWS)              \
    DEFINE_QUANTIZED_BLOCKS_OF_KIND(TARGET, NAME##_int8_scaled, WEIGHT_INT8_SCALED, ROW, ROWS)\
    static void NAME(int kind, const void *weight, const float *x, float *y,                 \
                     const float *bias, long rows, long out, long in, long first, long end) { \
        switch (kind) {                                                                      \
        case WEIGHT_Q8_0: NAME##_q8_0(weight, x, y, bias, rows, out, in, first, end); break; \
        case WEIGHT_Q4_0: NAME##_q4_0(weight, x, y, bias, rows, out, in, first, end); break; \
        case WEIGHT_Q4_1: NAME##_q4_1(weight, x, y, bias, rows, out, in, first, end); break; \
        default: NAME##_int8_scaled(weight, x, y, bias, rows, out, in, first, end);          \
        }                                                                                    \
    }
