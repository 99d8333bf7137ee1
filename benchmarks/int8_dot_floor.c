/* What an integer dot product gives a batch-1 row of 4-bit weights on this CPU, against the
 * widening the exact block kernels do (quantized_linear.h), with nothing else around them: the
 * measurement the code kind (model.activation_dtype: int8; its kernel scales per 16 inputs,
 * this one per 32) was built on, to repeat on another CPU.
 *
 * One thread, one row x of IN inputs against an OUT x IN weight of 4-bit codes q (0..15) with a
 * float32 scale and offset per output and group of 32 inputs (Q4_1's values: scale * q +
 * offset), blocks of 64 outputs. Three kernels, each on its own layout of the same codes:
 *   widen  - today's: codes of 64 outputs side by side, input by input (a byte holds two
 *            inputs' nibbles); each widened to float32 (zero-extend, convert, one FMA with the
 *            scale and offset) and multiplied into float32 sums (one FMA). The float32 model's
 *            bits.
 *   vnni   - x quantized to int8 per group of 32 (a float scale each: round(x / s), s = max |x|
 *            / 127); codes of 16 outputs x 4 inputs in each 64 bytes, as vpdpbusd reads them (an
 *            output's 4 inputs in one 32-bit lane), two quads of inputs a byte (low and high
 *            nibbles); int32 sums per group, then scaled: s * (scale * sum(q qx) + offset *
 *            sum(qx)). Not the float32 model's bits: the activations lose precision.
 *   float32 - the same weight widened once to float32, multiplied (memory-bound reference).
 * Each weight is copied until the copies pass 256 MiB and used in turn, so every call reads
 * its weight from memory. Prints median us a call over 7 rounds, weights a nanosecond, bytes
 * read a nanosecond, each kernel's time over widen's, and the vnni row's largest difference
 * from the float32 row relative to the row's largest |y| (informational), then one JSON line.
 * It first checks the vnni row against the same integer arithmetic done in double (exit 1 on
 * a difference beyond float32 rounding).
 * x86-64 with AVX-512 F/BW and VNNI (gcc or clang).
 *
 *     cc -O3 -march=native benchmarks/int8_dot_floor.c -o /tmp/int8_dot && /tmp/int8_dot
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { OUT = 3072, IN = 512, BLOCK = 64, GROUP = 32, ROUNDS = 7 };
enum { BLOCKS = OUT / BLOCK, GROUPS = IN / GROUP };
static const size_t COPY_BYTES = (size_t)256 << 20;

/* Per block and group: 64 scales, 64 offsets (float32), then the codes (16 bytes x 64 = 1 KiB
 * of nibbles), in either layout. */
enum { HEADER_BYTES = 2 * BLOCK * 4, CODE_BYTES = BLOCK * GROUP / 2 };
enum { GROUP_BYTES = HEADER_BYTES + CODE_BYTES, WEIGHT_BYTES = BLOCKS * GROUPS * GROUP_BYTES };

static double seconds_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* Block b's group g's scales and offsets, in both layouts; returns where its codes go. */
static uint8_t *write_header(const float *scales, const float *offsets, int b, int g,
                             uint8_t *weight) {
    uint8_t *group = weight + ((size_t)b * GROUPS + g) * GROUP_BYTES;
    for (int o = 0; o < BLOCK; o++) {
        long out = (long)b * BLOCK + o;
        ((float *)group)[o] = scales[out * GROUPS + g];
        ((float *)group)[BLOCK + o] = offsets[out * GROUPS + g];
    }
    return group + HEADER_BYTES;
}

/* Today's layout: the byte of inputs 2p, 2p + 1 for output o at p * 64 + o. */
static void write_widen_layout(const uint8_t *codes, const float *scales, const float *offsets,
                               uint8_t *weight) {
    for (int b = 0; b < BLOCKS; b++)
        for (int g = 0; g < GROUPS; g++) {
            uint8_t *values = write_header(scales, offsets, b, g, weight);
            for (int p = 0; p < GROUP / 2; p++)
                for (int o = 0; o < BLOCK; o++) {
                    const uint8_t *q = codes + ((long)b * BLOCK + o) * IN + g * GROUP + 2 * p;
                    values[p * BLOCK + o] = (uint8_t)(q[0] | q[1] << 4);
                }
        }
}

/* The vnni layout: for each 16 outputs k and pair of input quads j (inputs 8j..8j+7 of the
 * group), 64 bytes: output o's byte i holds input 8j + i in its low nibble and 8j + 4 + i in
 * its high one, at 4 * o + i. */
static void write_vnni_layout(const uint8_t *codes, const float *scales, const float *offsets,
                              uint8_t *weight) {
    for (int b = 0; b < BLOCKS; b++)
        for (int g = 0; g < GROUPS; g++) {
            uint8_t *values = write_header(scales, offsets, b, g, weight);
            for (int j = 0; j < GROUP / 8; j++)
                for (int k = 0; k < BLOCK / 16; k++)
                    for (int o = 0; o < 16; o++)
                        for (int i = 0; i < 4; i++) {
                            const uint8_t *q =
                                codes + ((long)b * BLOCK + 16 * k + o) * IN + g * GROUP + 8 * j;
                            values[(j * 4 + k) * 64 + 4 * o + i] = (uint8_t)(q[i] | q[4 + i] << 4);
                        }
        }
}

__attribute__((target("avx512f,avx512bw"))) static void widen_row(const uint8_t *weight,
                                                                  const float *x, float *y) {
    for (int b = 0; b < BLOCKS; b++) {
        __m512 acc[4];
        for (int k = 0; k < 4; k++) acc[k] = _mm512_setzero_ps();
        for (int g = 0; g < GROUPS; g++) {
            const uint8_t *group = weight + ((size_t)b * GROUPS + g) * GROUP_BYTES;
            const uint8_t *values = group + HEADER_BYTES;
            const float *xg = x + g * GROUP;
            __m512 scale[4], offset[4];
            for (int k = 0; k < 4; k++) {
                scale[k] = _mm512_loadu_ps((const float *)group + 16 * k);
                offset[k] = _mm512_loadu_ps((const float *)group + BLOCK + 16 * k);
            }
            for (int p = 0; p < GROUP / 2; p++) {
                __m512 first_x = _mm512_set1_ps(xg[2 * p]);
                __m512 second_x = _mm512_set1_ps(xg[2 * p + 1]);
                for (int k = 0; k < 4; k++) {
                    __m512i both = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(values + p * BLOCK + 16 * k)));
                    __m512i low = _mm512_and_si512(both, _mm512_set1_epi32(15));
                    __m512i high = _mm512_srli_epi32(both, 4);
                    __m512 first = _mm512_fmadd_ps(scale[k], _mm512_cvtepi32_ps(low), offset[k]);
                    __m512 second = _mm512_fmadd_ps(scale[k], _mm512_cvtepi32_ps(high), offset[k]);
                    acc[k] = _mm512_fmadd_ps(first, first_x, acc[k]);
                    acc[k] = _mm512_fmadd_ps(second, second_x, acc[k]);
                }
            }
        }
        for (int k = 0; k < 4; k++) _mm512_storeu_ps(y + b * BLOCK + 16 * k, acc[k]);
    }
}

/* x quantized per group: codes (int8), scale s (x ~ s * code) and the codes' sum. */
typedef struct {
    int8_t codes[IN];
    float scale[GROUPS];
    int32_t sum[GROUPS];
} QuantizedRow;

static void quantize_row(const float *x, QuantizedRow *row) {
    for (int g = 0; g < GROUPS; g++) {
        float largest = 0;
        for (int i = 0; i < GROUP; i++) largest = fmaxf(largest, fabsf(x[g * GROUP + i]));
        float s = largest > 0 ? largest / 127.0f : 1.0f;
        int32_t sum = 0;
        for (int i = 0; i < GROUP; i++) {
            int code = (int)lrintf(x[g * GROUP + i] / s);
            row->codes[g * GROUP + i] = (int8_t)code;
            sum += code;
        }
        row->scale[g] = s;
        row->sum[g] = sum;
    }
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void vnni_row(
    const uint8_t *weight, const float *x, float *y) {
    QuantizedRow row;
    quantize_row(x, &row); /* per call: part of the kernel's time */
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int b = 0; b < BLOCKS; b++) {
        __m512 acc[4];
        for (int k = 0; k < 4; k++) acc[k] = _mm512_setzero_ps();
        for (int g = 0; g < GROUPS; g++) {
            const uint8_t *group = weight + ((size_t)b * GROUPS + g) * GROUP_BYTES;
            const uint8_t *values = group + HEADER_BYTES;
            const int8_t *codes = row.codes + g * GROUP;
            __m512i sums[4];
            for (int k = 0; k < 4; k++) sums[k] = _mm512_setzero_si512();
            for (int j = 0; j < GROUP / 8; j++) {
                int32_t low_quad, high_quad;
                memcpy(&low_quad, codes + 8 * j, 4);
                memcpy(&high_quad, codes + 8 * j + 4, 4);
                __m512i low_x = _mm512_set1_epi32(low_quad), high_x = _mm512_set1_epi32(high_quad);
                for (int k = 0; k < 4; k++) {
                    __m512i packed = _mm512_loadu_si512(values + (j * 4 + k) * 64);
                    __m512i low = _mm512_and_si512(packed, nibble);
                    __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
                    sums[k] = _mm512_dpbusd_epi32(sums[k], low, low_x);
                    sums[k] = _mm512_dpbusd_epi32(sums[k], high, high_x);
                }
            }
            __m512 s = _mm512_set1_ps(row.scale[g]);
            __m512 offset_sum = _mm512_set1_ps(row.scale[g] * (float)row.sum[g]);
            for (int k = 0; k < 4; k++) {
                __m512 scale = _mm512_mul_ps(_mm512_loadu_ps((const float *)group + 16 * k), s);
                __m512 offset = _mm512_loadu_ps((const float *)group + BLOCK + 16 * k);
                acc[k] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums[k]), acc[k]);
                acc[k] = _mm512_fmadd_ps(offset, offset_sum, acc[k]);
            }
        }
        for (int k = 0; k < 4; k++) _mm512_storeu_ps(y + b * BLOCK + 16 * k, acc[k]);
    }
}

/* The float32 weight: output by output (row-major, out x in), one dot product each. */
__attribute__((target("avx512f"))) static void float32_row(const uint8_t *weight, const float *x,
                                                           float *y) {
    const float *w = (const float *)weight;
    for (int o = 0; o < OUT; o++) {
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < IN; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(w + (long)o * IN + i), _mm512_loadu_ps(x + i),
                                  acc);
        y[o] = _mm512_reduce_add_ps(acc);
    }
}

/* The vnni row's arithmetic done in double, output by output: what vnni_row must give up to
 * float32 rounding (checks its layout and its kernel). */
static void vnni_reference(const uint8_t *codes, const float *scales, const float *offsets,
                           const float *x, float *y) {
    QuantizedRow row;
    quantize_row(x, &row);
    for (long o = 0; o < OUT; o++) {
        double total = 0;
        for (int g = 0; g < GROUPS; g++) {
            long products = 0;
            for (int i = 0; i < GROUP; i++)
                products += (long)codes[o * IN + g * GROUP + i] * row.codes[g * GROUP + i];
            total += (double)row.scale[g] * ((double)scales[o * GROUPS + g] * (double)products +
                                             (double)offsets[o * GROUPS + g] * (double)row.sum[g]);
        }
        y[o] = (float)total;
    }
}

typedef void (*RowKernel)(const uint8_t *, const float *, float *);

static int compare(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median seconds a call over ROUNDS rounds, each calling once on every copy. */
static double time_kernel(RowKernel kernel, uint8_t **copies, int count, const float *x, float *y) {
    double rounds[ROUNDS];
    for (int c = 0; c < count; c++) kernel(copies[c], x, y); /* warm-up */
    for (int r = 0; r < ROUNDS; r++) {
        double start = seconds_now();
        for (int c = 0; c < count; c++) kernel(copies[c], x, y);
        rounds[r] = (seconds_now() - start) / count;
    }
    qsort(rounds, ROUNDS, sizeof rounds[0], compare);
    return rounds[ROUNDS / 2];
}

static uint8_t **make_copies(const uint8_t *weight, size_t bytes, int *count) {
    *count = (int)(COPY_BYTES / bytes) + 2;
    uint8_t **copies = malloc(sizeof *copies * (size_t)*count);
    for (int c = 0; c < *count; c++) {
        copies[c] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        memcpy(copies[c], weight, bytes);
    }
    return copies;
}

int main(void) {
    if (!__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vnni")) {
        fprintf(stderr, "this CPU lacks AVX-512 BW or VNNI: nothing to compare\n");
        return 2;
    }
    srand(7);
    uint8_t *codes = malloc((size_t)OUT * IN);
    float *scales = malloc(sizeof(float) * OUT * GROUPS);
    float *offsets = malloc(sizeof(float) * OUT * GROUPS);
    for (long i = 0; i < (long)OUT * IN; i++) codes[i] = (uint8_t)(rand() % 16);
    for (long i = 0; i < (long)OUT * GROUPS; i++) {
        scales[i] = 0.001f + 0.01f * (float)rand() / (float)RAND_MAX;
        offsets[i] = -8.0f * scales[i];
    }
    float x[IN], y[OUT], exact[OUT];
    for (int i = 0; i < IN; i++) x[i] = (float)rand() / (float)RAND_MAX * 2.0f - 1.0f;

    uint8_t *widen_weight = aligned_alloc(64, WEIGHT_BYTES);
    uint8_t *vnni_weight = aligned_alloc(64, WEIGHT_BYTES);
    write_widen_layout(codes, scales, offsets, widen_weight);
    write_vnni_layout(codes, scales, offsets, vnni_weight);
    size_t float_bytes = sizeof(float) * OUT * IN;
    float *wide = aligned_alloc(64, float_bytes);
    for (long o = 0; o < OUT; o++)
        for (long i = 0; i < IN; i++)
            wide[o * IN + i] = scales[o * GROUPS + i / GROUP] * codes[o * IN + i] +
                               offsets[o * GROUPS + i / GROUP];

    const char *names[3] = {"widen", "vnni", "float32"};
    RowKernel kernels[3] = {widen_row, vnni_row, float32_row};
    const uint8_t *weights[3] = {widen_weight, vnni_weight, (const uint8_t *)wide};
    size_t bytes[3] = {WEIGHT_BYTES, WEIGHT_BYTES, float_bytes};
    double seconds[3];
    float32_row((const uint8_t *)wide, x, exact);
    float largest = 0, vnni_difference = 0, widen_difference = 0;
    for (int o = 0; o < OUT; o++) largest = fmaxf(largest, fabsf(exact[o]));
    widen_row(widen_weight, x, y);
    for (int o = 0; o < OUT; o++)
        widen_difference = fmaxf(widen_difference, fabsf(y[o] - exact[o]));
    vnni_row(vnni_weight, x, y);
    for (int o = 0; o < OUT; o++) vnni_difference = fmaxf(vnni_difference, fabsf(y[o] - exact[o]));
    float reference[OUT], own_difference = 0;
    vnni_reference(codes, scales, offsets, x, reference);
    for (int o = 0; o < OUT; o++)
        own_difference = fmaxf(own_difference, fabsf(y[o] - reference[o]));
    if (own_difference > 1e-4f * largest) {
        fprintf(stderr, "vnni kernel differs from its own arithmetic by %.2e: a bug\n",
                own_difference / largest);
        return 1;
    }
    for (int k = 0; k < 3; k++) {
        int count;
        uint8_t **copies = make_copies(weights[k], bytes[k], &count);
        seconds[k] = time_kernel(kernels[k], copies, count, x, y);
        for (int c = 0; c < count; c++) free(copies[c]);
        free(copies);
    }
    printf("[%d x %d] 4-bit weights (scale and offset per 32 inputs), one row, one thread, "
           "streamed from memory\n",
           OUT, IN);
    printf("%-8s %10s %10s %10s %12s\n", "kernel", "us", "weights/ns", "bytes/ns", "x widen time");
    for (int k = 0; k < 3; k++)
        printf("%-8s %10.1f %10.2f %10.2f %12.2f\n", names[k], seconds[k] * 1e6,
               (double)OUT * IN / (seconds[k] * 1e9), (double)bytes[k] / (seconds[k] * 1e9),
               seconds[k] / seconds[0]);
    printf("largest difference from float32 / largest |y|: widen %.2e, vnni %.2e\n",
           widen_difference / largest, vnni_difference / largest);
    printf("{\"us\": {\"widen\": %.2f, \"vnni\": %.2f, \"float32\": %.2f}, "
           "\"relative_difference\": {\"widen\": %.3e, \"vnni\": %.3e}}\n",
           seconds[0] * 1e6, seconds[1] * 1e6, seconds[2] * 1e6, widen_difference / largest,
           vnni_difference / largest);
    return 0;
}
