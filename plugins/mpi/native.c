/* The MPI communicator's all-reduce as a native entry point (native_all_reduce.h), for C code
 * that runs many operations in one call, built without an MPI to compile against: the caller
 * passes the addresses of MPI_Iallreduce, MPI_Test and MPI_Error_string, resolved in the MPI
 * library mpi4py loaded, and the handles of the communicator, datatype and operation as mpi4py
 * gives them.
 * Open MPI only (its handles are pointers; the caller checks the vendor).
 *
 * A call is what MpiCommunicator.all_reduce does: a nonblocking all-reduce from a copy of the
 * input into the tensor's own memory (same call, same bits), completed by testing it (each
 * test also moves it forward), tests_per_check tests a check, the checks made as wait_until
 * makes them (native_wait.h), failing after timeout_s. A failure's message says what happened,
 * MPI's own text for an MPI error code; the communicator adds where (rank, group) and types it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "native_all_reduce.h"
#include "native_wait.h"

typedef int (*iallreduce_function)(const void *send, void *receive, int count, void *datatype,
                                   void *op, void *comm, void **request);
typedef int (*test_function)(void **request, int *flag, void *status);
typedef int (*error_string_function)(int code, char *text, int *length);

/* Room for an MPI_Status (24 bytes in Open MPI) and for an error's text (MPI_MAX_ERROR_STRING:
 * 256 in Open MPI). */
enum { STATUS_BYTES = 64, ERROR_TEXT_BYTES = 512 };

typedef struct {
    shardline_native_all_reduce entry; /* first: the capsule's pointer */
    iallreduce_function iallreduce;
    test_function test;
    error_string_function error_string;
    void *comm, *datatype, *op;
    int count, tests_per_check;
    size_t nbytes;
    long long calls_left;
    shardline_wait_policy wait;
    void *input;   /* the copy the all-reduce sends from */
    void *request; /* the all-reduce in flight */
    int failed_code;
    _Alignas(16) unsigned char status[STATUS_BYTES];
} MpiRun;

/* Up to tests_per_check tests of the request in flight: 1 done, 0 not yet, -1 failed (its
 * code kept). */
static int request_check(void *context) {
    MpiRun *run = context;
    for (int test = 0; test < run->tests_per_check; test++) {
        int done = 0, code = run->test(&run->request, &done, run->status);
        if (code != 0) {
            run->failed_code = code;
            return -1;
        }
        if (done) return 1;
    }
    return 0;
}

static int mpi_all_reduce(void *context, void *data, char *error, size_t size) {
    MpiRun *run = context;
    if (run->calls_left <= 0) {
        snprintf(error, size, "a native all-reduce run was called more often than the calls it "
                              "was made for");
        return SHARDLINE_NATIVE_FAILED;
    }
    run->calls_left--;
    memcpy(run->input, data, run->nbytes);
    run->request = NULL;
    int code = run->iallreduce(run->input, data, run->count, run->datatype, run->op, run->comm,
                               &run->request);
    int state = code != 0 ? (run->failed_code = code, -1) : request_check(run);
    if (state == 0) state = shardline_wait(request_check, run, &run->wait);
    if (state > 0) return 0;
    if (state == 0) {
        snprintf(error, size, "no answer from peers within %g s", run->wait.timeout_s);
        return SHARDLINE_NATIVE_TIMED_OUT;
    }
    char text[ERROR_TEXT_BYTES] = "";
    int length = 0;
    if (run->error_string(run->failed_code, text, &length) != 0 || length < 0) length = 0;
    text[length < ERROR_TEXT_BYTES ? length : ERROR_TEXT_BYTES - 1] = '\0';
    snprintf(error, size, "%s (MPI error code %d)", length ? text : "MPI error", run->failed_code);
    return SHARDLINE_NATIVE_FAILED;
}

static void run_free(PyObject *capsule) {
    MpiRun *run = PyCapsule_GetPointer(capsule, SHARDLINE_NATIVE_ALL_REDUCE);
    if (run == NULL) return;
    PyMem_Free(run->input);
    PyMem_Free(run);
}

static PyObject *all_reduce_run(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"iallreduce", "test", "error_string", "comm", "datatype", "op",
                               "count", "nbytes", "calls", "timeout_s", "yield_s",
                               "spin_checks", "tests_per_check", "share_cpu", "first_sleep_s",
                               "max_sleep_s", "status_bytes", NULL};
    unsigned long long iallreduce, test, error_string, comm, datatype, op;
    int count, spin_checks, tests_per_check, share_cpu;
    Py_ssize_t nbytes, status_bytes;
    long long calls;
    double timeout_s, yield_s, first_sleep_s, max_sleep_s;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "KKKKKKinLddiipddn", keywords, &iallreduce, &test, &error_string,
            &comm, &datatype, &op, &count, &nbytes, &calls, &timeout_s, &yield_s,
            &spin_checks, &tests_per_check, &share_cpu, &first_sleep_s, &max_sleep_s,
            &status_bytes))
        return NULL;
    if (!iallreduce || !test || !error_string || count < 1 || nbytes < 1 || calls < 0 ||
        tests_per_check < 1 || spin_checks < 0 || first_sleep_s <= 0 ||
        max_sleep_s < first_sleep_s || status_bytes < 1 || status_bytes > STATUS_BYTES) {
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
    run->error_string = (error_string_function)(uintptr_t)error_string;
    run->comm = (void *)(uintptr_t)comm;
    run->datatype = (void *)(uintptr_t)datatype;
    run->op = (void *)(uintptr_t)op;
    run->count = count;
    run->nbytes = (size_t)nbytes;
    run->calls_left = calls;
    run->tests_per_check = tests_per_check;
    run->wait = (shardline_wait_policy){.spin_checks = spin_checks,
                                        .share_cpu = share_cpu,
                                        .yield_s = yield_s,
                                        .first_sleep_s = first_sleep_s,
                                        .max_sleep_s = max_sleep_s,
                                        .timeout_s = timeout_s};
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
     "all_reduce_run(iallreduce, test, error_string, comm, datatype, op, count, nbytes, calls, "
     "timeout_s, yield_s, spin_checks, tests_per_check, share_cpu, first_sleep_s, max_sleep_s, "
     "status_bytes): a PyCapsule (native_all_reduce.h) making ``calls`` "
     "all-reduces of ``count`` elements (``nbytes``) through the MPI functions at those "
     "addresses (see the module's source)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "The MPI all-reduce as a native entry point.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
