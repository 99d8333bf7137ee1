/* The AVX-512 linear kernels of weights held in quantization blocks (quantized_blocks.h: the
 * layout and why the sums are the float32 kernel's), for kernels.c, which includes this after
 * its own blocked kernels (LINEAR_BLOCK, tail_mask, AVX512). */

/* The weights of inputs 2p and 2p + 1 (the nibble kinds; Q5_K's nibbles with their fifth
 * bits), or of input p (the byte kinds: first only), for outputs 16k..16k+15 of a group
 * (values: its values; scale, minimum: those outputs', of p's half for INT8_SCALED and
 * Q6_K). */
AVX512 static inline __attribute__((always_inline)) void widen_16(
    const int kind, const uint8_t *values, long p, int k, __m512 scale, __m512 minimum,
    __m512 *first, __m512 *second) {
    const __m128i *bytes = (const __m128i *)(values + p * LINEAR_BLOCK + 16 * k);
    if (holds_bytes(kind)) {
        __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes)));
        *first = adds_offset(kind) ? _mm512_fmadd_ps(scale, q, minimum) : _mm512_mul_ps(scale, q);
        return;
    }
    __m512i both = _mm512_cvtepu8_epi32(_mm_loadu_si128(bytes));
    __m512i low = _mm512_and_si512(both, _mm512_set1_epi32(15));
    __m512i high = _mm512_srli_epi32(both, 4);
    if (holds_fifth_bits(kind)) { /* 16 more where an output's bit is set (16 bits a mask) */
        const uint8_t *fifth = group_fifth_bits(values) + 2 * p * (LINEAR_BLOCK / 8) + 2 * k;
        uint16_t first_bits, second_bits;
        memcpy(&first_bits, fifth, sizeof first_bits);
        memcpy(&second_bits, fifth + LINEAR_BLOCK / 8, sizeof second_bits);
        low = _mm512_mask_or_epi32(low, first_bits, low, _mm512_set1_epi32(16));
        high = _mm512_mask_or_epi32(high, second_bits, high, _mm512_set1_epi32(16));
    }
    if (kind == WEIGHT_Q4_0) {
        low = _mm512_sub_epi32(low, _mm512_set1_epi32(8));
        high = _mm512_sub_epi32(high, _mm512_set1_epi32(8));
    }
    if (adds_offset(kind)) { /* scale * q exact: one rounding, the decoder's */
        *first = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(low), minimum);
        *second = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(high), minimum);
        return;
    }
    *first = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(low));
    *second = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(high));
}

/* A group's scales (and minimums) for outputs 16k..16k+15: of its inputs' first or second
 * half for INT8_SCALED and Q6_K (the same for both halves in the other kinds). */
AVX512 static inline __attribute__((always_inline)) void group_scales(
    const int kind, const uint8_t *group, int half, __m512 scale[4], __m512 minimum[4]) {
    if (float_scales(kind)) {
        const float *scales = group_float_scales(kind, group, half);
        const float *offsets = group_float_offsets(kind, group, half);
        for (int k = 0; k < 4; k++) {
            scale[k] = _mm512_loadu_ps(scales + 16 * k);
            minimum[k] = offsets ? _mm512_loadu_ps(offsets + 16 * k) : _mm512_setzero_ps();
        }
        return;
    }
    for (int k = 0; k < 4; k++) {
        scale[k] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(group + 32 * k)));
        minimum[k] = kind == WEIGHT_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                               (const __m256i *)(group + 128 + 32 * k)))
                                         : _mm512_setzero_ps();
    }
}

/* One row against B (1 or QUANTIZED_ROW_BLOCKS) blocks from block, block_bytes apart: y's
 * outputs (and the bias's) from 0, 64 a block but width in the last, widening as it reads, the
 * sums in registers from the first input to the last. The blocks' groups are read in turn,
 * group by group: B streams through memory at once, which one core reads faster than one
 * (a 24576 x 576 Q8_0 weight from memory, one thread: 2.1-2.3 ms a row one block at a time,
 * 1.8-1.9 four at a time; a GGUF decode, float32 inputs, alternating builds: TP=2 149-153 ->
 * 177-183 tok/s, TP=1 162-167 -> 178-184). */
AVX512 static inline __attribute__((always_inline)) void quantized_row(
    const int kind, const int B, const uint8_t *block, long block_bytes, long groups,
    const float *x, float *y, long width, const float *bias) {
    __m512 acc[QUANTIZED_ROW_BLOCKS][4];
    for (int b = 0; b < B; b++)
        for (int k = 0; k < 4; k++) acc[b][k] = _mm512_setzero_ps();
    long group_bytes = quantized_group_bytes(kind), header = quantized_header_bytes(kind);
    for (long g = 0; g < groups; g++) {
        const float *xg = x + g * QUANT_GROUP;
        for (int b = 0; b < B; b++) {
            const uint8_t *group = block + b * block_bytes + g * group_bytes;
            const uint8_t *values = group + header;
            __m512 scale[4], minimum[4];
            prefetch_group_header(kind, group);
            group_scales(kind, group, 0, scale, minimum);
            if (holds_bytes(kind)) {
                for (long i = 0; i < QUANT_GROUP; i++) {
                    if (scales_halves(kind) && i == QUANT_HALF)
                        group_scales(kind, group, 1, scale, minimum);
                    __m512 value = _mm512_set1_ps(xg[i]), w, unused;
                    for (int k = 0; k < 4; k++) {
                        widen_16(kind, values, i, k, scale[k], minimum[k], &w, &unused);
                        acc[b][k] = _mm512_fmadd_ps(w, value, acc[b][k]);
                    }
                }
                continue;
            }
            for (long p = 0; p < QUANT_GROUP / 2; p++) {
                __m512 first_value = _mm512_set1_ps(xg[2 * p]);
                __m512 second_value = _mm512_set1_ps(xg[2 * p + 1]);
                for (int k = 0; k < 4; k++) {
                    __m512 first, second;
                    widen_16(kind, values, p, k, scale[k], minimum[k], &first, &second);
                    acc[b][k] = _mm512_fmadd_ps(first, first_value, acc[b][k]);
                    acc[b][k] = _mm512_fmadd_ps(second, second_value, acc[b][k]);
                }
            }
        }
    }
    for (int b = 0; b < B; b++)
        for (int k = 0; k < 4; k++) {
            long at = b * LINEAR_BLOCK + 16 * k;
            __mmask16 lanes = tail_mask(b == B - 1 ? width : LINEAR_BLOCK, k);
            __m512 sum =
                bias ? _mm512_add_ps(acc[b][k], _mm512_maskz_loadu_ps(lanes, bias + at))
                     : acc[b][k];
            _mm512_mask_storeu_ps(y + at, lanes, sum);
        }
}

/* A group of one block widened into wide (QUANT_GROUP x LINEAR_BLOCK float32, input by
 * input), for several rows to read. */
AVX512 static inline __attribute__((always_inline)) void widen_group(const int kind,
                                                                    const uint8_t *group,
                                                                    float *wide) {
    __m512 scale[4], minimum[4];
    prefetch_group_header(kind, group);
    group_scales(kind, group, 0, scale, minimum);
    const uint8_t *values = group + quantized_header_bytes(kind);
    long steps = holds_bytes(kind) ? QUANT_GROUP : QUANT_GROUP / 2;
    for (long p = 0; p < steps; p++) {
        if (scales_halves(kind) && p == QUANT_HALF)
            group_scales(kind, group, 1, scale, minimum);
        for (int k = 0; k < 4; k++) {
            __m512 first, second;
            widen_16(kind, values, p, k, scale[k], minimum[k], &first, &second);
            long input = holds_bytes(kind) ? p : 2 * p;
            _mm512_storeu_ps(wide + input * LINEAR_BLOCK + 16 * k, first);
            if (!holds_bytes(kind))
                _mm512_storeu_ps(wide + (input + 1) * LINEAR_BLOCK + 16 * k, second);
        }
    }
}

/* R rows (x: R rows of in) against one widened group (inputs from, QUANT_GROUP of them):
 * their sums continue from sums (R x LINEAR_BLOCK; from 0 where from is 0) and go back there,
 * or at the last group to y's rows (y_stride apart, width outputs, plus the bias). */
AVX512 static inline __attribute__((always_inline)) void quantized_tile(
    const int R, const float *wide, const float *x, long in, long from, int last, float *sums,
    float *y, long y_stride, long width, const float *bias) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < 4; k++)
            acc[r][k] = from ? _mm512_loadu_ps(sums + r * LINEAR_BLOCK + 16 * k)
                             : _mm512_setzero_ps();
    for (long i = 0; i < QUANT_GROUP; i++)
        for (int k = 0; k < 4; k++) {
            __m512 w = _mm512_loadu_ps(wide + i * LINEAR_BLOCK + 16 * k);
            for (int r = 0; r < R; r++)
                acc[r][k] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * in + from + i]), acc[r][k]);
        }
    for (int r = 0; r < R; r++)
        for (int k = 0; k < 4; k++) {
            if (!last) {
                _mm512_storeu_ps(sums + r * LINEAR_BLOCK + 16 * k, acc[r][k]);
                continue;
            }
            __mmask16 lanes = tail_mask(width, k);
            __m512 sum = bias ? _mm512_add_ps(acc[r][k],
                                              _mm512_maskz_loadu_ps(lanes, bias + 16 * k))
                              : acc[r][k];
            _mm512_mask_storeu_ps(y + r * y_stride + 16 * k, lanes, sum);
        }
}

#define QUANTIZED_TILE_ROWS 4

/* Several rows against one block: each group widened once into wide, then every tile of up
 * to QUANTIZED_TILE_ROWS rows through it (sums: rows x LINEAR_BLOCK floats). */
AVX512 static inline __attribute__((always_inline)) void quantized_rows(
    const int kind, const uint8_t *block, long groups, const float *x, long in, float *y,
    long y_stride, long rows, long width, const float *bias, float *wide, float *sums) {
    long group_bytes = quantized_group_bytes(kind);
    for (long g = 0; g < groups; g++) {
        widen_group(kind, block + g * group_bytes, wide);
        int last = g == groups - 1;
        for (long r = 0; r < rows; r += QUANTIZED_TILE_ROWS) {
            long tile = rows - r < QUANTIZED_TILE_ROWS ? rows - r : QUANTIZED_TILE_ROWS;
            const float *xr = x + r * in;
            float *sr = sums + r * LINEAR_BLOCK, *yr = y + r * y_stride;
            long from = g * QUANT_GROUP;
#define TILE(R) quantized_tile(R, wide, xr, in, from, last, sr, yr, y_stride, width, bias)
            switch (tile) {
            case 4: TILE(4); break;
            case 3: TILE(3); break;
            case 2: TILE(2); break;
            default: TILE(1);
            }
#undef TILE
        }
    }
}

/* quantized_blocks(kind, weight, x, y, bias, rows, out, in, first, end): y's outputs in
 * blocks [first, end) (quantized_blocks.h). */
DEFINE_QUANTIZED_BLOCKS(AVX512, quantized_blocks, quantized_row, quantized_rows)

/* The 4-bit code kinds (WEIGHT_Q4_CODES, _F16): rows quantized to int8 (QuantizedRows) multiplied
 * by the weight's 4-bit codes in integers, 64 products a vpdpbusd (an output's 4 inputs in one
 * 32-bit lane: the layout store_q writes), exact int32 sums over each ACTIVATION_GROUP
 * inputs, which then add (scale * s) * sum + offset * (s * code sum) to an output's float32
 * sum, with the same operations in the same order in the AVX2 kernel (code_tile_avx2): the
 * same bits. */
#define AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

static int cpu_has_avx512_vnni(void) {
    return cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
}

/* How far ahead of the group it multiplies a code tile prefetches into L2: the one stream
 * of a weight's blocks (the next weight's, at its end: packed weights lie in step order) then
 * reads faster. A greedy screen of 24576 x 576 (Q8_CODES_F16) from memory, one thread, 1 row:
 * 1.69 -> 1.41 ms at 117 KB ahead (1.44 at 35 and 78, 1.41 at 196, 1.43 at 261; into L1
 * instead, 1.63-1.67; 2-17 KB ahead, no faster); the 4-bit code kinds'
 * (benchmarks/block_kernels.py, 3072 x 512) 108-111 -> 95-100 us at 1 row, 1.15-1.20x
 * faster at 4, the same at 16. */
#define CODE_BYTES_AHEAD (96 * 1024)

/* Prefetches the group_bytes that lie CODE_BYTES_AHEAD after group into L2. */
static inline void prefetch_group_ahead(const uint8_t *group, long group_bytes) {
    for (long line = 0; line < group_bytes; line += 64)
        _mm_prefetch((const char *)group + CODE_BYTES_AHEAD + line, _MM_HINT_T1);
}

/* A group of code kind KIND: the scales (which 0) or the offsets (1) of its outputs 16 k ..
 * 16 k + 15 (float16 ones widened: exact). */
AVX512 static inline __m512 code_header(const int KIND, const uint8_t *group, int which, int k) {
    if (KIND != WEIGHT_Q4_CODES)
        return _mm512_cvtph_ps(_mm256_loadu_si256(
            (const __m256i *)((const uint16_t *)group + which * LINEAR_BLOCK + 16 * k)));
    return _mm512_loadu_ps((const float *)group + which * LINEAR_BLOCK + 16 * k);
}

/* A code tile's sums (acc: R rows of a block's 64 outputs) to y's rows, y_stride apart: width
 * outputs, plus the bias. */
AVX512 static inline __attribute__((always_inline)) void store_code_sums(
    const int R, __m512 acc[][4], float *y, long y_stride, long width, const float *bias) {
    for (int r = 0; r < R; r++)
        for (int k = 0; k < 4; k++) {
            __mmask16 lanes = tail_mask(width, k);
            __m512 sum =
                bias ? _mm512_add_ps(acc[r][k], _mm512_maskz_loadu_ps(lanes, bias + 16 * k))
                     : acc[r][k];
            _mm512_mask_storeu_ps(y + r * y_stride + 16 * k, lanes, sum);
        }
}

/* R (<= 4) rows (from row `first` of xq) against one block of code kind KIND; y's rows
 * y_stride apart, width outputs, plus the bias. */
AVX512_VNNI static inline __attribute__((always_inline)) void code_tile(
    const int KIND, const int R, const uint8_t *block, long groups, const QuantizedRows *xq,
    long first, long in, float *y, long y_stride, long width, const float *bias) {
    const long group_bytes = quantized_group_bytes(KIND);
    const long header = quantized_header_bytes(KIND);
    const __m512i nibbles = _mm512_set1_epi8(15);
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < 4; k++) acc[r][k] = _mm512_setzero_ps();
    for (long g = 0; g < groups; g++) {
        const uint8_t *group = block + g * group_bytes, *values = group + header;
        prefetch_group_header(KIND, group);
        prefetch_group_ahead(group, group_bytes);
        __m512i sums[4][4];
        for (int j = 0; j < QUANT_GROUP / 8; j++) {
            if (8 * j % ACTIVATION_GROUP == 0)
                for (int r = 0; r < R; r++)
                    for (int k = 0; k < 4; k++) sums[r][k] = _mm512_setzero_si512();
            __m512i low[4], high[4];
            for (int k = 0; k < 4; k++) {
                __m512i packed = _mm512_loadu_si512(values + (j * 4 + k) * 64);
                low[k] = _mm512_and_si512(packed, nibbles);
                high[k] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibbles);
            }
            for (int r = 0; r < R; r++) {
                const int8_t *codes = xq->codes + (first + r) * in + g * QUANT_GROUP + 8 * j;
                int32_t low_quad, high_quad;
                memcpy(&low_quad, codes, sizeof low_quad);
                memcpy(&high_quad, codes + 4, sizeof high_quad);
                __m512i low_x = _mm512_set1_epi32(low_quad), high_x = _mm512_set1_epi32(high_quad);
                for (int k = 0; k < 4; k++) {
                    sums[r][k] = _mm512_dpbusd_epi32(sums[r][k], low[k], low_x);
                    sums[r][k] = _mm512_dpbusd_epi32(sums[r][k], high[k], high_x);
                }
            }
            if (8 * (j + 1) % ACTIVATION_GROUP != 0) continue;
            for (int r = 0; r < R; r++) { /* an ACTIVATION_GROUP of inputs done: scale its sums */
                long at = ((first + r) * in + g * QUANT_GROUP + 8 * j) / ACTIVATION_GROUP;
                __m512 s = _mm512_set1_ps(xq->scales[at]);
                __m512 code_sum = _mm512_set1_ps(xq->code_sums[at]);
                for (int k = 0; k < 4; k++) {
                    __m512 scale = _mm512_mul_ps(code_header(KIND, group, 0, k), s);
                    __m512 products = _mm512_cvtepi32_ps(sums[r][k]);
                    acc[r][k] = _mm512_fmadd_ps(scale, products, acc[r][k]);
                    acc[r][k] =
                        _mm512_fmadd_ps(code_header(KIND, group, 1, k), code_sum, acc[r][k]);
                }
            }
        }
    }
    store_code_sums(R, acc, y, y_stride, width, bias);
}

/* R (<= 4) rows against one block of Q8_CODES_F16 (KIND): per 4 inputs, the block's 64
 * outputs' codes (q + 128) in 4 vectors, each vpdpbusd'd with a row's 4 int8 inputs; per
 * ACTIVATION_GROUP inputs the sums less 128 times the inputs' code total (the exact sums of
 * q * code), times scale * s, added to the outputs' float32 sums. */
AVX512_VNNI static inline __attribute__((always_inline)) void code_bytes_tile(
    const int KIND, const int R, const uint8_t *block, long groups, const QuantizedRows *xq,
    long first, long in, float *y, long y_stride, long width, const float *bias) {
    const long group_bytes = quantized_group_bytes(KIND);
    const long header = quantized_header_bytes(KIND);
    const int quads = ACTIVATION_GROUP / 4;
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < 4; k++) acc[r][k] = _mm512_setzero_ps();
    for (long g = 0; g < groups; g++) {
        const uint8_t *group = block + g * group_bytes, *values = group + header;
        prefetch_group_header(KIND, group);
        prefetch_group_ahead(group, group_bytes);
        __m512 scale[4];
        for (int k = 0; k < 4; k++) scale[k] = code_header(KIND, group, 0, k);
        for (int a = 0; a < QUANT_GROUP / ACTIVATION_GROUP; a++) {
            __m512i sums[4][4];
            for (int r = 0; r < R; r++)
                for (int k = 0; k < 4; k++) sums[r][k] = _mm512_setzero_si512();
            for (int j = a * quads; j < (a + 1) * quads; j++) {
                __m512i codes_of[4];
                for (int k = 0; k < 4; k++)
                    codes_of[k] = _mm512_loadu_si512(values + (j * 4 + k) * 64);
                for (int r = 0; r < R; r++) {
                    int32_t quad;
                    memcpy(&quad, xq->codes + (first + r) * in + g * QUANT_GROUP + 4 * j,
                           sizeof quad);
                    __m512i x = _mm512_set1_epi32(quad);
                    for (int k = 0; k < 4; k++)
                        sums[r][k] = _mm512_dpbusd_epi32(sums[r][k], codes_of[k], x);
                }
            }
            for (int r = 0; r < R; r++) {
                long at = ((first + r) * in + g * QUANT_GROUP) / ACTIVATION_GROUP + a;
                __m512 s = _mm512_set1_ps(xq->scales[at]);
                __m512i lifted = _mm512_set1_epi32(128 * xq->code_totals[at]);
                for (int k = 0; k < 4; k++) {
                    __m512 products = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r][k], lifted));
                    acc[r][k] = _mm512_fmadd_ps(_mm512_mul_ps(scale[k], s), products, acc[r][k]);
                }
            }
        }
    }
    store_code_sums(R, acc, y, y_stride, width, bias);
}

/* code_blocks(weight, base, xq, y, bias, rows, out, in, first, end), code_blocks_f16 and
 * code_bytes_blocks, of Q4_CODES, Q4_CODES_F16 and Q8_CODES_F16 (quantized_blocks.h). */
DEFINE_CODE_BLOCKS(AVX512_VNNI, code_blocks, code_tile, WEIGHT_Q4_CODES)
DEFINE_CODE_BLOCKS(AVX512_VNNI, code_blocks_f16, code_tile, WEIGHT_Q4_CODES_F16)
DEFINE_CODE_BLOCKS(AVX512_VNNI, code_bytes_blocks, code_bytes_tile, WEIGHT_Q8_CODES_F16)
