/* The linear kernels of weights held in quantization blocks (quantized_blocks.h) on a CPU
 * with AVX2, FMA and F16C but no AVX-512, for kernels.c (included after its AVX2 kernels):
 * the same layout, the same widening and every output's sum in the same order as
 * quantized_linear.h, so the same bits, 8 lanes at a time. One row keeps a block's 64 sums
 * in 8 registers and widens as it reads; several rows widen each group once into a scratch
 * and take it a row at a time. */

#define AVX2_F16C __attribute__((target("avx2,fma,f16c")))

static int cpu_has_avx2_f16c(void) {
    return cpu_has_avx2_fma() && __builtin_cpu_supports("f16c");
}

#define NIBBLES_64 0x0F0F0F0F0F0F0F0FULL

/* Bit j of bits as 16 in byte j of a word (0 where it is clear): the byte copied to each of
 * the word's bytes, bit j kept in byte j, then bytes not 0 carried to their top bit. */
#define FIFTH_BITS_64(bits)                                                                    \
    (((((uint64_t)(bits) * 0x0101010101010101ULL) & 0x8040201008040201ULL) +                   \
      0x7F7F7F7F7F7F7F7FULL) & 0x8080808080808080ULL) >> 3
#define FIFTH_BITS_4(n)                                                                        \
    FIFTH_BITS_64(n), FIFTH_BITS_64(n + 1), FIFTH_BITS_64(n + 2), FIFTH_BITS_64(n + 3)
#define FIFTH_BITS_16(n) FIFTH_BITS_4(n), FIFTH_BITS_4(n + 4), FIFTH_BITS_4(n + 8), FIFTH_BITS_4(n + 12)
#define FIFTH_BITS_64_WORDS(n)                                                                 \
    FIFTH_BITS_16(n), FIFTH_BITS_16(n + 16), FIFTH_BITS_16(n + 32), FIFTH_BITS_16(n + 48)
/* FIFTH_BITS_64 of every byte (2 KiB): one load a byte where the arithmetic took five. */
static const uint64_t fifth_bits_words[256] = {
    FIFTH_BITS_64_WORDS(0), FIFTH_BITS_64_WORDS(64), FIFTH_BITS_64_WORDS(128),
    FIFTH_BITS_64_WORDS(192)};

/* A group's scales and offsets (offsets NULL: none) as float32, for the inputs of `half`
 * where the kind has a scale per half: a float32-scaled kind's own, else its float16 ones
 * widened (exact) into wide (2 x LINEAR_BLOCK), once a group rather than at every input. */
AVX2_F16C static inline __attribute__((always_inline)) void group_scales_avx2(
    const int kind, const uint8_t *group, int half, float *wide, const float **scales,
    const float **offsets) {
    if (float_scales(kind)) {
        *scales = group_float_scales(kind, group, half);
        *offsets = group_float_offsets(kind, group, half);
        return;
    }
    int parts = adds_offset(kind) ? 2 : 1;
    for (int i = 0; i < parts * LINEAR_BLOCK; i += 8)
        _mm256_storeu_ps(wide + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                       (const __m128i *)((const uint16_t *)group + i))));
    *scales = wide;
    *offsets = adds_offset(kind) ? wide + LINEAR_BLOCK : NULL;
}

/* The weights of inputs 2p and 2p + 1 (the nibble kinds, Q5_K's with their fifth bits), or
 * of input p (the byte kinds: first only), for outputs 8k..8k+7 of a group (values: its
 * values; scales, offsets: its group_scales_avx2). */
AVX2_F16C static inline __attribute__((always_inline)) void widen_8(
    const int kind, const float *scales, const float *offsets, const uint8_t *values, long p,
    int k, __m256 *first, __m256 *second) {
    __m128i bytes = _mm_loadl_epi64((const __m128i *)(values + p * LINEAR_BLOCK + 8 * k));
    __m256 scale = _mm256_loadu_ps(scales + 8 * k);
    __m256 minimum = offsets ? _mm256_loadu_ps(offsets + 8 * k) : _mm256_setzero_ps();
    if (holds_bytes(kind)) {
        __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
        *first = adds_offset(kind) ? _mm256_fmadd_ps(scale, q, minimum) : _mm256_mul_ps(scale, q);
        return;
    }
    __m256i low, high;
    if (holds_fifth_bits(kind)) { /* each value a byte, put together in a 64-bit word */
        const uint8_t *fifth = group_fifth_bits(values) + 2 * p * (LINEAR_BLOCK / 8) + k;
        uint64_t both;
        memcpy(&both, values + p * LINEAR_BLOCK + 8 * k, sizeof both);
        uint64_t first_q = (both & NIBBLES_64) | fifth_bits_words[fifth[0]];
        uint64_t second_q = ((both >> 4) & NIBBLES_64) | fifth_bits_words[fifth[LINEAR_BLOCK / 8]];
        low = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)first_q));
        high = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)second_q));
    } else {
        __m256i pair = _mm256_cvtepu8_epi32(bytes);
        low = _mm256_and_si256(pair, _mm256_set1_epi32(15));
        high = _mm256_srli_epi32(pair, 4);
    }
    if (kind == WEIGHT_Q4_0) {
        low = _mm256_sub_epi32(low, _mm256_set1_epi32(8));
        high = _mm256_sub_epi32(high, _mm256_set1_epi32(8));
    }
    if (adds_offset(kind)) { /* scale * q exact: one rounding, the decoder's */
        *first = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(low), minimum);
        *second = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(high), minimum);
        return;
    }
    *first = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(low));
    *second = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(high));
}

/* The width (<= LINEAR_BLOCK) outputs of one row against one block (y and bias at the
 * block's first output), sums in registers from the first input to the last. */
AVX2_F16C static inline __attribute__((always_inline)) void quantized_block_row_avx2(
    const int kind, const uint8_t *block, long groups, const float *x, float *y, long width,
    const float *bias) {
    __m256 acc[8];
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
    float wide_scales[2 * LINEAR_BLOCK];
    long group_bytes = quantized_group_bytes(kind), header = quantized_header_bytes(kind);
    long steps = holds_bytes(kind) ? QUANT_GROUP : QUANT_GROUP / 2;
    for (long g = 0; g < groups; g++) {
        const uint8_t *group = block + g * group_bytes, *values = group + header;
        const float *xg = x + g * QUANT_GROUP, *scales, *offsets;
        prefetch_group_header(kind, group);
        group_scales_avx2(kind, group, 0, wide_scales, &scales, &offsets);
        for (long p = 0; p < steps; p++) {
            if (scales_halves(kind) && p == QUANT_HALF)
                group_scales_avx2(kind, group, 1, wide_scales, &scales, &offsets);
            long input = holds_bytes(kind) ? p : 2 * p;
            __m256 first_value = _mm256_set1_ps(xg[input]);
            __m256 second_value = _mm256_set1_ps(holds_bytes(kind) ? 0.0f : xg[input + 1]);
            for (int k = 0; k < 8; k++) {
                __m256 first, second;
                widen_8(kind, scales, offsets, values, p, k, &first, &second);
                acc[k] = _mm256_fmadd_ps(first, first_value, acc[k]);
                if (!holds_bytes(kind)) acc[k] = _mm256_fmadd_ps(second, second_value, acc[k]);
            }
        }
    }
    float sums[LINEAR_BLOCK];
    for (int k = 0; k < 8; k++) _mm256_storeu_ps(sums + 8 * k, acc[k]);
    for (long o = 0; o < width; o++) y[o] = bias ? sums[o] + bias[o] : sums[o];
}

/* One row against B blocks from block, block_bytes apart (quantized_row's contract), one
 * block after another: 16 registers hold one block's sums. */
AVX2_F16C static inline __attribute__((always_inline)) void quantized_row_avx2(
    const int kind, const int B, const uint8_t *block, long block_bytes, long groups,
    const float *x, float *y, long width, const float *bias) {
    for (int b = 0; b < B; b++)
        quantized_block_row_avx2(kind, block + b * block_bytes, groups, x, y + b * LINEAR_BLOCK,
                                 b == B - 1 ? width : LINEAR_BLOCK,
                                 bias ? bias + b * LINEAR_BLOCK : NULL);
}

/* Several rows against one block: each group widened once into wide (QUANT_GROUP x
 * LINEAR_BLOCK), then each row's 64 sums (sums: rows x LINEAR_BLOCK) carried through it. */
AVX2_F16C static inline __attribute__((always_inline)) void quantized_rows_avx2(
    const int kind, const uint8_t *block, long groups, const float *x, long in, float *y,
    long y_stride, long rows, long width, const float *bias, float *wide, float *sums) {
    float wide_scales[2 * LINEAR_BLOCK];
    long group_bytes = quantized_group_bytes(kind), header = quantized_header_bytes(kind);
    long steps = holds_bytes(kind) ? QUANT_GROUP : QUANT_GROUP / 2;
    for (long g = 0; g < groups; g++) {
        const uint8_t *group = block + g * group_bytes, *values = group + header;
        const float *scales, *offsets;
        prefetch_group_header(kind, group);
        group_scales_avx2(kind, group, 0, wide_scales, &scales, &offsets);
        for (long p = 0; p < steps; p++) {
            if (scales_halves(kind) && p == QUANT_HALF)
                group_scales_avx2(kind, group, 1, wide_scales, &scales, &offsets);
            for (int k = 0; k < 8; k++) {
                __m256 first, second;
                widen_8(kind, scales, offsets, values, p, k, &first, &second);
                long input = holds_bytes(kind) ? p : 2 * p;
                _mm256_storeu_ps(wide + input * LINEAR_BLOCK + 8 * k, first);
                if (!holds_bytes(kind))
                    _mm256_storeu_ps(wide + (input + 1) * LINEAR_BLOCK + 8 * k, second);
            }
        }
        for (long r = 0; r < rows; r++) {
            const float *xr = x + r * in + g * QUANT_GROUP;
            float *sr = sums + r * LINEAR_BLOCK;
            __m256 acc[8];
            for (int k = 0; k < 8; k++)
                acc[k] = g ? _mm256_loadu_ps(sr + 8 * k) : _mm256_setzero_ps();
            for (long i = 0; i < QUANT_GROUP; i++) {
                __m256 value = _mm256_set1_ps(xr[i]);
                for (int k = 0; k < 8; k++)
                    acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(wide + i * LINEAR_BLOCK + 8 * k),
                                             value, acc[k]);
            }
            for (int k = 0; k < 8; k++) _mm256_storeu_ps(sr + 8 * k, acc[k]);
        }
    }
    for (long r = 0; r < rows; r++)
        for (long o = 0; o < width; o++) {
            float sum = sums[r * LINEAR_BLOCK + o];
            y[r * y_stride + o] = bias ? sum + bias[o] : sum;
        }
}

/* quantized_blocks_avx2(kind, ...): as quantized_blocks (quantized_blocks.h). */
DEFINE_QUANTIZED_BLOCKS(AVX2_F16C, quantized_blocks_avx2, quantized_row_avx2,
                        quantized_rows_avx2)

/* code_header's 8 outputs from output `at` on. */
AVX2_F16C static inline __m256 code_header_avx2(const int KIND, const uint8_t *group, int which,
                                                int at) {
    if (KIND != WEIGHT_Q4_CODES)
        return _mm256_cvtph_ps(_mm_loadu_si128(
            (const __m128i *)((const uint16_t *)group + which * LINEAR_BLOCK + at)));
    return _mm256_loadu_ps((const float *)group + which * LINEAR_BLOCK + at);
}

/* A code tile's sums (acc: R rows of outputs 32h..32h+31) to y's rows, y_stride apart: those
 * of the block's first width outputs, plus the bias. */
AVX2_F16C static inline __attribute__((always_inline)) void store_code_sums_avx2(
    const int R, __m256 acc[][4], int h, float *y, long y_stride, long width,
    const float *bias) {
    for (int r = 0; r < R; r++)
        for (int k = 0; k < 4; k++) {
            long lane = 32 * h + 8 * k;
            float sums_out[8];
            _mm256_storeu_ps(sums_out, acc[r][k]);
            for (int i = 0; i < 8 && lane + i < width; i++)
                y[r * y_stride + lane + i] = sums_out[i] + (bias ? bias[lane + i] : 0.0f);
        }
}

/* Whether a code tile of R rows of kind KIND reads each group of a block once, both halves of
 * its outputs (h) per activation group (else one half over every group, then the other: two
 * strided passes). 3072 x 512 from memory, one thread, against two passes: the float16-scaled
 * 4-bit codes 1.06-1.18x a row; Q4_CODES (float32 scale and offset, twice the header) no
 * faster (0.85x in one build), and 3 or 4 rows' sums spill in one pass (0.9x). */
static inline int code_one_pass(int KIND, int R) { return R <= 2 && KIND != WEIGHT_Q4_CODES; }

/* The code kinds on AVX2 (code_tile's arithmetic, 8 outputs a vector): each 64 bytes of codes
 * are 16 outputs' 4 inputs, a 256-bit half 8 of them; vpmaddubsw multiplies codes by int8
 * inputs and adds pairs, and vpmaddwd adds the pairs' pairs into int32 lanes: per 8 inputs, or
 * in one pass once per activation group, an int16 lane first summing half the group's products
 * (at most 8 x 15 x 127 = 15240 for 16 inputs: never saturating; in two passes the int16 sums
 * were 0.83-0.92x at 4 rows). code_group_avx2 adds activation group a of group g to acc (R
 * rows of outputs 32h..32h+31). */
_Static_assert(ACTIVATION_GROUP % 8 == 0 && ACTIVATION_GROUP / 2 * 15 * 127 <= 32767,
               "code_group_avx2's int16 lanes hold half an activation group's products");
AVX2_F16C static inline __attribute__((always_inline)) void code_group_avx2(
    const int KIND, const int R, const uint8_t *block, long g, int a, int h,
    const QuantizedRows *xq, long first, long in, __m256 acc[][4]) {
    const uint8_t *group = block + g * quantized_group_bytes(KIND);
    const uint8_t *values = group + quantized_header_bytes(KIND);
    const __m256i nibbles = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const int eights = ACTIVATION_GROUP / 8;
    __m256i sums[4][4];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < 4; k++) sums[r][k] = _mm256_setzero_si256();
    for (int j = a * eights; j < (a + 1) * eights; j++) {
        __m256i low[4], high[4];
        for (int k = 0; k < 4; k++) { /* vector k: outputs 32h + 8k .. + 7 */
            int sixteen = 2 * h + k / 2, half = k % 2;
            __m256i packed = _mm256_loadu_si256(
                (const __m256i *)(values + (j * 4 + sixteen) * 64 + 32 * half));
            low[k] = _mm256_and_si256(packed, nibbles);
            high[k] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibbles);
        }
        for (int r = 0; r < R; r++) {
            const int8_t *codes = xq->codes + (first + r) * in + g * QUANT_GROUP + 8 * j;
            int32_t low_quad, high_quad;
            memcpy(&low_quad, codes, sizeof low_quad);
            memcpy(&high_quad, codes + 4, sizeof high_quad);
            __m256i low_x = _mm256_set1_epi32(low_quad);
            __m256i high_x = _mm256_set1_epi32(high_quad);
            for (int k = 0; k < 4; k++) {
                __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(low[k], low_x),
                                                _mm256_maddubs_epi16(high[k], high_x));
                sums[r][k] = code_one_pass(KIND, R) ? _mm256_add_epi16(sums[r][k], both)
                                    : _mm256_add_epi32(sums[r][k], _mm256_madd_epi16(both, ones));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        long at = ((first + r) * in + g * QUANT_GROUP) / ACTIVATION_GROUP + a;
        __m256 s = _mm256_set1_ps(xq->scales[at]);
        __m256 code_sum = _mm256_set1_ps(xq->code_sums[at]);
        for (int k = 0; k < 4; k++) {
            int lane = 32 * h + 8 * k;
            __m256 scale = _mm256_mul_ps(code_header_avx2(KIND, group, 0, lane), s);
            __m256 products = _mm256_cvtepi32_ps(code_one_pass(KIND, R)
                                                     ? _mm256_madd_epi16(sums[r][k], ones)
                                                        : sums[r][k]);
            __m256 offset = code_header_avx2(KIND, group, 1, lane);
            acc[r][k] = _mm256_fmadd_ps(scale, products, acc[r][k]);
            acc[r][k] = _mm256_fmadd_ps(offset, code_sum, acc[r][k]);
        }
    }
}

/* code_bytes_tile's step on AVX2 (as code_group_avx2), 8 outputs a vector: each code's q (the
 * byte less 128) splits into |q| (0..128, unsigned) and its sign, moved onto the input
 * (vpsignb), so that vpmaddubsw's pairs stay within int16 (at most 2 x 128 x 127); vpmaddwd
 * adds the pairs' pairs: the int32 sums of q * code that code_bytes_tile reaches through the
 * codes' totals, the same bits. */
AVX2_F16C static inline __attribute__((always_inline)) void code_bytes_group_avx2(
    const int KIND, const int R, const uint8_t *block, long g, int a, int h,
    const QuantizedRows *xq, long first, long in, __m256 acc[][4]) {
    const uint8_t *group = block + g * quantized_group_bytes(KIND);
    const uint8_t *values = group + quantized_header_bytes(KIND);
    const __m256i lift = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    const int quads = ACTIVATION_GROUP / 4;
    __m256i sums[4][4];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < 4; k++) sums[r][k] = _mm256_setzero_si256();
    for (int j = a * quads; j < (a + 1) * quads; j++) {
        __m256i q[4], magnitude[4];
        for (int k = 0; k < 4; k++) { /* vector k: outputs 32h + 8k .. + 7 */
            int sixteen = 2 * h + k / 2, half = k % 2;
            q[k] = _mm256_xor_si256(
                _mm256_loadu_si256((const __m256i *)(values + (j * 4 + sixteen) * 64 + 32 * half)),
                lift);
            magnitude[k] = _mm256_abs_epi8(q[k]);
        }
        for (int r = 0; r < R; r++) {
            int32_t quad;
            memcpy(&quad, xq->codes + (first + r) * in + g * QUANT_GROUP + 4 * j, sizeof quad);
            __m256i x = _mm256_set1_epi32(quad);
            for (int k = 0; k < 4; k++) {
                __m256i pairs = _mm256_maddubs_epi16(magnitude[k], _mm256_sign_epi8(x, q[k]));
                sums[r][k] = _mm256_add_epi32(sums[r][k], _mm256_madd_epi16(pairs, ones));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        long at = ((first + r) * in + g * QUANT_GROUP) / ACTIVATION_GROUP + a;
        __m256 s = _mm256_set1_ps(xq->scales[at]);
        for (int k = 0; k < 4; k++) {
            __m256 scale = code_header_avx2(KIND, group, 0, 32 * h + 8 * k);
            __m256 products = _mm256_cvtepi32_ps(sums[r][k]);
            acc[r][k] = _mm256_fmadd_ps(_mm256_mul_ps(scale, s), products, acc[r][k]);
        }
    }
}

/* Activation group a of group g of one block, for outputs 32h..32h+31 (acc: R rows), by
 * code_bytes_group_avx2 for WEIGHT_Q8_CODES_F16, else code_group_avx2. */
AVX2_F16C static inline __attribute__((always_inline)) void code_step_avx2(
    const int KIND, const int R, const uint8_t *block, long g, int a, int h,
    const QuantizedRows *xq, long first, long in, __m256 acc[][4]) {
    if (a == 0 && h == 0) prefetch_group_header(KIND, block + g * quantized_group_bytes(KIND));
    if (KIND == WEIGHT_Q8_CODES_F16)
        code_bytes_group_avx2(KIND, R, block, g, a, h, xq, first, in, acc);
    else
        code_group_avx2(KIND, R, block, g, a, h, xq, first, in, acc);
}

/* code_tile and code_bytes_tile on AVX2 (the same bits): R rows of xq against one block, in
 * one pass or two (code_one_pass); each output's sum takes the same steps in the same order. */
AVX2_F16C static inline __attribute__((always_inline)) void code_tile_avx2(
    const int KIND, const int R, const uint8_t *block, long groups, const QuantizedRows *xq,
    long first, long in, float *y, long y_stride, long width, const float *bias) {
    const int activation_groups = QUANT_GROUP / ACTIVATION_GROUP;
    if (!code_one_pass(KIND, R)) {
        for (int h = 0; h < 2; h++) {
            __m256 acc[4][4]; /* row r's outputs 32h + 8k .. + 7 */
            for (int r = 0; r < R; r++)
                for (int k = 0; k < 4; k++) acc[r][k] = _mm256_setzero_ps();
            for (long g = 0; g < groups; g++)
#pragma GCC unroll 4
                for (int a = 0; a < activation_groups; a++)
                    code_step_avx2(KIND, R, block, g, a, h, xq, first, in, acc);
            store_code_sums_avx2(R, acc, h, y, y_stride, width, bias);
        }
        return;
    }
    __m256 acc[2][4][4]; /* [h][r][k] */
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < R; r++)
            for (int k = 0; k < 4; k++) acc[h][r][k] = _mm256_setzero_ps();
    for (long g = 0; g < groups; g++)
#pragma GCC unroll 4
        for (int a = 0; a < activation_groups; a++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
                code_step_avx2(KIND, R, block, g, a, h, xq, first, in, acc[h]);
    for (int h = 0; h < 2; h++) store_code_sums_avx2(R, acc[h], h, y, y_stride, width, bias);
}

/* code_blocks, code_blocks_f16 and code_bytes_blocks on AVX2. */
DEFINE_CODE_BLOCKS(AVX2_F16C, code_blocks_avx2, code_tile_avx2, WEIGHT_Q4_CODES)
DEFINE_CODE_BLOCKS(AVX2_F16C, code_blocks_f16_avx2, code_tile_avx2, WEIGHT_Q4_CODES_F16)
DEFINE_CODE_BLOCKS(AVX2_F16C, code_bytes_blocks_avx2, code_tile_avx2, WEIGHT_Q8_CODES_F16)
