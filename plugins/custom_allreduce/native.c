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
#include <stddef.h>
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

/* Announces ``call`` with ``tensor`` (contiguous, ``nbytes``) in this rank's slot, makes the
 * result tensor while the others arrive (its allocation off the path they wait on), and
 * returns it reduced once all have; Py_None (a new reference) where they have not within
 * spin_checks checks (finish, after a wait, makes it); NULL: an exception. */
static PyObject *one_shot_run(OneShot *self, PyObject *tensor, int64_t call) {
    char *input = tensor_data(tensor), *out;
    if (input == NULL && PyErr_Occurred()) return NULL;
    memcpy(slot(self, call, self->rank), input, self->nbytes);
    __atomic_store_n(&self->flags[self->rank * self->flag_words], call, __ATOMIC_RELEASE);
    PyObject *result = new_like(self, tensor, &out);
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

static PyObject *OneShot_run(OneShot *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t call;
    if (parse_call(args, nargs, &call) < 0) return NULL;
    return one_shot_run(self, args[0], call);
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

/* ---- AllReduce: a communicator's all_reduce, routed in C ------------------------------ */

enum { ROUTES = 8 }; /* (dtype, op, size) routes kept; the oldest goes first */

typedef struct {
    PyObject *dtype, *op; /* compared by identity: torch dtypes and ReduceOp members are
                             singletons */
    Py_ssize_t nbytes;
    OneShot *plan;
} Route;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *general;     /* general(tensor, op): every call not routed here */
    PyObject *finish;      /* finish(plan, tensor, call): waits past the spin, then reduces */
    PyObject *tensor_type; /* torch.Tensor: subclasses take the general path */
    PyObject *default_op;  /* the op of a call that names none */
    int64_t calls;         /* the last all-reduce number handed out */
    Route routes[ROUTES];
    int route_count, oldest;
} AllReduce;

static PyObject *dtype_attr, *nbytes_attr, *is_cpu_attr, *is_contiguous_attr, *op_keyword;

static Route *find_route(AllReduce *self, PyObject *dtype, PyObject *op, Py_ssize_t nbytes) {
    for (int i = 0; i < self->route_count; i++)
        if (self->routes[i].dtype == dtype && self->routes[i].op == op &&
            self->routes[i].nbytes == nbytes)
            return &self->routes[i];
    return NULL;
}

/* The route of a call of ``tensor`` with ``op``: NULL with no error where there is none. */
static Route *route_of(AllReduce *self, PyObject *tensor, PyObject *op) {
    if (self->route_count == 0 || Py_TYPE(tensor) != (PyTypeObject *)self->tensor_type)
        return NULL;
    PyObject *dtype = PyObject_GetAttr(tensor, dtype_attr);
    if (dtype == NULL) return NULL;
    Py_DECREF(dtype); /* a singleton, held by torch: only its identity is compared */
    PyObject *size = PyObject_GetAttr(tensor, nbytes_attr);
    if (size == NULL) return NULL;
    Py_ssize_t nbytes = PyLong_AsSsize_t(size);
    Py_DECREF(size);
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    Route *route = find_route(self, dtype, op, nbytes);
    if (route == NULL) return NULL;
    PyObject *on_cpu = PyObject_GetAttr(tensor, is_cpu_attr);
    if (on_cpu == NULL) return NULL;
    Py_DECREF(on_cpu);
    if (on_cpu != Py_True) return NULL;
    PyObject *contiguous = PyObject_CallMethodNoArgs(tensor, is_contiguous_attr);
    if (contiguous == NULL) return NULL;
    Py_DECREF(contiguous);
    return contiguous == Py_True ? route : NULL;
}

static PyObject *AllReduce_vectorcall(AllReduce *self, PyObject *const *args, size_t nargsf,
                                      PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *op = nargs == 2 ? args[1] : self->default_op;
    int keywords = kwnames == NULL ? 0 : (int)PyTuple_GET_SIZE(kwnames);
    if (nargs == 1 && keywords == 1 &&
        PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, 0), op_keyword) == 0)
        op = args[1];
    else if (keywords > 0 || nargs < 1 || nargs > 2)
        return PyObject_Vectorcall(self->general, args, nargsf, kwnames);
    Route *route = route_of(self, args[0], op);
    if (route == NULL) {
        if (PyErr_Occurred()) return NULL;
        PyObject *pair[2] = {args[0], op};
        return PyObject_Vectorcall(self->general, pair, 2, NULL);
    }
    int64_t call = ++self->calls;
    PyObject *result = one_shot_run(route->plan, args[0], call);
    if (result != Py_None) return result;
    Py_DECREF(result);
    PyObject *number = PyLong_FromLongLong(call);
    if (number == NULL) return NULL;
    PyObject *finish_args[3] = {(PyObject *)route->plan, args[0], number};
    result = PyObject_Vectorcall(self->finish, finish_args, 3, NULL);
    Py_DECREF(number);
    return result;
}

static void drop_routes(AllReduce *self) {
    for (int i = 0; i < self->route_count; i++) {
        Py_CLEAR(self->routes[i].dtype);
        Py_CLEAR(self->routes[i].op);
        Py_CLEAR(self->routes[i].plan);
    }
    self->route_count = self->oldest = 0;
}

static PyObject *AllReduce_route(AllReduce *self, PyObject *args) {
    PyObject *dtype, *op, *plan;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "OOnO!", &dtype, &op, &nbytes, &OneShotType, &plan)) return NULL;
    if (nbytes != ((OneShot *)plan)->nbytes) {
        PyErr_SetString(PyExc_ValueError, "route: nbytes differs from the plan's");
        return NULL;
    }
    Route *route = find_route(self, dtype, op, nbytes);
    if (route != NULL) {
        Py_SETREF(route->plan, (OneShot *)Py_NewRef(plan));
        Py_RETURN_NONE;
    }
    if (self->route_count < ROUTES) {
        route = &self->routes[self->route_count++];
    } else {
        route = &self->routes[self->oldest];
        self->oldest = (self->oldest + 1) % ROUTES;
        Py_CLEAR(route->dtype);
        Py_CLEAR(route->op);
        Py_CLEAR(route->plan);
    }
    route->dtype = Py_NewRef(dtype);
    route->op = Py_NewRef(op);
    route->nbytes = nbytes;
    route->plan = (OneShot *)Py_NewRef(plan);
    Py_RETURN_NONE;
}

static PyObject *AllReduce_clear(AllReduce *self, PyObject *Py_UNUSED(ignored)) {
    drop_routes(self);
    Py_RETURN_NONE;
}

static PyObject *AllReduce_take(AllReduce *self, PyObject *const *args, Py_ssize_t nargs) {
    long long count = 1;
    if (nargs > 1 || (nargs == 1 && (count = PyLong_AsLongLong(args[0])) == -1 &&
                      PyErr_Occurred()))
        return NULL;
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "take: count must be >= 0");
        return NULL;
    }
    int64_t first = self->calls + 1;
    self->calls += count;
    return PyLong_FromLongLong(first);
}

static int AllReduce_init(AllReduce *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"general", "finish", "tensor_type", "default_op", NULL};
    PyObject *general, *finish, *tensor_type, *default_op;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!O", keywords, &general, &finish,
                                     &PyType_Type, &tensor_type, &default_op))
        return -1;
    Py_XSETREF(self->general, Py_NewRef(general));
    Py_XSETREF(self->finish, Py_NewRef(finish));
    Py_XSETREF(self->tensor_type, Py_NewRef(tensor_type));
    Py_XSETREF(self->default_op, Py_NewRef(default_op));
    drop_routes(self);
    self->calls = 0;
    self->vectorcall = (vectorcallfunc)AllReduce_vectorcall;
    return 0;
}

static int AllReduce_traverse(AllReduce *self, visitproc visit, void *arg) {
    Py_VISIT(self->general);
    Py_VISIT(self->finish);
    Py_VISIT(self->tensor_type);
    Py_VISIT(self->default_op);
    for (int i = 0; i < self->route_count; i++) {
        Py_VISIT(self->routes[i].dtype);
        Py_VISIT(self->routes[i].op);
        Py_VISIT(self->routes[i].plan);
    }
    return 0;
}

static int AllReduce_tp_clear(AllReduce *self) {
    Py_CLEAR(self->general);
    Py_CLEAR(self->finish);
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->default_op);
    drop_routes(self);
    return 0;
}

static void AllReduce_dealloc(AllReduce *self) {
    PyObject_GC_UnTrack(self);
    AllReduce_tp_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *AllReduce_call(AllReduce *self, PyObject *args, PyObject *kwargs) {
    if (self->vectorcall == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "AllReduce used before __init__");
        return NULL;
    }
    return PyVectorcall_Call((PyObject *)self, args, kwargs);
}

static PyObject *AllReduce_get_calls(AllReduce *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLongLong(self->calls);
}

static PyGetSetDef AllReduce_getset[] = {
    {"calls", (getter)AllReduce_get_calls, NULL, "The last all-reduce number handed out.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMethodDef AllReduce_methods[] = {
    {"route", (PyCFunction)AllReduce_route, METH_VARARGS,
     "route(dtype, op, nbytes, plan): from now on, calls of a contiguous CPU torch.Tensor of "
     "that dtype and size with that op (compared by identity) run ``plan`` (a OneShot of "
     "``nbytes``) here; a route with that key gets the new plan, else the oldest of 8 goes "
     "to make room."},
    {"clear", (PyCFunction)AllReduce_clear, METH_NOARGS,
     "clear(): drop every route (and the plans they hold): all calls go to ``general``."},
    {"take", (PyCFunction)(void (*)(void))AllReduce_take, METH_FASTCALL,
     "take(count=1): the first of the next ``count`` (>= 0) all-reduce numbers, for calls "
     "made elsewhere (the general path, a native run)."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject AllReduceType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shardline_custom_allreduce._native.AllReduce",
    .tp_basicsize = sizeof(AllReduce),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(AllReduce, vectorcall),
    .tp_call = (ternaryfunc)AllReduce_call,
    .tp_doc = "AllReduce(general, finish, tensor_type, default_op): a communicator's "
              "all_reduce(tensor, op=default_op). A call whose tensor's type, dtype, size and "
              "op have a route (a contiguous CPU tensor) takes the next number and runs the "
              "route's one-shot plan here, calling finish(plan, tensor, number) where the "
              "others have not arrived within the spin; any other call is general(tensor, "
              "op)'s, which numbers its calls with take().",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)AllReduce_init,
    .tp_traverse = (traverseproc)AllReduce_traverse,
    .tp_clear = (inquiry)AllReduce_tp_clear,
    .tp_dealloc = (destructor)AllReduce_dealloc,
    .tp_methods = AllReduce_methods,
    .tp_getset = AllReduce_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "custom_ar's one-shot all-reduce per-call path in C.", -1, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    data_ptr_name = PyUnicode_InternFromString("data_ptr");
    dtype_attr = PyUnicode_InternFromString("dtype");
    nbytes_attr = PyUnicode_InternFromString("nbytes");
    is_cpu_attr = PyUnicode_InternFromString("is_cpu");
    is_contiguous_attr = PyUnicode_InternFromString("is_contiguous");
    op_keyword = PyUnicode_InternFromString("op");
    if (data_ptr_name == NULL || dtype_attr == NULL || nbytes_attr == NULL ||
        is_cpu_attr == NULL || is_contiguous_attr == NULL || op_keyword == NULL ||
        PyType_Ready(&OneShotType) < 0 || PyType_Ready(&AllReduceType) < 0)
        return NULL;
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
        PyModule_AddObjectRef(result, "OneShot", (PyObject *)&OneShotType) < 0 ||
        PyModule_AddObjectRef(result, "AllReduce", (PyObject *)&AllReduceType) < 0) {
        Py_XDECREF(dtypes);
        Py_DECREF(result);
        return NULL;
    }
    return result;
}
