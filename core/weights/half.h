/* IEEE half precision to single precision, exact (subnormals, infinities and NaN payloads
 * included), and single to half rounded to nearest, ties to even (as numpy's astype): the
 * float16 scales and minimums of GGUF's quantization blocks. Included by the block decoder
 * (dequantize.c) and the linear kernels that read and make blocks (layers/kernels.c). */
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

/* A float32 as the nearest float16 (ties to even): past 65504 by half a unit or more,
 * infinity; below 2^-24, a subnormal or zero; NaN stays NaN (quiet, its payload's top bits). */
static inline uint16_t shardline_float_to_half(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint32_t sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) /* infinity, NaN */
        return (uint16_t)(sign | 0x7c00u |
                          (magnitude > 0x7f800000u ? 0x200u | ((magnitude >> 13) & 0x3ffu) : 0));
    if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* 65520 and up */
    if (magnitude >= 0x38800000u) { /* a normal half: 2^-14 and up; the exponent rebiased */
        uint32_t rebiased = magnitude - 0x38000000u;
        rebiased += 0xfffu + ((rebiased >> 13) & 1u); /* a carry moves the exponent on */
        return (uint16_t)(sign | rebiased >> 13);
    }
    uint32_t exponent = magnitude >> 23;
    if (exponent < 102) return (uint16_t)sign; /* below 2^-25: zero */
    /* A subnormal half: the value in units of 2^-24 (a carry to 0x400 is the least normal). */
    uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u, shift = 126 - exponent;
    uint32_t units = mantissa >> shift, rest = mantissa & ((1u << shift) - 1);
    uint32_t half_unit = 1u << (shift - 1);
    if (rest > half_unit || (rest == half_unit && (units & 1u))) units++;
    return (uint16_t)(sign | units);
}

#endif
