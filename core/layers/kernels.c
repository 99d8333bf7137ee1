/* The per-layer operations of a decoder step between its weight multiplies, in C, for
 * float32 tensors on the CPU (see kernels.py, which checks dtypes, shapes and contiguity and
 * passes raw addresses): RMSNorm with the residual add, RoPE with the KV cache store, decode
 * attention over a paged cache, and SiLU-and-multiply. Each replaces several torch operations
 * whose dispatch, not arithmetic, dominates at decode batch sizes.
 *
 * Built with -ffp-contract=off: RoPE rounds as torch does (a product, a product, a sum), so
 * it is bit-identical to the torch path; the others sum in a different order or use the
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

/* out = weight * (x / rms(x)) per row; with residual, residual_out = x + residual first and
 * the norm is of that sum. */
WIDEST_CPU static void rms_norm_rows(const float *x, const float *residual, const float *weight,
                                     float *out, float *residual_out, long rows, long hidden,
                                     float eps) {
    for (long r = 0; r < rows; r++) {
        const float *row = x + r * hidden;
        if (residual != NULL) {
            const float *add = residual + r * hidden;
            float *sum = residual_out + r * hidden;
            for (long i = 0; i < hidden; i++) sum[i] = row[i] + add[i];
            row = sum;
        }
        float inv = 1.0f / sqrtf(dot(row, row, hidden) / (float)hidden + eps);
        float *dst = out + r * hidden;
        for (long i = 0; i < hidden; i++) dst[i] = weight[i] * (row[i] * inv);
    }
}

/* qkv rows [rows, (q_heads + 2 kv_heads) d]: queries and keys rotated ("rotate half" form,
 * cos/sin [rows, d]), queries to q_out [rows, q_heads, d], keys and values to their cache
 * slots ([slots, kv_heads, d] each). */
WIDEST_CPU static void rope_store_rows(const float *qkv, long rows, long q_heads, long kv_heads,
                                       long d, const float *cos, const float *sin, float *q_out,
                                       float *key_cache, float *value_cache,
                                       const int64_t *slots) {
    long half = d / 2, width = (q_heads + 2 * kv_heads) * d;
    for (long r = 0; r < rows; r++) {
        const float *row = qkv + r * width, *c = cos + r * d, *s = sin + r * d;
        for (long h = 0; h < q_heads + kv_heads; h++) {
            const float *x = row + h * d;
            float *dst = h < q_heads ? q_out + (r * q_heads + h) * d
                                     : key_cache + (slots[r] * kv_heads + h - q_heads) * d;
            for (long i = 0; i < half; i++) {
                float front = x[i] * c[i], turned = -x[i + half] * s[i];
                dst[i] = front + turned;
            }
            for (long i = 0; i < half; i++) {
                float back = x[i + half] * c[i + half], turned = x[i] * s[i + half];
                dst[i + half] = back + turned;
            }
        }
        memcpy(value_cache + slots[r] * kv_heads * d, row + (q_heads + kv_heads) * d,
               (size_t)(kv_heads * d) * sizeof(float));
    }
}

/* One query token per sequence: out[b, h] = softmax(scale q[b, h] . K) V over the first
 * lengths[b] cached tokens of sequence b (its blocks: blocks[b * per_seq ...]), K and V of
 * KV head kv_index[h]. scores: room for the longest sequence. */
WIDEST_CPU static void decode_attention_rows(const float *q, const float *key_cache,
                                             const float *value_cache, const int64_t *blocks,
                                             long per_seq, const int64_t *lengths, long batch,
                                             long heads, const int64_t *kv_index, long kv_heads,
                                             long d, long block_size, float scale, float *out,
                                             float *scores) {
    for (long b = 0; b < batch; b++) {
        const int64_t *table = blocks + b * per_seq;
        long length = (long)lengths[b];
        for (long h = 0; h < heads; h++) {
            const float *query = q + (b * heads + h) * d;
            long kv = (long)kv_index[h];
            float top = -INFINITY;
            for (long t = 0; t < length; t++) {
                long slot = (long)table[t / block_size] * block_size + t % block_size;
                float score = dot(query, key_cache + (slot * kv_heads + kv) * d, d) * scale;
                scores[t] = score;
                top = score > top ? score : top;
            }
            float total = 0.0f;
            for (long t = 0; t < length; t++) {
                scores[t] = exp_approx(scores[t] - top);
                total += scores[t];
            }
            float *dst = out + (b * heads + h) * d;
            for (long i = 0; i < d; i++) dst[i] = 0.0f;
            for (long t = 0; t < length; t++) {
                long slot = (long)table[t / block_size] * block_size + t % block_size;
                const float *value = value_cache + (slot * kv_heads + kv) * d;
                float weight = scores[t];
                for (long i = 0; i < d; i++) dst[i] += weight * value[i];
            }
            float inv = 1.0f / total;
            for (long i = 0; i < d; i++) dst[i] *= inv;
        }
    }
}

/* gate_up rows [rows, 2 size] = [gate | up]: out [rows, size] = silu(gate) * up. */
WIDEST_CPU static void silu_mul_rows(const float *gate_up, float *out, long rows, long size) {
    for (long r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * size, *up = gate + size;
        float *dst = out + r * size;
        for (long i = 0; i < size; i++) dst[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
    }
}

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

static PyObject *rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 8, "rms_norm") < 0) return NULL;
    const float *x = ADDRESS(0), *residual = ADDRESS(1), *weight = ADDRESS(2);
    float *out = ADDRESS(3), *residual_out = ADDRESS(4);
    long rows = SIZE(5), hidden = SIZE(6);
    float eps = REAL(7);
    if (PyErr_Occurred()) return NULL;
    rms_norm_rows(x, residual, weight, out, residual_out, rows, hidden, eps);
    Py_RETURN_NONE;
}

static PyObject *rope_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 12, "rope_store") < 0) return NULL;
    const float *qkv = ADDRESS(0), *cos = ADDRESS(5), *sin = ADDRESS(6);
    long rows = SIZE(1), q_heads = SIZE(2), kv_heads = SIZE(3), d = SIZE(4);
    float *q_out = ADDRESS(7), *key_cache = ADDRESS(8), *value_cache = ADDRESS(9);
    const int64_t *slots = ADDRESS(10);
    long num_slots = SIZE(11);
    if (PyErr_Occurred()) return NULL;
    for (long r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) {
            PyErr_Format(PyExc_IndexError, "slot %lld is outside the cache's %ld slots",
                         (long long)slots[r], num_slots);
            return NULL;
        }
    rope_store_rows(qkv, rows, q_heads, kv_heads, d, cos, sin, q_out, key_cache, value_cache,
                    slots);
    Py_RETURN_NONE;
}

static PyObject *decode_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 15, "decode_attention") < 0) return NULL;
    const float *q = ADDRESS(0), *key_cache = ADDRESS(1), *value_cache = ADDRESS(2);
    const int64_t *blocks = ADDRESS(3), *lengths = ADDRESS(5), *kv_index = ADDRESS(8);
    long per_seq = SIZE(4), batch = SIZE(6), heads = SIZE(7), kv_heads = SIZE(9), d = SIZE(10);
    long block_size = SIZE(11), num_blocks = SIZE(12);
    float scale = REAL(13);
    float *out = ADDRESS(14);
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
    float *scores = malloc((size_t)longest * sizeof(float));
    if (scores == NULL) return PyErr_NoMemory();
    decode_attention_rows(q, key_cache, value_cache, blocks, per_seq, lengths, batch, heads,
                          kv_index, kv_heads, d, block_size, scale, out, scores);
    free(scores);
    Py_RETURN_NONE;
}

static PyObject *silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 4, "silu_mul") < 0) return NULL;
    const float *gate_up = ADDRESS(0);
    float *out = ADDRESS(1);
    long rows = SIZE(2), size = SIZE(3);
    if (PyErr_Occurred()) return NULL;
    silu_mul_rows(gate_up, out, rows, size);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", (PyCFunction)(void (*)(void))rms_norm, METH_FASTCALL,
     "rms_norm(x, residual or 0, weight, out, residual_out or 0, rows, hidden, eps)"},
    {"rope_store", (PyCFunction)(void (*)(void))rope_store, METH_FASTCALL,
     "rope_store(qkv, rows, q_heads, kv_heads, d, cos, sin, q_out, key_cache, value_cache, "
     "slots, num_slots)"},
    {"decode_attention", (PyCFunction)(void (*)(void))decode_attention, METH_FASTCALL,
     "decode_attention(q, key_cache, value_cache, blocks, per_seq, lengths, batch, heads, "
     "kv_index, kv_heads, d, block_size, num_blocks, scale, out)"},
    {"silu_mul", (PyCFunction)(void (*)(void))silu_mul, METH_FASTCALL,
     "silu_mul(gate_up, out, rows, size)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "Per-layer decode operations in C on raw float32 addresses (use shardline.layers.kernels).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
