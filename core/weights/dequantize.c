/* GGUF reading in C: block dequantization to float32 in one pass over the bytes, and arrays
 * of strings (a tokenizer's vocabulary) decoded in one call.
 *
 * Dequantization: each block split as gguf_blocks.h says (its layouts are there) and its
 * values computed with the gguf package's arithmetic (float16 scales widened to float32, the
 * same float32 multiplies, adds and subtractions in the same order: built with
 * -ffp-contract=off, so never fused), so the same bits, without numpy's per-group
 * temporaries. BF16 (one weight in 2 bytes) is widened as the gguf package does: its bits,
 * shifted.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "gguf_blocks.h"

#define TYPE_NAMES GGUF_TYPE_NAMES ", BF16"

/* count blocks of type (NULL: BF16) from source into target. */
static void decode(const GGUFType *type, const unsigned char *source, Py_ssize_t count,
                   float *target) {
    if (type == NULL) {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t bits = (uint32_t)(source[2 * i] | source[2 * i + 1] << 8) << 16;
            memcpy(target + i, &bits, sizeof bits);
        }
        return;
    }
    GGUFSplit split;
    for (Py_ssize_t b = 0; b < count; b++) {
        type->split(source + b * type->block_bytes, &split);
        float *out = target + b * type->block_values;
        for (int i = 0; i < type->block_values; i++) out[i] = gguf_value(type, &split, i);
    }
}

/* dequantize(kind, blocks, out): blocks is a C-contiguous buffer of whole blocks, out a
 * writable C-contiguous float32 buffer of the blocks' values. */
static PyObject *dequantize(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "dequantize(kind, blocks, out)");
        return NULL;
    }
    const char *name = PyUnicode_AsUTF8(args[0]);
    if (name == NULL) return NULL;
    const GGUFType *type = gguf_type(name);
    if (type == NULL && strcmp(name, "BF16") != 0) {
        PyErr_Format(PyExc_ValueError, "dequantize: no block type %s (%s)", name, TYPE_NAMES);
        return NULL;
    }
    Py_ssize_t block_bytes = type ? type->block_bytes : 2;
    Py_ssize_t block_values = type ? type->block_values : 1;
    Py_buffer blocks, out;
    if (PyObject_GetBuffer(args[1], &blocks, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&blocks);
        return NULL;
    }
    Py_ssize_t count = blocks.len / block_bytes;
    Py_ssize_t out_bytes = count * block_values * (Py_ssize_t)sizeof(float);
    PyObject *result = NULL;
    if (blocks.len % block_bytes != 0 || out.len != out_bytes) {
        PyErr_Format(PyExc_ValueError,
                     "dequantize: %zd bytes are not whole %s blocks, or out (%zd bytes) is not "
                     "%zd float32 per block",
                     blocks.len, name, out.len, block_values);
    } else {
        Py_BEGIN_ALLOW_THREADS;
        decode(type, blocks.buf, count, out.buf);
        Py_END_ALLOW_THREADS;
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&blocks);
    PyBuffer_Release(&out);
    return result;
}

#define PAST_END "the header runs past the end of the file"

/* strings(buffer, offset, count): count GGUF strings from offset in buffer (each a
 * little-endian uint64 length, then that many bytes of UTF-8; bytes that do not decode are
 * replaced, as codecs' "replace" does); (list of str, the offset after them). ValueError
 * where one runs past the buffer's end. */
static PyObject *strings(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "strings(buffer, offset, count)");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]), count = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *bytes = view.buf;
    Py_ssize_t end = view.len;
    PyObject *list = NULL, *result = NULL;
    /* Each string takes 8 bytes at least: a count past that is refused before any list. */
    if (offset < 0 || offset > end || count < 0 || count > (end - offset) / 8) {
        PyErr_SetString(PyExc_ValueError, PAST_END);
        goto done;
    }
    list = PyList_New(count);
    if (list == NULL) goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (end - offset < 8) {
            PyErr_SetString(PyExc_ValueError, PAST_END);
            goto done;
        }
        uint64_t length = 0;
        for (int b = 7; b >= 0; b--) length = length << 8 | bytes[offset + b];
        offset += 8;
        if (length > (uint64_t)(end - offset)) {
            PyErr_SetString(PyExc_ValueError, PAST_END);
            goto done;
        }
        PyObject *text =
            PyUnicode_DecodeUTF8((const char *)bytes + offset, (Py_ssize_t)length, "replace");
        if (text == NULL) goto done;
        PyList_SET_ITEM(list, i, text);
        offset += (Py_ssize_t)length;
    }
    result = Py_BuildValue("(On)", list, offset);
done:
    Py_XDECREF(list);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"dequantize", (PyCFunction)(void (*)(void))dequantize, METH_FASTCALL,
     "dequantize(kind, blocks, out): decode the GGUF blocks of type ``kind`` (" TYPE_NAMES
     ") in the buffer ``blocks`` into the float32 buffer ``out`` (the blocks' values)."},
    {"strings", (PyCFunction)(void (*)(void))strings, METH_FASTCALL,
     "strings(buffer, offset, count): ``count`` GGUF strings from ``offset`` of ``buffer`` "
     "(UTF-8, undecodable bytes replaced): (list of str, the offset after them)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_dequantize",
    "GGUF reading: block dequantization to float32, arrays of strings.", -1, methods};

PyMODINIT_FUNC PyInit__dequantize(void) { return PyModule_Create(&module); }
