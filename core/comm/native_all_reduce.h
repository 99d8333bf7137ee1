/* A communicator's all-reduce as a C entry point (Communicator.native_all_reduce): what C code
 * that runs many operations in one call (shardline.layers._kernels' decode_layers) calls
 * between them, without returning to Python. It travels in a PyCapsule named
 * SHARDLINE_NATIVE_ALL_REDUCE holding this struct; the capsule owns it and what it points to.
 *
 * all_reduce(context, data, error, error_size): the sum over the group of the tensor at data
 * (the shape and dtype the entry point was made for), written back to data, as the
 * communicator's all_reduce would compute it. It may be called from a thread that does not
 * hold the GIL, and touches no Python object. Returns 0, or a failure with a message in error
 * (at most error_size bytes, NUL-terminated): SHARDLINE_NATIVE_TIMED_OUT when a deadline
 * passed before the peers answered (the communicator is then unusable, as after any
 * timed-out collective), SHARDLINE_NATIVE_FAILED for any other failure (the calls it was
 * made for are used up; the backend reported an error). Each rank of the group makes the
 * same calls in the same order. */
#ifndef SHARDLINE_NATIVE_ALL_REDUCE_H
#define SHARDLINE_NATIVE_ALL_REDUCE_H

#include <stddef.h>

#define SHARDLINE_NATIVE_ALL_REDUCE "shardline.native_all_reduce"
#define SHARDLINE_NATIVE_FAILED (-1)
#define SHARDLINE_NATIVE_TIMED_OUT (-2)

typedef struct {
    int (*all_reduce)(void *context, void *data, char *error, size_t error_size);
    void *context;
} shardline_native_all_reduce;

#endif
