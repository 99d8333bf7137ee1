/* The word operations of the mp executor's shared-memory ring in C (see shm_ring.py for the
 * layout and the protocol): writing a chunk into its slot and publishing it with a release
 * store, taking the next chunk for a reader after an acquire load (spinning a bounded number
 * of checks first), and the read positions and "sleeping" flags. Waits past the spin,
 * deadlines and doorbells stay in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "native_wait.h" /* SHARDLINE_CPU_RELAX */

#define WORDS_PER_SLOT 3 /* sequence (message number + 1), length, more-follows */
#define MAX_READERS 64   /* put() reports sleeping readers as bits of one word */

typedef struct {
    PyObject_HEAD
    Py_buffer memory; /* the mapped segment, held while this object lives */
    int64_t *words;
    char *data;
    Py_ssize_t slots, readers, slot_bytes;
} RingCore;

static inline int64_t *position(RingCore *self, Py_ssize_t reader) {
    return &self->words[self->slots * WORDS_PER_SLOT + reader];
}

static inline int64_t *sleeping(RingCore *self, Py_ssize_t reader) {
    return &self->words[self->slots * WORDS_PER_SLOT + self->readers + reader];
}

static inline int64_t *slot_words(RingCore *self, int64_t seq) {
    return &self->words[(seq % self->slots) * WORDS_PER_SLOT];
}

static int has_room(RingCore *self, int64_t seq) {
    int64_t oldest_allowed = seq - self->slots + 1;
    for (Py_ssize_t reader = 0; reader < self->readers; reader++)
        if (__atomic_load_n(position(self, reader), __ATOMIC_ACQUIRE) < oldest_allowed) return 0;
    return 1;
}

static int ready(RingCore *self, Py_ssize_t reader) {
    int64_t seq = __atomic_load_n(position(self, reader), __ATOMIC_RELAXED);
    return __atomic_load_n(slot_words(self, seq), __ATOMIC_ACQUIRE) == seq + 1;
}

static int check_open(RingCore *self) {
    if (self->words != NULL) return 0;
    PyErr_SetString(PyExc_ValueError, "the ring's mapping was released");
    return -1;
}

static int parse_reader(RingCore *self, PyObject *object, Py_ssize_t *reader) {
    if (check_open(self) < 0) return -1;
    *reader = PyLong_AsSsize_t(object);
    if (*reader == -1 && PyErr_Occurred()) return -1;
    if (*reader < 0 || *reader >= self->readers) {
        PyErr_Format(PyExc_ValueError, "reader %zd: allowed 0..%zd", *reader, self->readers - 1);
        return -1;
    }
    return 0;
}

static PyObject *RingCore_put(RingCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "expected (seq, chunk, more)");
        return NULL;
    }
    if (check_open(self) < 0) return NULL;
    int64_t seq = PyLong_AsLongLong(args[0]);
    if (seq == -1 && PyErr_Occurred()) return NULL;
    int more = PyObject_IsTrue(args[2]);
    if (more < 0) return NULL;
    if (!has_room(self, seq)) return PyLong_FromLong(-1);
    Py_buffer chunk;
    if (PyObject_GetBuffer(args[1], &chunk, PyBUF_SIMPLE) < 0) return NULL;
    if (chunk.len > self->slot_bytes) {
        PyBuffer_Release(&chunk);
        PyErr_SetString(PyExc_ValueError, "chunk larger than a slot");
        return NULL;
    }
    int64_t *words = slot_words(self, seq);
    memcpy(self->data + (seq % self->slots) * self->slot_bytes, chunk.buf, chunk.len);
    words[1] = chunk.len;
    words[2] = more;
    PyBuffer_Release(&chunk);
    __atomic_store_n(&words[0], seq + 1, __ATOMIC_RELEASE); /* publish last */
    /* Publish, then read the sleeping flags; a reader raises its flag, then re-checks. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint64_t sleepers = 0;
    for (Py_ssize_t reader = 0; reader < self->readers; reader++)
        if (__atomic_load_n(sleeping(self, reader), __ATOMIC_RELAXED))
            sleepers |= (uint64_t)1 << reader;
    return PyLong_FromUnsignedLongLong(sleepers);
}

static PyObject *RingCore_take(RingCore *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t reader;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "expected (reader, spin_checks)");
        return NULL;
    }
    if (parse_reader(self, args[0], &reader) < 0) return NULL;
    long spin_checks = PyLong_AsLong(args[1]);
    if (spin_checks == -1 && PyErr_Occurred()) return NULL;
    for (long check = 0; !ready(self, reader); check++) {
        if (check >= spin_checks) Py_RETURN_NONE;
        SHARDLINE_CPU_RELAX();
    }
    int64_t seq = __atomic_load_n(position(self, reader), __ATOMIC_RELAXED);
    int64_t *words = slot_words(self, seq);
    int64_t length = words[1];
    if (length < 0 || length > self->slot_bytes) {
        PyErr_Format(PyExc_RuntimeError, "ring slot of message %lld says %lld bytes",
                     (long long)seq, (long long)length);
        return NULL;
    }
    PyObject *payload =
        PyBytes_FromStringAndSize(self->data + (seq % self->slots) * self->slot_bytes, length);
    if (payload == NULL) return NULL;
    PyObject *more = PyBool_FromLong(words[2] != 0);
    /* Done reading the slot: the writer may reuse it. */
    __atomic_store_n(position(self, reader), seq + 1, __ATOMIC_RELEASE);
    PyObject *result = PyTuple_Pack(2, payload, more);
    Py_DECREF(payload);
    Py_DECREF(more);
    return result;
}

static PyObject *RingCore_has_room(RingCore *self, PyObject *seq_object) {
    if (check_open(self) < 0) return NULL;
    int64_t seq = PyLong_AsLongLong(seq_object);
    if (seq == -1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(has_room(self, seq));
}

static PyObject *RingCore_ready(RingCore *self, PyObject *reader_object) {
    Py_ssize_t reader;
    if (parse_reader(self, reader_object, &reader) < 0) return NULL;
    return PyBool_FromLong(ready(self, reader));
}

static PyObject *RingCore_set_sleeping(RingCore *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t reader;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "expected (reader, asleep)");
        return NULL;
    }
    if (parse_reader(self, args[0], &reader) < 0) return NULL;
    int asleep = PyObject_IsTrue(args[1]);
    if (asleep < 0) return NULL;
    __atomic_store_n(sleeping(self, reader), asleep, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *RingCore_release(RingCore *self, PyObject *unused) {
    if (self->memory.obj != NULL) PyBuffer_Release(&self->memory);
    self->words = NULL;
    self->data = NULL;
    Py_RETURN_NONE;
}

static int RingCore_init(RingCore *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"memory", "slots", "readers", "slot_bytes", NULL};
    PyObject *memory;
    Py_ssize_t slots, readers, slot_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Onnn", keywords, &memory, &slots, &readers,
                                     &slot_bytes))
        return -1;
    if (slots < 1 || readers < 1 || readers > MAX_READERS || slot_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "slots %zd, readers %zd: allowed slots >= 1, 1..%d readers",
                     slots, readers, MAX_READERS);
        return -1;
    }
    if (self->memory.obj != NULL) PyBuffer_Release(&self->memory);
    if (PyObject_GetBuffer(memory, &self->memory, PyBUF_WRITABLE) < 0) return -1;
    Py_ssize_t header = (slots * WORDS_PER_SLOT + 2 * readers) * 8;
    if (self->memory.len < header + slots * slot_bytes || ((uintptr_t)self->memory.buf) % 8) {
        PyBuffer_Release(&self->memory);
        PyErr_SetString(PyExc_ValueError, "the segment is smaller than the ring's layout");
        return -1;
    }
    self->words = self->memory.buf;
    self->data = (char *)self->memory.buf + header;
    self->slots = slots;
    self->readers = readers;
    self->slot_bytes = slot_bytes;
    return 0;
}

static void RingCore_dealloc(RingCore *self) {
    if (self->memory.obj != NULL) PyBuffer_Release(&self->memory);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef RingCore_methods[] = {
    {"put", (PyCFunction)(void (*)(void))RingCore_put, METH_FASTCALL,
     "put(seq, chunk, more): write message ``seq``'s chunk and publish it; -1 (nothing "
     "written) while a reader still needs the slot, else the sleeping readers as bits."},
    {"take", (PyCFunction)(void (*)(void))RingCore_take, METH_FASTCALL,
     "take(reader, spin_checks): ``(chunk, more)`` of the reader's next message, advancing its "
     "position, or None when none is published within ``spin_checks`` checks."},
    {"has_room", (PyCFunction)RingCore_has_room, METH_O,
     "has_room(seq): whether every reader is done with the slot message ``seq`` reuses."},
    {"ready", (PyCFunction)RingCore_ready, METH_O,
     "ready(reader): whether a message for ``reader`` is published."},
    {"set_sleeping", (PyCFunction)(void (*)(void))RingCore_set_sleeping, METH_FASTCALL,
     "set_sleeping(reader, asleep): raise or lower the reader's \"ring my doorbell\" flag."},
    {"release", (PyCFunction)RingCore_release, METH_NOARGS,
     "release(): let go of the mapping (before it is closed); later operations raise."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject RingCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shardline_executors._ring_native.RingCore",
    .tp_basicsize = sizeof(RingCore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "RingCore(memory, slots, readers, slot_bytes): a mapped ring's word operations.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RingCore_init,
    .tp_dealloc = (destructor)RingCore_dealloc,
    .tp_methods = RingCore_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ring_native", "The mp ring's word operations in C.", -1, NULL};

PyMODINIT_FUNC PyInit__ring_native(void) {
    if (PyType_Ready(&RingCoreType) < 0) return NULL;
    PyObject *result = PyModule_Create(&module);
    if (result == NULL) return NULL;
    if (PyModule_AddIntConstant(result, "MAX_READERS", MAX_READERS) < 0 ||
        PyModule_AddObjectRef(result, "RingCore", (PyObject *)&RingCoreType) < 0) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}
