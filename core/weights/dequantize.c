/* GGUF block dequantization to float32 in one pass over the bytes: the same arithmetic as the
 * gguf package's numpy code (float16 scales widened to float32, the same float32 multiplies,
 * adds and subtractions in the same order: built with -ffp-contract=off, so never fused), so
 * the same bits, without numpy's per-group temporaries.
 *
 * Block layouts (GGML). Of 32 weights, a nibble byte i holding weight i (low 4 bits) and
 * weight i + 16 (high 4 bits):
 *   Q8_0:   scale d (f16), 32 int8 q                              -> d * q
 *   Q4_0:   d (f16), 16 bytes of nibbles                          -> d * (q - 8)
 *   Q4_1:   d (f16), min m (f16), 16 bytes of nibbles             -> d * q + m
 *   Q5_0:   d (f16), 32 fifth bits (u32), 16 bytes of nibbles     -> d * (q - 16)
 *   Q5_1:   d (f16), m (f16), 32 fifth bits, 16 bytes of nibbles -> d * q + m
 *   IQ4_NL: d (f16), 16 bytes of nibbles                          -> d * NONLINEAR[q]
 * Of 256 weights ("K" super-blocks; each group's scale is a float32 product, as numpy's):
 *   Q2_K: 16 bytes of 4-bit scale | 4-bit min, 64 bytes of 2-bit q, d, dmin (f16)
 *         -> (d * scale) * q - dmin * min, groups of 16
 *   Q3_K: 32 bytes of third bits h, 64 bytes of 2-bit q, 12 bytes of 6-bit scales, d (f16)
 *         -> (d * (scale - 32)) * (q - 4 * !h), groups of 16
 *   Q4_K: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
 *         -> (d * scale) * q - dmin * min, groups of 32
 *   Q5_K: as Q4_K with 32 bytes of fifth bits before the nibbles
 *   Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d (f16)
 *         -> (d * scale) * (q - 32), groups of 16
 * BF16 (one weight in 2 bytes) is widened as the gguf package does: its bits, shifted.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

enum { BLOCK = 32, SUPER_BLOCK = 256 };

/* A block's float16 at bytes (little-endian) as float32. */
static float half_to_float(const unsigned char *bytes) {
    return shardline_half_to_float((uint16_t)(bytes[0] | bytes[1] << 8));
}

static void q8_0(const unsigned char *block, float *out) {
    float scale = half_to_float(block);
    const signed char *q = (const signed char *)(block + 2);
    for (int i = 0; i < BLOCK; i++) out[i] = scale * (float)q[i];
}

static void q4_0(const unsigned char *block, float *out) {
    float scale = half_to_float(block);
    const unsigned char *q = block + 2;
    for (int i = 0; i < BLOCK / 2; i++) {
        out[i] = scale * (float)((int)(q[i] & 0x0f) - 8);
        out[i + BLOCK / 2] = scale * (float)((int)(q[i] >> 4) - 8);
    }
}

static void q4_1(const unsigned char *block, float *out) {
    float scale = half_to_float(block), low = half_to_float(block + 2);
    const unsigned char *q = block + 4;
    for (int i = 0; i < BLOCK / 2; i++) {
        out[i] = scale * (float)(q[i] & 0x0f) + low;
        out[i + BLOCK / 2] = scale * (float)(q[i] >> 4) + low;
    }
}

/* The 5-bit q of weights i and i + 16 of a Q5 block: nibbles, then fifth bits. */
static void five_bits(const unsigned char *fifth, const unsigned char *nibbles, int q[BLOCK]) {
    uint32_t high = (uint32_t)fifth[0] | (uint32_t)fifth[1] << 8 | (uint32_t)fifth[2] << 16 |
                    (uint32_t)fifth[3] << 24;
    for (int i = 0; i < BLOCK / 2; i++) {
        q[i] = (nibbles[i] & 0x0f) | (int)((high >> i) & 1) << 4;
        q[i + BLOCK / 2] = (nibbles[i] >> 4) | (int)((high >> (i + BLOCK / 2)) & 1) << 4;
    }
}

static void q5_0(const unsigned char *block, float *out) {
    float scale = half_to_float(block);
    int q[BLOCK];
    five_bits(block + 2, block + 6, q);
    for (int i = 0; i < BLOCK; i++) out[i] = scale * (float)(q[i] - 16);
}

static void q5_1(const unsigned char *block, float *out) {
    float scale = half_to_float(block), low = half_to_float(block + 2);
    int q[BLOCK];
    five_bits(block + 4, block + 8, q);
    for (int i = 0; i < BLOCK; i++) out[i] = scale * (float)q[i] + low;
}

/* IQ4_NL's 16 levels (GGML's kvalues_iq4nl). */
static const signed char NONLINEAR[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};

static void iq4_nl(const unsigned char *block, float *out) {
    float scale = half_to_float(block);
    const unsigned char *q = block + 2;
    for (int i = 0; i < BLOCK / 2; i++) {
        out[i] = scale * (float)NONLINEAR[q[i] & 0x0f];
        out[i + BLOCK / 2] = scale * (float)NONLINEAR[q[i] >> 4];
    }
}

static void q2_k(const unsigned char *block, float *out) {
    const unsigned char *scales = block, *q = block + 16;
    float d = half_to_float(block + 80), dmin = half_to_float(block + 82);
    for (int group = 0; group < SUPER_BLOCK / 16; group++) {
        float scale = d * (float)(scales[group] & 0x0f);
        float minimum = dmin * (float)(scales[group] >> 4);
        for (int i = group * 16; i < group * 16 + 16; i++) {
            int value = q[i / 128 * 32 + i % 32] >> (2 * (i % 128 / 32)) & 3;
            out[i] = scale * (float)value - minimum;
        }
    }
}

static void q3_k(const unsigned char *block, float *out) {
    const unsigned char *high = block, *q = block + 32, *scales = block + 96;
    float d = half_to_float(block + 108);
    for (int group = 0; group < SUPER_BLOCK / 16; group++) {
        int low_bits = scales[group % 8] >> (4 * (group / 8)) & 0x0f;
        int high_bits = scales[8 + group % 4] >> (2 * (group / 4)) & 3;
        float scale = d * (float)((low_bits | high_bits << 4) - 32);
        for (int i = group * 16; i < group * 16 + 16; i++) {
            int value = q[i / 128 * 32 + i % 32] >> (2 * (i % 128 / 32)) & 3;
            int offset = (high[i % 32] >> (i / 32) & 1) ? 0 : 4;
            out[i] = scale * (float)(value - offset);
        }
    }
}

/* Q4_K's and Q5_K's 6-bit scale and min of each of 8 groups, from their 12 packed bytes. */
static void scales_and_mins(const unsigned char *packed, int scale[8], int minimum[8]) {
    for (int g = 0; g < 4; g++) {
        scale[g] = packed[g] & 0x3f;
        minimum[g] = packed[g + 4] & 0x3f;
        scale[g + 4] = (packed[g + 8] & 0x0f) | (packed[g] >> 2 & 0x30);
        minimum[g + 4] = (packed[g + 8] >> 4) | (packed[g + 4] >> 2 & 0x30);
    }
}

/* Q4_K without fifth bits (fifth NULL), Q5_K with them. */
static void k_quant_4_or_5(const unsigned char *block, const unsigned char *fifth,
                           const unsigned char *nibbles, float *out) {
    float d = half_to_float(block), dmin = half_to_float(block + 2);
    int scale[8], minimum[8];
    scales_and_mins(block + 4, scale, minimum);
    for (int group = 0; group < 8; group++) {
        float group_scale = d * (float)scale[group], group_min = dmin * (float)minimum[group];
        for (int l = 0; l < BLOCK; l++) {
            int value = nibbles[group / 2 * 32 + l] >> (4 * (group % 2)) & 0x0f;
            if (fifth != NULL) value |= (fifth[l] >> group & 1) << 4;
            out[group * BLOCK + l] = group_scale * (float)value - group_min;
        }
    }
}

static void q4_k(const unsigned char *block, float *out) {
    k_quant_4_or_5(block, NULL, block + 16, out);
}

static void q5_k(const unsigned char *block, float *out) {
    k_quant_4_or_5(block, block + 16, block + 48, out);
}

static void q6_k(const unsigned char *block, float *out) {
    const unsigned char *low = block, *high = block + 128;
    const signed char *scales = (const signed char *)(block + 192);
    float d = half_to_float(block + 208);
    for (int group = 0; group < SUPER_BLOCK / 16; group++) {
        float scale = d * (float)scales[group];
        for (int i = group * 16; i < group * 16 + 16; i++) {
            int half = i / 128, r = i % 128;
            int value = (low[half * 64 + r % 64] >> (4 * (r / 64)) & 0x0f) |
                        (high[half * 32 + r % 32] >> (2 * (r / 32)) & 3) << 4;
            out[i] = scale * (float)(value - 32);
        }
    }
}

static void bf16(const unsigned char *block, float *out) {
    uint32_t bits = (uint32_t)(block[0] | block[1] << 8) << 16;
    memcpy(out, &bits, sizeof bits);
}

typedef struct {
    const char *name;
    Py_ssize_t block_bytes, block_values;
    void (*decode)(const unsigned char *, float *);
} Kind;

#define TYPE_NAMES "Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16"

static const Kind KINDS[] = {
    {"Q8_0", 34, BLOCK, q8_0},         {"Q4_0", 18, BLOCK, q4_0},
    {"Q4_1", 20, BLOCK, q4_1},         {"Q5_0", 22, BLOCK, q5_0},
    {"Q5_1", 24, BLOCK, q5_1},         {"IQ4_NL", 18, BLOCK, iq4_nl},
    {"Q2_K", 84, SUPER_BLOCK, q2_k},   {"Q3_K", 110, SUPER_BLOCK, q3_k},
    {"Q4_K", 144, SUPER_BLOCK, q4_k},  {"Q5_K", 176, SUPER_BLOCK, q5_k},
    {"Q6_K", 210, SUPER_BLOCK, q6_k},  {"BF16", 2, 1, bf16},
};

/* dequantize(kind, blocks, out): blocks is a C-contiguous buffer of whole blocks, out a
 * writable C-contiguous float32 buffer of the blocks' values. */
static PyObject *dequantize(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "dequantize(kind, blocks, out)");
        return NULL;
    }
    const char *name = PyUnicode_AsUTF8(args[0]);
    if (name == NULL) return NULL;
    const Kind *kind = NULL;
    for (size_t i = 0; i < sizeof KINDS / sizeof KINDS[0]; i++)
        if (strcmp(name, KINDS[i].name) == 0) kind = &KINDS[i];
    if (kind == NULL) {
        PyErr_Format(PyExc_ValueError, "dequantize: no block type %s (%s)", name, TYPE_NAMES);
        return NULL;
    }
    Py_buffer blocks, out;
    if (PyObject_GetBuffer(args[1], &blocks, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&blocks);
        return NULL;
    }
    Py_ssize_t count = blocks.len / kind->block_bytes;
    Py_ssize_t out_bytes = count * kind->block_values * (Py_ssize_t)sizeof(float);
    PyObject *result = NULL;
    if (blocks.len % kind->block_bytes != 0 || out.len != out_bytes) {
        PyErr_Format(PyExc_ValueError,
                     "dequantize: %zd bytes are not whole %s blocks, or out (%zd bytes) is not "
                     "%zd float32 per block",
                     blocks.len, name, out.len, kind->block_values);
    } else {
        const unsigned char *source = blocks.buf;
        float *target = out.buf;
        Py_BEGIN_ALLOW_THREADS;
        for (Py_ssize_t i = 0; i < count; i++)
            kind->decode(source + i * kind->block_bytes, target + i * kind->block_values);
        Py_END_ALLOW_THREADS;
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&blocks);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"dequantize", (PyCFunction)(void (*)(void))dequantize, METH_FASTCALL,
     "dequantize(kind, blocks, out): decode the GGUF blocks of type ``kind`` (" TYPE_NAMES
     ") in the buffer ``blocks`` into the float32 buffer ``out`` (the blocks' values)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dequantize",
                                    "GGUF block dequantization to float32.", -1, methods};

PyMODINIT_FUNC PyInit__dequantize(void) { return PyModule_Create(&module); }
