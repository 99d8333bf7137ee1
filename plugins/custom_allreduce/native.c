/* The per-call path of custom_ar's one-shot all-reduce in C (see communicator.py for the
 * segment's layout and the protocol): copy the input to this rank's slot, announce the call
 * with a release store, spin on the peers' flags with acquire loads, and reduce every slot in
 * rank order into a new tensor. What is not done here stays in Python: waits past the spin
 * (wait_until: yield, sleep, deadline), the two-shot path, and dtypes not listed in DTYPES.
 *
 * A plan also makes a native entry point (native_all_reduce.h) for a run of calls made from C
 * without the GIL: the same steps in place, waiting as wait_until does (native_wait.h).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "native_all_reduce.h"
#include "native_wait.h"


#if defined(__FLT16_MAX__)
#define HAVE_FLOAT16 1
#endif

enum dtype { F32, F64, F16, BF16, I32, I64, U8, DTYPE_COUNT };
enum op { SUM, MAX, MIN, OP_COUNT };

static const char *const dtype_names[DTYPE_COUNT] = {
    "float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8"};
static const char *const op_names[OP_COUNT] = {"sum", "max", "min"};

static int dtype_supported(int dtype) {
#ifndef HAVE_FLOAT16
    if (dtype == F16) return 0;
#endif
    return 1;
}

static int index_of(const char *name, const char *const *names, int count) {
    for (int i = 0; i < count; i++)
        if (strcmp(name, names[i]) == 0) return i;
    return -1;
}

/* ---- element-wise combination: numpy's rules (wrapping integers, NaN wins max/min) ---- */

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, 4);
    return value;
}

static inline uint16_t float_to_bf16(float value) { /* round to nearest even, as torch */
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if (value != value) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

#define FLOAT_COMBINE(a, b, op)                                                          \
    ((op) == SUM ? (a) + (b)                                                             \
     : (op) == MAX ? (((a) >= (b) || (a) != (a)) ? (a) : (b))                            \
                   : (((a) <= (b) || (a) != (a)) ? (a) : (b)))

#define INT_COMBINE(T, U, a, b, op)                                                      \
    ((op) == SUM ? (T)((U)(a) + (U)(b)) : (op) == MAX ? ((a) >= (b) ? (a) : (b))          \
                                                      : ((a) <= (b) ? (a) : (b)))

/* out <- a (op) b, element-wise; one loop per op so that each vectorizes (AVX2 where the CPU
 * has it: the same IEEE operations, only wider). */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define WIDEST_CPU __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef WIDEST_CPU
#define WIDEST_CPU
#endif

#define DEFINE_FOLD(name, T, COMBINE)                                                      \
    WIDEST_CPU static void name(T *out, const T *a, const T *restrict b,                  \
                                Py_ssize_t count, int op) {                               \
        if (op == SUM)                                                                     \
            for (Py_ssize_t i = 0; i < count; i++) out[i] = COMBINE(a[i], b[i], SUM);      \
        else if (op == MAX)                                                                \
            for (Py_ssize_t i = 0; i < count; i++) out[i] = COMBINE(a[i], b[i], MAX);      \
        else                                                                               \
            for (Py_ssize_t i = 0; i < count; i++) out[i] = COMBINE(a[i], b[i], MIN);      \
    }

#define F_COMBINE(a, b, op) FLOAT_COMBINE(a, b, op)
#define I32_COMBINE(a, b, op) INT_COMBINE(int32_t, uint32_t, a, b, op)
#define I64_COMBINE(a, b, op) INT_COMBINE(int64_t, uint64_t, a, b, op)
#define U8_COMBINE(a, b, op) INT_COMBINE(uint8_t, uint8_t, a, b, op)
#define BF16_COMBINE(a, b, op) \
    float_to_bf16(FLOAT_COMBINE(bf16_to_float(a), bf16_to_float(b), op))

DEFINE_FOLD(fold_f32, float, F_COMBINE)
DEFINE_FOLD(fold_f64, double, F_COMBINE)
DEFINE_FOLD(fold_i32, int32_t, I32_COMBINE)
DEFINE_FOLD(fold_i64, int64_t, I64_COMBINE)
DEFINE_FOLD(fold_u8, uint8_t, U8_COMBINE)
DEFINE_FOLD(fold_bf16, uint16_t, BF16_COMBINE)
#ifdef HAVE_FLOAT16
/* _Float16 arithmetic is done in float and rounded once per operation, as numpy does. */
#define F16_COMBINE(a, b, op) ((_Float16)FLOAT_COMBINE((float)(a), (float)(b), op))
DEFINE_FOLD(fold_f16, _Float16, F16_COMBINE)
#endif

/* out <- a (op) b, element-wise (``a`` may be ``out``). */
static void fold(void *out, const void *a, const void *b, Py_ssize_t count, int dtype, int op) {
    switch (dtype) {
    case F32: fold_f32(out, a, b, count, op); break;
    case F64: fold_f64(out, a, b, count, op); break;
#ifdef HAVE_FLOAT16
    case F16: fold_f16(out, a, b, count, op); break;
#endif
    case BF16: fold_bf16(out, a, b, count, op); break;
    case I32: fold_i32(out, a, b, count, op); break;
    case I64: fold_i64(out, a, b, count, op); break;
    case U8: fold_u8(out, a, b, count, op); break;
    }
}

/* ---- OneShot: a prepared one-shot all-reduce of one size, dtype and op ----------------- */

typedef struct {
    PyObject_HEAD
    Py_buffer memory;      /* the mapped segment, held while this plan lives */
    int64_t *flags;        /* rank 0's "arrived" flag */
    Py_ssize_t flag_words; /* int64 words from one rank's flag to the next */
    char *slots;           /* rank 0's slot of set 0 */
    Py_ssize_t slot_bytes;
    int world_size, rank, dtype, op, spin_checks;
    Py_ssize_t nbytes, count;
    PyObject *empty_like;  /* torch.empty_like */
} OneShot;

static PyObject *data_ptr_name;

static void *tensor_data(PyObject *tensor) {
    PyObject *address = PyObject_CallMethodNoArgs(tensor, data_ptr_name);
    if (address == NULL) return NULL;
    void *pointer = PyLong_AsVoidPtr(address);
    Py_DECREF(address);
    return pointer;
}

static inline char *slot(const OneShot *self, int64_t call, int rank) {
    return self->slots + ((call & 1) * self->world_size + rank) * self->slot_bytes;
}

static inline int all_arrived(const OneShot *self, int64_t call) {
    for (int rank = 0; rank < self->world_size; rank++)
        if (__atomic_load_n(&self->flags[rank * self->flag_words], __ATOMIC_ACQUIRE) < call)
            return 0;
    return 1;
}

/* A new tensor like ``tensor`` (NULL: an exception). */
static PyObject *new_like(const OneShot *self, PyObject *tensor, char **data) {
    PyObject *result = PyObject_CallOneArg(self->empty_like, tensor);
    if (result == NULL) return NULL;
    *data = tensor_data(result);
    if (*data == NULL && PyErr_Occurred()) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

/* out <- every rank's slot of ``call`` combined in rank order. */
static void reduce_into(const OneShot *self, char *out, int64_t call) {
    fold(out, slot(self, call, 0), slot(self, call, 1), self->count, self->dtype, self->op);
    for (int rank = 2; rank < self->world_size; rank++)
        fold(out, out, slot(self, call, rank), self->count, self->dtype, self->op);
}

static int parse_call(PyObject *const *args, Py_ssize_t nargs, int64_t *call) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "expected (tensor, call)");
        return -1;
    }
    *call = PyLong_AsLongLong(args[1]);
    return (*call == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Announces ``call`` with the input in this rank's slot, makes the result tensor while the
 * others arrive (its allocation off the path they wait on), and returns it reduced once all
 * have; None where they have not within spin_checks checks (finish, after a wait, makes it). */
static PyObject *OneShot_run(OneShot *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t call;
    if (parse_call(args, nargs, &call) < 0) return NULL;
    char *input = tensor_data(args[0]), *out;
    if (input == NULL && PyErr_Occurred()) return NULL;
    memcpy(slot(self, call, self->rank), input, self->nbytes);
    __atomic_store_n(&self->flags[self->rank * self->flag_words], call, __ATOMIC_RELEASE);
    PyObject *result = new_like(self, args[0], &out);
    if (result == NULL) return NULL;
    for (int check = 0;; check++) {
        if (all_arrived(self, call)) {
            reduce_into(self, out, call);
            return result;
        }
        if (check >= self->spin_checks) {
            Py_DECREF(result);
            Py_RETURN_NONE;
        }
        SHARDLINE_CPU_RELAX();
    }
}

static PyObject *OneShot_finish(OneShot *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t call;
    char *out;
    if (parse_call(args, nargs, &call) < 0) return NULL;
    PyObject *result = new_like(self, args[0], &out);
    if (result != NULL) reduce_into(self, out, call);
    return result;
}

static PyObject *OneShot_arrived(OneShot *self, PyObject *call_object) {
    int64_t call = PyLong_AsLongLong(call_object);
    if (call == -1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(all_arrived(self, call));
}

/* ---- a run of one-shot sums made from C (native_all_reduce.h) ---------------------------- */

typedef struct {
    shardline_native_all_reduce entry; /* first: the capsule's pointer */
    OneShot *plan;                     /* held */
    int64_t next_call, end_call;
    shardline_wait_policy wait;
} NativeRun;

typedef struct {
    const OneShot *plan;
    int64_t call;
} Arrival;

static int arrival_check(void *context) {
    const Arrival *arrival = context;
    return all_arrived(arrival->plan, arrival->call);
}

/* Wait until every rank announced ``call`` (native_wait.h); past the deadline,
 * SHARDLINE_NATIVE_TIMED_OUT with the message naming the ranks that did not arrive. */
static int wait_all_arrived(const NativeRun *run, int64_t call, char *error, size_t size) {
    const OneShot *plan = run->plan;
    Arrival arrival = {plan, call};
    if (shardline_wait(arrival_check, &arrival, &run->wait)) return 0;
    int used = snprintf(error, size, "custom_ar all_reduce on rank %d of %d: ranks [",
                        plan->rank, plan->world_size);
    for (int rank = 0, first = 1; rank < plan->world_size; rank++)
        if (__atomic_load_n(&plan->flags[rank * plan->flag_words], __ATOMIC_ACQUIRE) < call &&
            used >= 0 && (size_t)used < size) {
            used += snprintf(error + used, size - used, first ? "%d" : ", %d", rank);
            first = 0;
        }
    if (used >= 0 && (size_t)used < size)
        snprintf(error + used, size - used, "] did not arrive within %g s", run->wait.timeout_s);
    return SHARDLINE_NATIVE_TIMED_OUT;
}

static int native_run_all_reduce(void *context, void *data, char *error, size_t size) {
    NativeRun *run = context;
    OneShot *plan = run->plan;
    if (run->next_call >= run->end_call) {
        snprintf(error, size, "custom_ar: a native all-reduce run was called more often than "
                              "the calls it was made for");
        return SHARDLINE_NATIVE_FAILED;
    }
    int64_t call = run->next_call++;
    memcpy(slot(plan, call, plan->rank), data, plan->nbytes);
    __atomic_store_n(&plan->flags[plan->rank * plan->flag_words], call, __ATOMIC_RELEASE);
    int status = wait_all_arrived(run, call, error, size);
    if (status != 0) return status;
    reduce_into(plan, data, call);
    return 0;
}

static void native_run_free(PyObject *capsule) {
    NativeRun *run = PyCapsule_GetPointer(capsule, SHARDLINE_NATIVE_ALL_REDUCE);
    if (run == NULL) return;
    Py_XDECREF(run->plan);
    PyMem_Free(run);
}

static PyObject *OneShot_native_run(OneShot *self, PyObject *args) {
    long long first_call, calls;
    double timeout_s, yield_s, first_sleep_s, max_sleep_s;
    int share_cpu;
    if (!PyArg_ParseTuple(args, "LLddpdd", &first_call, &calls, &timeout_s, &yield_s,
                          &share_cpu, &first_sleep_s, &max_sleep_s))
        return NULL;
    if (first_call < 1 || calls < 0 || first_sleep_s <= 0 || max_sleep_s < first_sleep_s) {
        PyErr_SetString(PyExc_ValueError, "first_call must be >= 1, calls >= 0 and "
                                          "0 < first_sleep_s <= max_sleep_s");
        return NULL;
    }
    NativeRun *run = PyMem_Malloc(sizeof *run);
    if (run == NULL) return PyErr_NoMemory();
    run->entry.all_reduce = native_run_all_reduce;
    run->entry.context = run;
    Py_INCREF(self);
    run->plan = self;
    run->next_call = first_call;
    run->end_call = first_call + calls;
    run->wait = (shardline_wait_policy){.spin_checks = self->spin_checks,
                                        .share_cpu = share_cpu,
                                        .yield_s = yield_s,
                                        .first_sleep_s = first_sleep_s,
                                        .max_sleep_s = max_sleep_s,
                                        .timeout_s = timeout_s};
    PyObject *capsule = PyCapsule_New(run, SHARDLINE_NATIVE_ALL_REDUCE, native_run_free);
    if (capsule == NULL) {
        Py_DECREF(self);
        PyMem_Free(run);
    }
    return capsule;
}

static int OneShot_init(OneShot *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"memory",     "flags_offset", "flag_stride", "slots_offset",
                               "slot_bytes", "world_size",   "rank",        "dtype",
                               "op",         "nbytes",       "spin_checks", "empty_like",
                               NULL};
    PyObject *memory, *empty_like;
    Py_ssize_t flags_offset, flag_stride, slots_offset;
    const char *dtype_name, *op_name;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnnnniissniO", keywords, &memory,
                                     &flags_offset, &flag_stride, &slots_offset,
                                     &self->slot_bytes, &self->world_size, &self->rank,
                                     &dtype_name, &op_name, &self->nbytes, &self->spin_checks,
                                     &empty_like))
        return -1;
    self->dtype = index_of(dtype_name, dtype_names, DTYPE_COUNT);
    self->op = index_of(op_name, op_names, OP_COUNT);
    if (self->dtype < 0 || !dtype_supported(self->dtype) || self->op < 0) {
        PyErr_Format(PyExc_ValueError, "dtype %s with op %s: allowed: DTYPES and sum/max/min",
                     dtype_name, op_name);
        return -1;
    }
    if (self->world_size < 2 || self->rank < 0 || self->rank >= self->world_size ||
        self->nbytes < 0 || self->nbytes > self->slot_bytes || flag_stride % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "inconsistent sizes for a one-shot plan");
        return -1;
    }
    if (self->memory.obj != NULL) PyBuffer_Release(&self->memory);
    if (PyObject_GetBuffer(memory, &self->memory, PyBUF_WRITABLE) < 0) return -1;
    Py_ssize_t flags_end = flags_offset + flag_stride * (Py_ssize_t)self->world_size;
    Py_ssize_t slots_end = slots_offset + 2 * self->world_size * self->slot_bytes;
    if (flags_offset < 0 || flags_offset % 8 != 0 || slots_offset < 0 ||
        flags_end > self->memory.len || slots_end > self->memory.len) {
        PyBuffer_Release(&self->memory);
        PyErr_SetString(PyExc_ValueError, "flags or slots lie outside the segment");
        return -1;
    }
    self->flags = (int64_t *)((char *)self->memory.buf + flags_offset);
    self->flag_words = flag_stride / 8;
    self->slots = (char *)self->memory.buf + slots_offset;
    Py_ssize_t item = self->dtype == F64 || self->dtype == I64 ? 8
                      : self->dtype == F16 || self->dtype == BF16 ? 2
                      : self->dtype == U8 ? 1 : 4;
    self->count = self->nbytes / item;
    Py_INCREF(empty_like);
    Py_XSETREF(self->empty_like, empty_like);
    return 0;
}

static void OneShot_dealloc(OneShot *self) {
    if (self->memory.obj != NULL) PyBuffer_Release(&self->memory);
    Py_XDECREF(self->empty_like);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef OneShot_methods[] = {
    {"run", (PyCFunction)(void (*)(void))OneShot_run, METH_FASTCALL,
     "run(tensor, call): copy ``tensor`` (contiguous, ``nbytes``) to this rank's slot, "
     "announce ``call``, make the result while spinning ``spin_checks`` times; the reduced "
     "new tensor once every rank arrived, else None (wait with arrived(), then finish())."},
    {"finish", (PyCFunction)(void (*)(void))OneShot_finish, METH_FASTCALL,
     "finish(tensor, call): the reduced new tensor of ``call``, once every rank arrived."},
    {"arrived", (PyCFunction)OneShot_arrived, METH_O,
     "arrived(call): whether every rank announced ``call`` (acquire loads)."},
    {"native_run", (PyCFunction)OneShot_native_run, METH_VARARGS,
     "native_run(first_call, calls, timeout_s, yield_s, share_cpu, first_sleep_s, "
     "max_sleep_s): a PyCapsule (native_all_reduce.h) making calls first_call .. first_call + "
     "calls - 1 in place from C, each waiting as wait_until does with those bounds (see "
     "shardline.comm.waiting.Polling) and failing after timeout_s."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject OneShotType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shardline_custom_allreduce._native.OneShot",
    .tp_basicsize = sizeof(OneShot),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A prepared one-shot all-reduce over a mapped custom_ar segment.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)OneShot_init,
    .tp_dealloc = (destructor)OneShot_dealloc,
    .tp_methods = OneShot_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "custom_ar's one-shot all-reduce per-call path in C.", -1, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    data_ptr_name = PyUnicode_InternFromString("data_ptr");
    if (data_ptr_name == NULL || PyType_Ready(&OneShotType) < 0) return NULL;
    PyObject *result = PyModule_Create(&module);
    if (result == NULL) return NULL;
    PyObject *names = PyList_New(0);
    for (int dtype = 0; dtype < DTYPE_COUNT && names != NULL; dtype++) {
        if (!dtype_supported(dtype)) continue;
        PyObject *name = PyUnicode_FromString(dtype_names[dtype]);
        if (name == NULL || PyList_Append(names, name) < 0) Py_CLEAR(names);
        Py_XDECREF(name);
    }
    PyObject *dtypes = names == NULL ? NULL : PyList_AsTuple(names);
    Py_XDECREF(names);
    if (dtypes == NULL || PyModule_AddObject(result, "DTYPES", dtypes) < 0 ||
        PyModule_AddObjectRef(result, "OneShot", (PyObject *)&OneShotType) < 0) {
        Py_XDECREF(dtypes);
        Py_DECREF(result);
        return NULL;
    }
    return result;
}
