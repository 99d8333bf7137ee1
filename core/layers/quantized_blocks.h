/* Linear weights held in a GGUF file's own quantization blocks, for kernels.c: what a weight
 * of each kind holds, and how it is made from the file's bytes (portable C; the kernels that
 * read them are quantized_linear.h, AVX-512, and quantized_linear_avx2.h, AVX2 with F16C).
 *
 * A rank that reads a GGUF file for these kernels keeps, with each weight it decodes, the
 * blocks it decoded it from (gguf_blocks.h splits every type), and holds the weight so
 * (pack_file_blocks): in Q4_0 or Q4_1 blocks where the file's are of that type, in Q8_0
 * blocks where they are Q8_0 or another type of one float16 scale per 32 weights and no
 * offset (Q4_0, Q5_0, IQ4_NL: d * q', q' an int8), 0.56, 0.63 or 1.06 bytes a weight; Q4_K
 * as Q4_K: nibbles with a float32 scale and offset per 32 inputs, 0.75 bytes a weight; Q5_K
 * and Q5_1 (and Q4_K with Q4_1 among them) as Q5_K: Q4_K's with a fifth bit a value, 0.88
 * bytes a weight; Q6_K and Q3_K (and the Q8_0 kind's types among them) as Q6_K: int8 q with
 * a float32 scale per 16 inputs, 1.25 bytes a weight; any other type, or parts of several
 * types no other kind holds all of (a merged projection's), as INT8_SCALED: each block
 * split into int8 q and a float32 scale and offset per 16 inputs, widened as scale * q +
 * offset (a subtracted offset held negated: the same sum), 1.5 bytes a weight. The kernels
 * widen each weight to the value dequantize.c gives (a float32 multiply, then an add where
 * the type has an offset) and multiply as the float32 kernel does: each output's sum has the
 * same terms in the same order, so a layer's results are the float32 layer's, bit for bit,
 * from a fraction of the bytes. Where a kind adds an offset they widen with one fused
 * multiply-add: scale * q is exact for every type with one (a float16 times a 6-bit scale
 * times a 5-bit q: at most 22 significant bits), so its single rounding is the decoder's
 * rounding of the sum (one operation a weight fewer, on the path a batch-1 step is bound
 * by). Every value so held, as the kernels read it back, is checked against the one loaded,
 * bit for bit, and its product for exactness where an offset is added.
 *
 * Layout: block after block of LINEAR_BLOCK outputs (the last padded with outputs of scale 0,
 * never stored), each group of QUANT_GROUP inputs in turn: the block's scales (float16), for
 * Q4_1 its minimums (float16), then the values, input by input, the block's outputs side by
 * side: Q8_0 one int8 each; Q4_0 and Q4_1 a byte for each pair of inputs, the first in its low
 * nibble. Q4_K: the scales (float32), the offsets (float32, negated minimums), then nibbles as
 * Q4_1's. Q5_K: Q4_K's, then each input's fifth bits, 8 bytes an input (output o's in bit
 * o % 8 of byte o / 8). INT8_SCALED: the scales (float32) of the group's first 16 inputs,
 * then of its last 16, the offsets so, then one int8 each. Q6_K: as INT8_SCALED without the
 * offsets.
 *
 * The code kinds (model.activation_dtype: int8): Q4_CODES_F16 holds Q4_0 and Q4_1 blocks as
 * 4-bit codes 0..15 with a float16 scale and offset per 32 inputs (the file's d and m; Q4_0's
 * -8 as an offset of -8 d, where float16 holds it: else the weight takes Q4_0's own kind,
 * exact), 0.63 bytes a weight; Q4_CODES holds Q4_K's (whose scales are float32 products)
 * with a float32 scale and offset, 0.75 bytes a weight; Q8_CODES_F16 holds the types of one
 * float16 scale per 32 weights and no offset but Q4_0 (Q8_0, Q5_0, IQ4_NL) as 8-bit codes
 * q + 128 (0..255) with the file's scale, 1.06 bytes a weight, as Q8_0. The kernels never
 * widen them: each row of inputs is quantized to int8 per ACTIVATION_GROUP (quantize_rows)
 * and multiplied by the codes in integers (exact int32 sums, then per 16 inputs in float32
 * scale * s * sum + offset * s * code sum; for Q8_CODES_F16, whose sum of (q + 128) * c less
 * 128 times the codes' total is the exact int32 sum of q * c, scale * s times that): no
 * longer the float32 layer's bits. Layout: the scales and offsets (Q4_1's float16 ones, or
 * Q4_K's float32; Q8_CODES_F16 its float16 scales alone), then for each 8 inputs of the
 * group and each 16 outputs, 64 bytes: output o's 4 bytes at 4 o, byte i holding input i of
 * the 8 in its low nibble and input 4 + i in its high one (vpdpbusd's operand: an output's 4
 * inputs in one 32-bit lane); Q8_CODES_F16: for each 4 inputs and each 16 outputs, 64 bytes,
 * output o's 4 codes at 4 o. */

#include "gguf_blocks.h"

/* How a blocked weight holds its values (the module's WEIGHT_* constants). */
enum {
    WEIGHT_FLOAT32,
    WEIGHT_BFLOAT16,
    WEIGHT_Q8_0,
    WEIGHT_Q4_0,
    WEIGHT_Q4_1,
    WEIGHT_INT8_SCALED,
    WEIGHT_Q4_K,
    WEIGHT_Q6_K,
    WEIGHT_Q5_K,
    WEIGHT_Q4_CODES,
    WEIGHT_Q4_CODES_F16,
    WEIGHT_Q8_CODES_F16,
    WEIGHT_SEGMENTED,
    WEIGHT_KINDS
};

#define QUANT_GROUP 32
#define QUANT_HALF (QUANT_GROUP / 2)
/* Full blocks one row goes through at once (a kernel's ROW below). */
#define QUANTIZED_ROW_BLOCKS 4

/* Whether a kind is one of quantization blocks (one layout for the whole weight). */
static inline int is_quantized(int kind) { return kind >= WEIGHT_Q8_0 && kind < WEIGHT_SEGMENTED; }

/* Whether a weight held as kind is read by the block kernels: a kind of blocks, or segments
 * of them. */
static inline int reads_blocks(int kind) { return is_quantized(kind) || kind == WEIGHT_SEGMENTED; }

/* A weight whose blocks of outputs are held in more than one kind (WEIGHT_SEGMENTED: a merged
 * projection whose parts' file types no one cheaper kind holds together, a Q4_K_M file's
 * Q4_K queries and Q6_K values): this table, then each segment's blocks in its kind, one
 * segment after the other. Segment i holds blocks [end_block of i - 1 (0 for the first),
 * end_block). 64 bytes, so the segments stay on cache lines. */
#define SEGMENTS_MAX 7
typedef struct {
    int32_t count, unused;
    struct {
        int32_t kind, end_block;
    } segment[SEGMENTS_MAX];
} SegmentTable;

/* Whether a kind holds codes multiplied by int8 inputs (model.activation_dtype: int8). */
static inline int is_code_kind(int kind) {
    return kind == WEIGHT_Q4_CODES || kind == WEIGHT_Q4_CODES_F16 || kind == WEIGHT_Q8_CODES_F16;
}

/* Whether a kind holds one byte an input (else a nibble). */
static inline int holds_bytes(int kind) {
    return kind == WEIGHT_Q8_0 || kind == WEIGHT_INT8_SCALED || kind == WEIGHT_Q6_K ||
           kind == WEIGHT_Q8_CODES_F16;
}

/* Whether a kind keeps a fifth bit of each value beside its nibble (values 0..31). */
static inline int holds_fifth_bits(int kind) { return kind == WEIGHT_Q5_K; }

/* Whether a kind has a scale (and offset) for each half of a group's inputs (else one). */
static inline int scales_halves(int kind) {
    return kind == WEIGHT_INT8_SCALED || kind == WEIGHT_Q6_K;
}

/* Whether a kind keeps float32 scales (else float16, as the file's 32-weight blocks). */
static inline int float_scales(int kind) {
    return kind == WEIGHT_Q4_K || kind == WEIGHT_Q5_K || kind == WEIGHT_Q6_K ||
           kind == WEIGHT_INT8_SCALED || kind == WEIGHT_Q4_CODES;
}

/* Whether a kind adds an offset (a minimum) to each scaled value. */
static inline int adds_offset(int kind) {
    return kind == WEIGHT_Q4_1 || kind == WEIGHT_Q4_K || kind == WEIGHT_Q5_K ||
           kind == WEIGHT_INT8_SCALED || kind == WEIGHT_Q4_CODES || kind == WEIGHT_Q4_CODES_F16;
}

/* Bytes of one block's group: scales (and minimums), then the values. */
static inline long quantized_header_bytes(int kind) {
    long per_output = float_scales(kind) ? (long)sizeof(float) : 2;
    return per_output * (scales_halves(kind) ? 2 : 1) * (adds_offset(kind) ? 2 : 1) * LINEAR_BLOCK;
}

/* A float32-scaled kind's scales of a group's outputs for the inputs of `half` (both halves'
 * where the kind has one), and their offsets after all of its scales (NULL: none). */
static inline const float *group_float_scales(int kind, const uint8_t *group, int half) {
    return (const float *)group + (scales_halves(kind) ? half * LINEAR_BLOCK : 0);
}
static inline const float *group_float_offsets(int kind, const uint8_t *group, int half) {
    if (!adds_offset(kind)) return NULL;
    return group_float_scales(kind, group, half) + (scales_halves(kind) ? 2 : 1) * LINEAR_BLOCK;
}
/* Where a group's fifth bits start, after its nibbles (values: the group's values). */
static inline const uint8_t *group_fifth_bits(const uint8_t *values) {
    return values + QUANT_GROUP / 2 * LINEAR_BLOCK;
}
static inline long quantized_group_bytes(int kind) {
    long values = holds_bytes(kind) ? QUANT_GROUP * LINEAR_BLOCK : QUANT_GROUP / 2 * LINEAR_BLOCK;
    long fifth_bits = holds_fifth_bits(kind) ? QUANT_GROUP * LINEAR_BLOCK / 8 : 0;
    return quantized_header_bytes(kind) + values + fifth_bits;
}

/* A group's scales and offsets (its header) asked into the L1 cache before the kernels read
 * any of it. The kinds of a scale per half group read the second half's only after the first
 * half's values, behind lines the hardware prefetcher has passed: a 3072x512 INT8_SCALED
 * weight streamed from memory took 185-190 us a row without this, 100-102 with it (Q6_K,
 * Q8_0, Q4_K, Q4_0 the same either way; one thread, interleaved runs). */
static inline void prefetch_group_header(int kind, const uint8_t *group) {
    for (long line = 0; line < quantized_header_bytes(kind); line += 64)
        __builtin_prefetch(group + line, 0, 3);
}

/* Bytes of a quantized weight of out x in (in a multiple of QUANT_GROUP). */
static inline long quantized_bytes(int kind, long out, long in) {
    return (out + LINEAR_BLOCK - 1) / LINEAR_BLOCK * (in / QUANT_GROUP) *
           quantized_group_bytes(kind);
}

/* One weight from its block's scale, minimum and q, as dequantize.c computes it. */
static inline float widened(int kind, float scale, float minimum, int q) {
    if (adds_offset(kind)) return scale * (float)q + minimum;
    if (kind == WEIGHT_Q4_0) return scale * (float)(q - 8);
    if (kind == WEIGHT_Q8_CODES_F16) return scale * (float)(q - 128);
    return scale * (float)q;
}

static inline uint32_t bits_of(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* Whether a value held is the one loaded: the same bits, or both NaN. */
static inline int same_value(float held, float loaded) {
    return bits_of(held) == bits_of(loaded) || (held != held && loaded != loaded);
}

/* Whether the kernels widen q held as kind with scale and minimum to the loaded value (the
 * code kind: its value, whose zeros may differ in sign): the decoder's value is it, and
 * where an offset is added (one fused multiply-add in the kernels) scale * q is exact, so
 * that fusing rounds as the decoder does (a finite scale's product, in double, is exact). */
static inline int holds_value(int kind, float scale, float minimum, int q, float loaded) {
    float held = widened(kind, scale, minimum, q);
    /* The code kinds never widen: a zero's sign (Q4_0's -8 scales added back to 8 scales
     * give +0 where the decoder's scale * 0 may be -0) changes none of its sums. */
    if (is_code_kind(kind) && held == 0.0f && loaded == 0.0f) return 1;
    if (!same_value(held, loaded)) return 0;
    if (!adds_offset(kind) || !isfinite(scale)) return 1;
    return (double)(scale * (float)q) == (double)scale * (double)q;
}

/* Rows of x as the code kinds multiply them (is_code_kind): each row's inputs as int8
 * codes, per ACTIVATION_GROUP inputs a scale s (x ~ s * code: the group's largest |x| / 127,
 * each code x / s rounded to nearest, ties to even), the sum of its codes (code_totals) and
 * s times that sum. A group of zeros has s 0; one with a value not finite has s NaN and
 * codes 0 (its sums are NaN, as the float32 layer's would be). */
#define ACTIVATION_GROUP 16
typedef struct {
    int8_t *codes;             /* rows x in */
    float *scales, *code_sums; /* rows x in / ACTIVATION_GROUP each */
    int32_t *code_totals;      /* as many */
} QuantizedRows;

/* Floats of space QuantizedRows of rows x in take (quantized_rows_in), in a multiple of
 * ACTIVATION_GROUP. */
static inline long quantized_rows_floats(long rows, long in) {
    return rows * in / 4 + 3 * rows * (in / ACTIVATION_GROUP);
}

/* QuantizedRows of rows x in laid out in space of quantized_rows_floats(rows, in) floats. */
static inline QuantizedRows quantized_rows_in(float *space, long rows, long in) {
    long groups = in / ACTIVATION_GROUP;
    QuantizedRows xq = {.scales = space, .code_sums = space + rows * groups,
                        .code_totals = (int32_t *)(space + 2 * rows * groups),
                        .codes = (int8_t *)(space + 3 * rows * groups)};
    return xq;
}

/* The largest |x| of an ACTIVATION_GROUP of inputs; *finite: whether every one is finite. */
static inline float group_largest(const float *xg, int *finite) {
    float largest = 0.0f;
    *finite = 1;
    for (int i = 0; i < ACTIVATION_GROUP; i++) {
        largest = fmaxf(largest, fabsf(xg[i]));
        *finite &= isfinite(xg[i]) != 0;
    }
    return largest;
}

static void quantize_rows(const float *x, long rows, long in, QuantizedRows *out) {
    long groups = in / ACTIVATION_GROUP;
    for (long r = 0; r < rows; r++)
        for (long g = 0; g < groups; g++) {
            const float *xg = x + r * in + g * ACTIVATION_GROUP;
            int8_t *codes = out->codes + r * in + g * ACTIVATION_GROUP;
            int finite;
            float largest = group_largest(xg, &finite);
            float scale = finite ? largest / 127.0f : NAN;
            int sum = 0;
            for (int i = 0; i < ACTIVATION_GROUP; i++) {
                long code = finite && scale > 0.0f ? lrintf(xg[i] / scale) : 0;
                code = code > 127 ? 127 : code < -127 ? -127 : code;
                codes[i] = (int8_t)code;
                sum += (int)code;
            }
            out->scales[r * groups + g] = scale;
            out->code_sums[r * groups + g] = scale * (float)sum;
            out->code_totals[r * groups + g] = sum;
        }
}

/* The most |code| of a row quantized twice (quantize_rows_twice): 127 steps of 256. */
#define TWICE_STEPS 32512

/* Rows of x quantized twice, to about 16 bits, for a greedy screen's integer dot products:
 * per ACTIVATION_GROUP a step s (the group's largest |x| / TWICE_STEPS) and x / s rounded to
 * nearest, c = 256 c1 + c2 (|c1| <= 127, -128 <= c2 <= 127), so that x~ = s c = 256 s c1 +
 * s c2; out's row 2 r holds row r's c1 with scale 256 s (exact) and row 2 r + 1 its c2 with
 * scale s (as quantize_rows lays rows out: out has 2 rows of x's each). Per row r, in float32
 * rounded up, spread[r] >= ||x - x~|| and size[r] >= ||x||, ||256 s c1|| + ||s c2|| (L2 norms,
 * computed in float64); both NaN where the row has a value that is not finite (its groups
 * then have scale NaN and codes 0, as quantize_rows gives them). */
static void quantize_rows_twice(const float *x, long rows, long in, QuantizedRows *out,
                                float *spread, float *size) {
    long groups = in / ACTIVATION_GROUP;
    for (long r = 0; r < rows; r++) {
        double misses = 0.0, squares = 0.0, first = 0.0, second = 0.0;
        int finite_row = 1;
        for (long g = 0; g < groups; g++) {
            const float *xg = x + r * in + g * ACTIVATION_GROUP;
            int finite;
            float largest = group_largest(xg, &finite);
            finite_row &= finite;
            float step = finite ? largest / (float)TWICE_STEPS : NAN;
            int high_sum = 0, low_sum = 0;
            for (int i = 0; i < ACTIVATION_GROUP; i++) {
                long code = finite && step > 0.0f ? lrintf(xg[i] / step) : 0;
                code = code > TWICE_STEPS ? TWICE_STEPS : code < -TWICE_STEPS ? -TWICE_STEPS : code;
                long high = (code + 128 + 32768) / 256 - 128; /* floor((code + 128) / 256) */
                long low = code - 256 * high;
                out->codes[2 * r * in + g * ACTIVATION_GROUP + i] = (int8_t)high;
                out->codes[(2 * r + 1) * in + g * ACTIVATION_GROUP + i] = (int8_t)low;
                high_sum += (int)high, low_sum += (int)low;
                double value = xg[i], held = (double)step * (double)code;
                double high_part = 256.0 * (double)step * (double)high;
                double low_part = (double)step * (double)low;
                misses += (value - held) * (value - held), squares += value * value;
                first += high_part * high_part, second += low_part * low_part;
            }
            long at = 2 * r * groups + g;
            out->scales[at] = 256.0f * step, out->scales[at + groups] = step;
            out->code_totals[at] = high_sum, out->code_totals[at + groups] = low_sum;
            out->code_sums[at] = 256.0f * step * (float)high_sum;
            out->code_sums[at + groups] = step * (float)low_sum;
        }
        double parts = sqrt(first) + sqrt(second), whole = sqrt(squares);
        /* 1e-6 above: float64's rounding of these is ~1e-15 of them, float32's 6e-8 */
        spread[r] = finite_row ? (float)(sqrt(misses) * (1.0 + 1e-6)) : NAN;
        size[r] = finite_row ? (float)((parts > whole ? parts : whole) * (1.0 + 1e-6)) : NAN;
    }
}

/* Whether blocks of type are held as kind: INT8_SCALED holds every type; Q8_0 those of one
 * float16 scale per 32 weights (at the block's start) and no offset (Q8_0, Q4_0, Q5_0,
 * IQ4_NL); Q6_K those and the ones of a scale per 16 and no offset (Q6_K, Q3_K); Q5_K those
 * of a scale and offset per 32 and values 0..31 (Q5_K, Q5_1, Q4_K, Q4_1); Q4_0, Q4_1 and
 * Q4_K their own. */
static int holds_type(int kind, const GGUFType *type) {
    const char *name = type->name;
    int one_scale = !strcmp(name, "Q8_0") || !strcmp(name, "Q4_0") || !strcmp(name, "Q5_0") ||
                    !strcmp(name, "IQ4_NL");
    switch (kind) {
    case WEIGHT_INT8_SCALED: return 1;
    case WEIGHT_Q8_0: return one_scale;
    case WEIGHT_Q4_0: return !strcmp(name, "Q4_0");
    case WEIGHT_Q4_1: return !strcmp(name, "Q4_1");
    case WEIGHT_Q4_K: return !strcmp(name, "Q4_K");
    case WEIGHT_Q5_K:
        return !strcmp(name, "Q5_K") || !strcmp(name, "Q5_1") || !strcmp(name, "Q4_K") ||
               !strcmp(name, "Q4_1");
    case WEIGHT_Q6_K: return one_scale || !strcmp(name, "Q6_K") || !strcmp(name, "Q3_K");
    case WEIGHT_Q4_CODES: return !strcmp(name, "Q4_K");
    case WEIGHT_Q4_CODES_F16: return !strcmp(name, "Q4_0") || !strcmp(name, "Q4_1");
    case WEIGHT_Q8_CODES_F16: return one_scale && strcmp(name, "Q4_0");
    default: return 0;
    }
}

/* q stored in a group (values: its values) for input i of output lane as kind holds it,
 * and the q the kernels read back (a nibble and a fifth bit, a byte). */
static int store_q(int kind, uint8_t *values, long lane, int i, int q) {
    if (is_code_kind(kind)) { /* 64 bytes a 16 outputs' 4 (8-bit) or 8 (4-bit) inputs */
        int inputs = kind == WEIGHT_Q8_CODES_F16 ? 4 : 8;
        long at = (i / inputs * (LINEAR_BLOCK / 16) + lane / 16) * 64 + 4 * (lane % 16) + i % 4;
        if (inputs == 4) {
            values[at] = (uint8_t)q;
            return q & 255;
        }
        values[at] |= (uint8_t)((q & 15) << (4 * (i % 8 / 4)));
        return q & 15;
    }
    if (holds_bytes(kind)) {
        values[i * LINEAR_BLOCK + lane] = (uint8_t)(int8_t)q;
        return (int8_t)q;
    }
    values[i / 2 * LINEAR_BLOCK + lane] |= (uint8_t)((q & 15) << (4 * (i % 2)));
    if (!holds_fifth_bits(kind)) return q & 15;
    uint8_t *fifth = (uint8_t *)group_fifth_bits(values) + i * LINEAR_BLOCK / 8;
    fifth[lane / 8] |= (uint8_t)(((q >> 4) & 1) << (lane % 8));
    return q & 31;
}

/* What kind adds to a split q of type to store it: 8 for Q4_0's q (-8..7) in the kinds that
 * hold it unsigned (0..15: Q4_0, whose kernels subtract it back, and Q4_CODES_F16, whose
 * offset is -8 scales); 128 for Q8_CODES_F16's (-128..127 to 0..255); else 0. */
static inline int stored_bias(int kind, const GGUFType *type) {
    if (kind == WEIGHT_Q8_CODES_F16) return 128;
    int unsigned_q4_0 = kind == WEIGHT_Q4_0 || kind == WEIGHT_Q4_CODES_F16;
    return unsigned_q4_0 && !strcmp(type->name, "Q4_0") ? 8 : 0;
}

/* Whether value is a float16's exactly (a NaN: a float16 NaN), that float16 in *half. */
static int exact_half(float value, uint16_t *half) {
    uint16_t sign = (uint16_t)(bits_of(value) >> 16 & 0x8000);
    float magnitude = fabsf(value);
    if (magnitude != magnitude || magnitude == INFINITY)
        *half = sign | (magnitude == INFINITY ? 0x7c00 : 0x7e00);
    else if (magnitude < 0x1p-14f) /* zero or subnormal: a multiple of 2^-24 under 2^-14 */
        *half = sign | (uint16_t)ldexpf(magnitude, 24);
    else {
        int exponent;
        float fraction = frexpf(magnitude, &exponent); /* [0.5, 1) x 2^exponent */
        if (exponent + 14 >= 31) return 0;             /* past 65504 */
        *half = sign | (uint16_t)((exponent + 14) << 10) |
                (uint16_t)(ldexpf(fraction, 11) - 1024.0f);
    }
    return same_value(shardline_half_to_float(*half), value);
}

/* A weight as loaded: element (r, i) at values[r * row_stride + i * column_stride] (a
 * model keeps its weights column by column: column_stride 1 is rows contiguous). */
typedef struct {
    const float *values;
    long row_stride, column_stride;
} LoadedWeight;

/* QUANT_GROUP inputs of one output (lane of its block) held as kind in group (the block's
 * group of those inputs), from a split file block of type (its bytes at raw; the inputs
 * from `within` of it); 1, or 0 where a value so held is not the one loaded (input i's at
 * loaded[i * step]). */
static int hold_group(int kind, uint8_t *group, long lane, const uint8_t *raw,
                      const GGUFType *type, const GGUFSplit *split, long within,
                      const float *loaded, long step) {
    uint8_t *values = group + quantized_header_bytes(kind);
    if (float_scales(kind)) {
        /* Each half's split scale and offset (a subtracted one negated: the same sum). */
        float *scales[2], *offsets[2];
        for (int half = 0; half < 2; half++) {
            long split_group = (within + half * QUANT_HALF) / GGUF_SPLIT;
            float offset = split->offset[split_group];
            scales[half] = (float *)group_float_scales(kind, group, half);
            offsets[half] = (float *)group_float_offsets(kind, group, half);
            scales[half][lane] = split->scale[split_group];
            if (offsets[half]) offsets[half][lane] = type->subtracts ? -offset : offset;
        }
        for (int i = 0; i < QUANT_GROUP; i++) {
            int half = i / QUANT_HALF;
            int q = store_q(kind, values, lane, i, split->q[within + i]);
            float minimum = offsets[half] ? offsets[half][lane] : 0.0f;
            if (!holds_value(kind, scales[half][lane], minimum, q, loaded[i * step])) return 0;
        }
        return 1;
    }
    /* A 32-weight block: its float16 scale (and Q4_1's minimum) as the file has them; the
     * float16 code kind holds Q4_0's -8 as an offset of -8 scales (float16 holds it exactly
     * unless it overflows, 8 d past 65504: then not held). */
    uint16_t *scales = (uint16_t *)group, *minimums = scales + LINEAR_BLOCK;
    memcpy(&scales[lane], raw, 2);
    float scale = shardline_half_to_float(scales[lane]);
    int bias = stored_bias(kind, type);
    float minimum = 0.0f;
    if (adds_offset(kind)) {
        if (bias == 0)
            memcpy(&minimums[lane], raw + 2, 2);
        else if (!exact_half(-(float)bias * scale, &minimums[lane]))
            return 0;
        minimum = shardline_half_to_float(minimums[lane]);
    }
    for (int i = 0; i < QUANT_GROUP; i++) {
        int q = split->q[within + i] + bias;
        int stored = store_q(kind, values, lane, i, q);
        if (!holds_value(kind, scale, minimum, stored, loaded[i * step])) return 0;
    }
    return 1;
}

/* Rows [first, first + rows) of a weight (out x in) held as kind in dest
 * (quantized_bytes(kind, out, in), zeroed by the caller), from the file's blocks of type of
 * those rows (row r's at raw + (r - first) * raw_stride); 1, or 0 where kind does not hold
 * type, in is not whole blocks, or a value so held is not the loaded weight's. */
static int pack_file_rows(int kind, const GGUFType *type, const uint8_t *raw, long raw_stride,
                          long first, long rows, long out, long in, const LoadedWeight *weight,
                          uint8_t *dest) {
    if (!holds_type(kind, type) || in % type->block_values != 0 || in % QUANT_GROUP != 0 ||
        first < 0 || rows < 0 || first + rows > out)
        return 0;
    long groups = in / QUANT_GROUP, group_bytes = quantized_group_bytes(kind);
    GGUFSplit split;
    for (long o = first; o < first + rows; o++) {
        const uint8_t *row = raw + (o - first) * raw_stride;
        uint8_t *block = dest + o / LINEAR_BLOCK * groups * group_bytes;
        for (long start = 0; start < in; start += type->block_values) {
            const uint8_t *bytes = row + start / type->block_values * type->block_bytes;
            type->split(bytes, &split);
            for (long within = 0; within < type->block_values; within += QUANT_GROUP) {
                long input = start + within;
                if (!hold_group(kind, block + input / QUANT_GROUP * group_bytes,
                                o % LINEAR_BLOCK, bytes, type, &split, within,
                                weight->values + o * weight->row_stride +
                                    input * weight->column_stride,
                                weight->column_stride))
                    return 0;
            }
        }
    }
    return 1;
}

/* The block kernels of one instruction set (TARGET: its function attribute; ROW: its kernel
 * of one row against 1 or QUANTIZED_ROW_BLOCKS blocks, ROWS: of several rows against one
 * block, given the kind as a constant): NAME##_q8_0, _q4_0, ... (one a kind), and NAME(kind,
 * weight, base, x, y, bias, rows, out, in, first, end), which computes y's outputs in blocks
 * [first, end) with the kind's, weight holding the blocks from block base on. One row widens
 * as it reads, QUANTIZED_ROW_BLOCKS full blocks at a time where there are that many; several
 * widen each group once for all (row by row where the scratch cannot be had: the same
 * sums). */
#define DEFINE_QUANTIZED_BLOCKS_OF_KIND(TARGET, NAME, KIND, ROW, ROWS)                       \
    TARGET static void NAME(const uint8_t *weight, long base, const float *x, float *y,       \
                            const float *bias, long rows, long out, long in, long first,     \
                            long end) {                                                      \
        long groups = in / QUANT_GROUP, block_bytes = groups * quantized_group_bytes(KIND); \
        float *scratch = rows > 1 ? aligned_alloc(64, sizeof(float) *                        \
                                                          (size_t)((QUANT_GROUP + rows) *    \
                                                                   LINEAR_BLOCK))            \
                                  : NULL;                                                    \
        for (long b = first; b < end; b++) {                                                 \
            const uint8_t *block = weight + (b - base) * block_bytes;                        \
            long width = out - b * LINEAR_BLOCK < LINEAR_BLOCK ? out - b * LINEAR_BLOCK     \
                                                               : LINEAR_BLOCK;               \
            const float *block_bias = bias ? bias + b * LINEAR_BLOCK : NULL;                 \
            if (rows == 1 && b + QUANTIZED_ROW_BLOCKS <= end &&                              \
                (b + QUANTIZED_ROW_BLOCKS) * LINEAR_BLOCK <= out) {                          \
                ROW(KIND, QUANTIZED_ROW_BLOCKS, block, block_bytes, groups, x,               \
                    y + b * LINEAR_BLOCK, LINEAR_BLOCK, block_bias);                         \
                b += QUANTIZED_ROW_BLOCKS - 1;                                               \
            } else if (scratch == NULL)                                                      \
                for (long r = 0; r < rows; r++)                                              \
                    ROW(KIND, 1, block, block_bytes, groups, x + r * in,                     \
                        y + r * out + b * LINEAR_BLOCK, width, block_bias);                  \
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
    DEFINE_QUANTIZED_BLOCKS_OF_KIND(TARGET, NAME##_q4_k, WEIGHT_Q4_K, ROW, ROWS)              \
    DEFINE_QUANTIZED_BLOCKS_OF_KIND(TARGET, NAME##_q6_k, WEIGHT_Q6_K, ROW, ROWS)              \
    DEFINE_QUANTIZED_BLOCKS_OF_KIND(TARGET, NAME##_q5_k, WEIGHT_Q5_K, ROW, ROWS)              \
    static void NAME(int kind, const void *weight, long base, const float *x, float *y,      \
                     const float *bias, long rows, long out, long in, long first, long end) { \
        void (*run)(const uint8_t *, long, const float *, float *, const float *, long, long,  \
                    long, long, long);                                                       \
        switch (kind) {                                                                      \
        case WEIGHT_Q8_0: run = NAME##_q8_0; break;                                          \
        case WEIGHT_Q4_0: run = NAME##_q4_0; break;                                          \
        case WEIGHT_Q4_1: run = NAME##_q4_1; break;                                          \
        case WEIGHT_Q4_K: run = NAME##_q4_k; break;                                          \
        case WEIGHT_Q6_K: run = NAME##_q6_k; break;                                          \
        case WEIGHT_Q5_K: run = NAME##_q5_k; break;                                          \
        default: run = NAME##_int8_scaled;                                                   \
        }                                                                                    \
        run(weight, base, x, y, bias, rows, out, in, first, end);                            \
    }

/* Code kind KIND's blocks on one instruction set (TILE: its kernel of up to 4 rows against one
 * block): NAME(weight, base, xq, y, bias, rows, out, in, first, end) computes y's outputs in
 * blocks [first, end) for xq's rows (x quantized: quantize_rows), weight holding the blocks
 * from block base on, 4 rows at a time. */
#define DEFINE_CODE_BLOCKS(TARGET, NAME, TILE, KIND)                                           \
    TARGET static void NAME(const uint8_t *weight, long base, const QuantizedRows *xq,         \
                            float *y, const float *bias, long rows, long out, long in,         \
                            long first, long end) {                                            \
        long groups = in / QUANT_GROUP;                                                        \
        long block_bytes = groups * quantized_group_bytes(KIND);                               \
        for (long b = first; b < end; b++) {                                                   \
            const uint8_t *block = weight + (b - base) * block_bytes;                          \
            long width = out - b * LINEAR_BLOCK < LINEAR_BLOCK ? out - b * LINEAR_BLOCK        \
                                                               : LINEAR_BLOCK;                 \
            const float *block_bias = bias ? bias + b * LINEAR_BLOCK : NULL;                   \
            for (long r = 0; r < rows; r += 4) {                                               \
                float *yr = y + r * out + b * LINEAR_BLOCK;                                    \
                switch (rows - r < 4 ? rows - r : 4) {                                         \
                case 4:                                                                        \
                    TILE(KIND, 4, block, groups, xq, r, in, yr, out, width, block_bias);       \
                    break;                                                                     \
                case 3:                                                                        \
                    TILE(KIND, 3, block, groups, xq, r, in, yr, out, width, block_bias);       \
                    break;                                                                     \
                case 2:                                                                        \
                    TILE(KIND, 2, block, groups, xq, r, in, yr, out, width, block_bias);       \
                    break;                                                                     \
                default:                                                                       \
                    TILE(KIND, 1, block, groups, xq, r, in, yr, out, width, block_bias);       \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }
