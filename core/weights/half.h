/* IEEE half precision to single precision, exact (subnormals, infinities and NaN payloads
 * included): the float16 scales and minimums of GGUF's quantization blocks. Included by the
 * block decoder (dequantize.c) and the linear kernel that reads blocks (layers/kernels.c). */
#ifndef SHARDLINE_HALF_H
#define SHARDLINE_HALF_H

#include <stdint.h>
#include <string.h>

static inline float shardline_half_to_float(uint16_t half) {
    uint32_t sign = (half & 0x8000u) << 16, exponent = (half >> 10) & 0x1fu;
    uint32_t mantissa = half & 0x3ffu, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | mantissa << 13;
    } else if (exponent != 0) {
        bits = sign | (exponent + 112) << 23 | mantissa << 13;
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: mantissa * 2^-24, normalized */
        uint32_t shift = 0;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            shift++;
        }
        bits = sign | (113 - shift) << 23 | (mantissa & 0x3ffu) << 13;
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

#endif
