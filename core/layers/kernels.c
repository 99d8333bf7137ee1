/* The per-layer operations of a decoder step between its weight multiplies, in C, for
 * float32 and bfloat16 tensors on the CPU (see kernels.py, which checks dtypes, shapes and
 * contiguity and passes raw addresses): RMSNorm with the residual add, RoPE with the KV cache store, decode
 * attention over a paged cache, and SiLU-and-multiply. Each replaces several torch operations
 * whose dispatch, not arithmetic, dominates at decode batch sizes.
 *
 * Built with -ffp-contract=off: RoPE rounds as torch does (a product, a product, a sum, then
 * to the element type), so it is bit-identical to the torch path; the others sum in a different order or use the
 * polynomial exp below, within a few float32 ulps of torch. Loops are written so that gcc
 * vectorizes them (independent partial sums in lanes) for the widest instruction set the CPU
 * has (target_clones), with no -ffast-math.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define WIDEST_CPU __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef WIDEST_CPU
#define WIDEST_CPU
#endif

#define LANES 16

/* e^x to about 1 float32 ulp for x in [-87.3, 88.7] (clamped outside): x = n ln2 + r with
 * |r| <= ln2/2, e^r by its degree-7 Taylor polynomial, 2^n from the exponent bits. Written
 * without branches or library calls so that a loop over it vectorizes. */
static inline float exp_approx(float x) {
    const float round_magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.7f ? 88.7f : x;
    float n = (x * 1.44269504f + round_magic) - round_magic;
    float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float dot(const float *a, const float *b, long n) {
    float lanes[LANES] = {0};
    long i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) lanes[j] += a[i + j] * b[i + j];
    float sum = 0.0f;
    for (int j = 0; j < LANES; j++) sum += lanes[j];
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static inline float sum_of(const float *a, long n) {
    float lanes[LANES] = {0};
    long i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) lanes[j] += a[i + j];
    float sum = 0.0f;
    for (int j = 0; j < LANES; j++) sum += lanes[j];
    for (; i < n; i++) sum += a[i];
    return sum;
}

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

static inline uint16_t float_to_bf16(float value) { /* round to nearest even, as torch */
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if (value != value) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* The kernels once per element type (kernels_rows.h): float32, then bfloat16 (computed in
 * float32 and rounded to bfloat16 where torch's bfloat16 path rounds). */
#define ELEM float
#define NAME(base) base##_f32
#define LOAD(p, i) ((p)[i])
#define STORE(p, i, v) ((p)[i] = (v))
#define ROUND(v) (v)
#include "kernels_rows.h"
#undef ELEM
#undef NAME
#undef LOAD
#undef STORE
#undef ROUND

#define ELEM uint16_t
#define NAME(base) base##_bf16
#define LOAD(p, i) bf16_to_float((p)[i])
#define STORE(p, i, v) ((p)[i] = float_to_bf16(v))
#define ROUND(v) bf16_to_float(float_to_bf16(v))
#include "kernels_rows.h"

/* ---- Python bindings: addresses and sizes as ints, floats as floats ---- */

static int take_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t expected,
                     const char *name) {
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, expected,
                     nargs);
        return -1;
    }
    return 0;
}

#define ADDRESS(i) PyLong_AsVoidPtr(args[i])
#define SIZE(i) PyLong_AsLong(args[i])
#define REAL(i) ((float)PyFloat_AsDouble(args[i]))

/* Each takes first whether the tensors are bfloat16 (1) or float32 (0). */

static PyObject *rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 9, "rms_norm") < 0) return NULL;
    long bf16 = SIZE(0), rows = SIZE(6), hidden = SIZE(7);
    void *x = ADDRESS(1), *residual = ADDRESS(2), *weight = ADDRESS(3), *out = ADDRESS(4);
    void *residual_out = ADDRESS(5);
    float eps = REAL(8);
    if (PyErr_Occurred()) return NULL;
    float *row = malloc((size_t)(hidden > 0 ? hidden : 1) * sizeof(float));
    if (row == NULL) return PyErr_NoMemory();
    if (bf16)
        rms_norm_rows_bf16(x, residual, weight, out, residual_out, rows, hidden, eps, row);
    else
        rms_norm_rows_f32(x, residual, weight, out, residual_out, rows, hidden, eps, row);
    free(row);
    Py_RETURN_NONE;
}

static PyObject *rope_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 13, "rope_store") < 0) return NULL;
    long bf16 = SIZE(0), rows = SIZE(2), q_heads = SIZE(3), kv_heads = SIZE(4), d = SIZE(5);
    void *qkv = ADDRESS(1), *q_out = ADDRESS(8), *key_cache = ADDRESS(9);
    void *value_cache = ADDRESS(10);
    const float *cos = ADDRESS(6), *sin = ADDRESS(7);
    const int64_t *slots = ADDRESS(11);
    long num_slots = SIZE(12);
    if (PyErr_Occurred()) return NULL;
    for (long r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) {
            PyErr_Format(PyExc_IndexError, "slot %lld is outside the cache's %ld slots",
                         (long long)slots[r], num_slots);
            return NULL;
        }
    if (bf16)
        rope_store_rows_bf16(qkv, rows, q_heads, kv_heads, d, cos, sin, q_out, key_cache,
                             value_cache, slots);
    else
        rope_store_rows_f32(qkv, rows, q_heads, kv_heads, d, cos, sin, q_out, key_cache,
                            value_cache, slots);
    Py_RETURN_NONE;
}

static PyObject *decode_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 16, "decode_attention") < 0) return NULL;
    long bf16 = SIZE(0);
    void *q = ADDRESS(1), *key_cache = ADDRESS(2), *value_cache = ADDRESS(3), *out = ADDRESS(15);
    const int64_t *blocks = ADDRESS(4), *lengths = ADDRESS(6), *kv_index = ADDRESS(9);
    long per_seq = SIZE(5), batch = SIZE(7), heads = SIZE(8), kv_heads = SIZE(10), d = SIZE(11);
    long block_size = SIZE(12), num_blocks = SIZE(13);
    float scale = REAL(14);
    if (PyErr_Occurred()) return NULL;
    long longest = 0;
    for (long b = 0; b < batch; b++) {
        if (lengths[b] < 1 || lengths[b] > per_seq * block_size) {
            PyErr_Format(PyExc_ValueError, "sequence length %lld does not fit %ld blocks of %ld",
                         (long long)lengths[b], per_seq, block_size);
            return NULL;
        }
        longest = lengths[b] > longest ? (long)lengths[b] : longest;
    }
    for (long i = 0; i < batch * per_seq; i++)
        if (blocks[i] < 0 || blocks[i] >= num_blocks) {
            PyErr_Format(PyExc_IndexError, "block %lld is outside the cache's %ld blocks",
                         (long long)blocks[i], num_blocks);
            return NULL;
        }
    float *scores = malloc((size_t)(longest + 2 * d + 1) * sizeof(float));
    if (scores == NULL) return PyErr_NoMemory();
    float *work = scores + longest;
    if (bf16)
        decode_attention_rows_bf16(q, key_cache, value_cache, blocks, per_seq, lengths, batch,
                                   heads, kv_index, kv_heads, d, block_size, scale, out, scores,
                                   work);
    else
        decode_attention_rows_f32(q, key_cache, value_cache, blocks, per_seq, lengths, batch,
                                  heads, kv_index, kv_heads, d, block_size, scale, out, scores,
                                  work);
    free(scores);
    Py_RETURN_NONE;
}

static PyObject *silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 5, "silu_mul") < 0) return NULL;
    long bf16 = SIZE(0), rows = SIZE(3), size = SIZE(4);
    void *gate_up = ADDRESS(1), *out = ADDRESS(2);
    if (PyErr_Occurred()) return NULL;
    if (bf16)
        silu_mul_rows_bf16(gate_up, out, rows, size);
    else
        silu_mul_rows_f32(gate_up, out, rows, size);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", (PyCFunction)(void (*)(void))rms_norm, METH_FASTCALL,
     "rms_norm(bf16, x, residual or 0, weight, out, residual_out or 0, rows, hidden, eps)"},
    {"rope_store", (PyCFunction)(void (*)(void))rope_store, METH_FASTCALL,
     "rope_store(bf16, qkv, rows, q_heads, kv_heads, d, cos, sin, q_out, key_cache, "
     "value_cache, slots, num_slots)"},
    {"decode_attention", (PyCFunction)(void (*)(void))decode_attention, METH_FASTCALL,
     "decode_attention(bf16, q, key_cache, value_cache, blocks, per_seq, lengths, batch, "
     "heads, kv_index, kv_heads, d, block_size, num_blocks, scale, out)"},
    {"silu_mul", (PyCFunction)(void (*)(void))silu_mul, METH_FASTCALL,
     "silu_mul(bf16, gate_up, out, rows, size)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "Per-layer decode operations in C on raw float32 or bfloat16 addresses (use "
    "shardline.layers.kernels).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
