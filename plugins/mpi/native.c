/* The MPI communicator's all-reduce as a native entry point (native_all_reduce.h), for C code
 * that runs many operations in one call, built without an MPI to compile against: the caller
 * passes the addresses of MPI_Iallreduce and MPI_Test, resolved in the MPI library mpi4py
 * loaded, and the handles of the communicator, datatype and operation as mpi4py gives them.
 * Open MPI only (its handles are pointers; the caller checks the vendor).
 *
 * A call is what MpiCommunicator.all_reduce does: a nonblocking all-reduce from a copy of the
 * input into the tensor's own memory (same call, same bits), completed by testing it (each
 * test also moves it forward): spin_checks checks of tests_per_check tests, then checks with
 * the CPU yielded between them (share_cpu) until yield_s has passed, then sleeps between
 * checks from first_sleep_s doubling to max_sleep_s (shardline.comm.waiting.Polling), failing
 * after timeout_s.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "native_all_reduce.h"

typedef int (*iallreduce_function)(const void *send, void *receive, int count, void *datatype,
                                   void *op, void *comm, void **request);
typedef int (*test_function)(void **request, int *flag, void *status);

enum { STATUS_BYTES = 64 }; /* room for an MPI_Status (24 bytes in Open MPI) */

typedef struct {
    shardline_native_all_reduce entry; /* first: the capsule's pointer */
    iallreduce_function iallreduce;
    test_function test;
    void *comm, *datatype, *op;
    int count, rank, world_size, spin_checks, tests_per_check, share_cpu;
    size_t nbytes;
    long long calls_left;
    double timeout_s, yield_s, first_sleep_s, max_sleep_s;
    void *input; /* the copy the all-reduce sends from */
    _Alignas(16) unsigned char status[STATUS_BYTES];
} MpiRun;

static double seconds_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* Up to tests_per_check tests of the request: 1 done, 0 not yet, -1 with the message. */
static int check(MpiRun *run, void **request, char *error, size_t size) {
    for (int test = 0; test < run->tests_per_check; test++) {
        int done = 0, code = run->test(request, &done, run->status);
        if (code != 0) {
            snprintf(error, size, "mpi all_reduce on rank %d of %d: MPI error code %d",
                     run->rank, run->world_size, code);
            return -1;
        }
        if (done) return 1;
    }
    return 0;
}

static int mpi_all_reduce(void *context, void *data, char *error, size_t size) {
    MpiRun *run = context;
    if (run->calls_left <= 0) {
        snprintf(error, size, "mpi: a native all-reduce run was called more often than the "
                              "calls it was made for");
        return -1;
    }
    run->calls_left--;
    memcpy(run->input, data, run->nbytes);
    void *request = NULL;
    int code = run->iallreduce(run->input, data, run->count, run->datatype, run->op, run->comm,
                               &request);
    if (code != 0) {
        snprintf(error, size, "mpi all_reduce on rank %d of %d: MPI error code %d", run->rank,
                 run->world_size, code);
        return -1;
    }
    int done = 0;
    for (int spin = 0; spin <= run->spin_checks && !done; spin++)
        if ((done = check(run, &request, error, size)) < 0) return -1;
    double start = seconds_now(), sleep_s = run->first_sleep_s;
    while (!done) {
        double waited = seconds_now() - start;
        if (waited >= run->timeout_s) {
            snprintf(error, size, "mpi all_reduce on rank %d of %d: no answer from peers "
                                  "within %g s", run->rank, run->world_size, run->timeout_s);
            return -1;
        }
        if (waited < run->yield_s) {
            if (run->share_cpu) sched_yield();
        } else {
            struct timespec pause = {0, (long)(sleep_s * 1e9)};
            nanosleep(&pause, NULL);
            sleep_s = sleep_s * 2 < run->max_sleep_s ? sleep_s * 2 : run->max_sleep_s;
        }
        if ((done = check(run, &request, error, size)) < 0) return -1;
    }
    return 0;
}

static void run_free(PyObject *capsule) {
    MpiRun *run = PyCapsule_GetPointer(capsule, SHARDLINE_NATIVE_ALL_REDUCE);
    if (run == NULL) return;
    PyMem_Free(run->input);
    PyMem_Free(run);
}

static PyObject *all_reduce_run(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"iallreduce", "test", "comm", "datatype", "op", "count",
                               "nbytes", "calls", "rank", "world_size", "timeout_s",
                               "yield_s", "spin_checks", "tests_per_check", "share_cpu",
                               "first_sleep_s", "max_sleep_s", "status_bytes", NULL};
    unsigned long long iallreduce, test, comm, datatype, op;
    int count, rank, world_size, spin_checks, tests_per_check, share_cpu;
    Py_ssize_t nbytes, status_bytes;
    long long calls;
    double timeout_s, yield_s, first_sleep_s, max_sleep_s;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "KKKKKinLiiddiipddn", keywords, &iallreduce, &test, &comm, &datatype,
            &op, &count, &nbytes, &calls, &rank, &world_size, &timeout_s, &yield_s,
            &spin_checks, &tests_per_check, &share_cpu, &first_sleep_s, &max_sleep_s,
            &status_bytes))
        return NULL;
    if (!iallreduce || !test || count < 1 || nbytes < 1 || calls < 0 || tests_per_check < 1 ||
        spin_checks < 0 || first_sleep_s <= 0 || max_sleep_s < first_sleep_s ||
        status_bytes < 1 || status_bytes > STATUS_BYTES) {
        PyErr_SetString(PyExc_ValueError, "all_reduce_run: an argument is out of range");
        return NULL;
    }
    MpiRun *run = PyMem_Calloc(1, sizeof *run);
    if (run == NULL) return PyErr_NoMemory();
    run->input = PyMem_Malloc(nbytes);
    if (run->input == NULL) {
        PyMem_Free(run);
        return PyErr_NoMemory();
    }
    run->entry.all_reduce = mpi_all_reduce;
    run->entry.context = run;
    run->iallreduce = (iallreduce_function)(uintptr_t)iallreduce;
    run->test = (test_function)(uintptr_t)test;
    run->comm = (void *)(uintptr_t)comm;
    run->datatype = (void *)(uintptr_t)datatype;
    run->op = (void *)(uintptr_t)op;
    run->count = count;
    run->nbytes = (size_t)nbytes;
    run->calls_left = calls;
    run->rank = rank;
    run->world_size = world_size;
    run->timeout_s = timeout_s;
    run->yield_s = yield_s;
    run->spin_checks = spin_checks;
    run->tests_per_check = tests_per_check;
    run->share_cpu = share_cpu;
    run->first_sleep_s = first_sleep_s;
    run->max_sleep_s = max_sleep_s;
    PyObject *capsule = PyCapsule_New(run, SHARDLINE_NATIVE_ALL_REDUCE, run_free);
    if (capsule == NULL) {
        PyMem_Free(run->input);
        PyMem_Free(run);
    }
    return capsule;
}

static PyMethodDef methods[] = {
    {"all_reduce_run", (PyCFunction)(void (*)(void))all_reduce_run,
     METH_VARARGS | METH_KEYWORDS,
     "all_reduce_run(iallreduce, test, comm, datatype, op, count, nbytes, calls, rank, "
     "world_size, timeout_s, yield_s, spin_checks, tests_per_check, share_cpu, first_sleep_s, "
     "max_sleep_s, status_bytes): a PyCapsule (native_all_reduce.h) making ``calls`` "
     "all-reduces of ``count`` elements (``nbytes``) through the MPI functions at those "
     "addresses (see the module's source)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "The MPI all-reduce as a native entry point.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
