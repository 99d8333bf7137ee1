/* GGUF block dequantization (Q8_0, Q4_0, Q4_1) to float32 in one pass over the bytes: the same
 * arithmetic as the gguf package's numpy code (a float16 scale widened to float32, then one
 * float32 multiply, and for Q4_1 one add: built with -ffp-contract=off, so never fused), so the
 * same bits, without numpy's per-group temporaries.
 *
 * Block layouts (GGML), 32 weights each:
 *   Q8_0: scale d (f16), 32 int8 q          -> d * q
 *   Q4_0: scale d (f16), 16 bytes of nibbles -> d * (q - 8)
 *   Q4_1: scale d (f16), min m (f16), 16 bytes of nibbles -> d * q + m
 * A nibble byte i holds weight i (low 4 bits) and weight i + 16 (high 4 bits).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

enum { BLOCK = 32 };

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

typedef struct {
    const char *name;
    Py_ssize_t block_bytes;
    void (*decode)(const unsigned char *, float *);
} Kind;

static const Kind KINDS[] = {{"Q8_0", 34, q8_0}, {"Q4_0", 18, q4_0}, {"Q4_1", 20, q4_1}};

/* dequantize(kind, blocks, out): blocks is a C-contiguous buffer of whole blocks, out a
 * writable C-contiguous float32 buffer of 32 floats per block. */
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
        PyErr_Format(PyExc_ValueError, "dequantize: no block type %s (Q8_0, Q4_0, Q4_1)", name);
        return NULL;
    }
    Py_buffer blocks, out;
    if (PyObject_GetBuffer(args[1], &blocks, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&blocks);
        return NULL;
    }
    Py_ssize_t count = blocks.len / kind->block_bytes;
    Py_ssize_t out_bytes = count * BLOCK * (Py_ssize_t)sizeof(float);
    PyObject *result = NULL;
    if (blocks.len % kind->block_bytes != 0 || out.len != out_bytes) {
        PyErr_Format(PyExc_ValueError,
                     "dequantize: %zd bytes are not whole %s blocks, or out (%zd bytes) is not "
                     "32 float32 per block",
                     blocks.len, name, out.len);
    } else {
        const unsigned char *source = blocks.buf;
        float *target = out.buf;
        Py_BEGIN_ALLOW_THREADS;
        for (Py_ssize_t i = 0; i < count; i++)
            kind->decode(source + i * kind->block_bytes, target + i * BLOCK);
        Py_END_ALLOW_THREADS;
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&blocks);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"dequantize", (PyCFunction)(void (*)(void))dequantize, METH_FASTCALL,
     "dequantize(kind, blocks, out): decode the GGUF blocks of type ``kind`` (Q8_0, Q4_0, "
     "Q4_1) in the buffer ``blocks`` into the float32 buffer ``out`` (32 values per block)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dequantize",
                                    "GGUF block dequantization to float32.", -1, methods};

PyMODINIT_FUNC PyInit__dequantize(void) { return PyModule_Create(&module); }
