/* The floor of a 2-rank one-shot all-reduce through shared memory on this machine: two
 * threads pinned to cores 0 and 1 do exactly what custom_ar's one-shot path does per call (copy
 * the input to their slot of the call's parity, release-store the call number, spin on the
 * peer's flag with acquire loads, add both slots into an output), with no Python, no tensor
 * allocation and no process boundary. Compare `shardline bench comm -c custom_ar --back-to-back`
 * with it: what is left above this line is the per-call overhead of the Python call. x86-64
 * (the spin pauses with _mm_pause).
 *
 *     cc -O3 -pthread benchmarks/shared_memory_floor.c -o /tmp/shm_floor && /tmp/shm_floor
 *
 * Prints a table (median µs per all-reduce over 5 runs of 20000 calls each, float32) and the
 * same figures as one JSON line. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { MAX_BYTES = 1 << 16, CALLS = 20000, WARM_UP = 100, RUNS = 5 };

static float slots[2][2][MAX_BYTES / 4] __attribute__((aligned(64))); /* [parity][rank] */
static float outputs[2][MAX_BYTES / 4] __attribute__((aligned(64)));
static int64_t flags[2][8] __attribute__((aligned(64))); /* one cache line per rank */

typedef struct {
    int rank, nbytes;
    double us_per_call;
} Rank;

static double seconds_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

static void *run_rank(void *argument) {
    Rank *self = argument;
    int rank = self->rank, peer = 1 - rank, count = self->nbytes / 4;
    cpu_set_t cores;
    CPU_ZERO(&cores);
    CPU_SET(rank, &cores);
    pthread_setaffinity_np(pthread_self(), sizeof cores, &cores);
    static float inputs[2][MAX_BYTES / 4];
    float *input = inputs[rank], *output = outputs[rank];
    for (int i = 0; i < count; i++) input[i] = (float)(rank + i);
    double start = 0;
    for (int64_t call = 1; call <= CALLS; call++) {
        if (call == WARM_UP) start = seconds_now();
        memcpy(slots[call & 1][rank], input, self->nbytes);
        __atomic_store_n(&flags[rank][0], call, __ATOMIC_RELEASE);
        while (__atomic_load_n(&flags[peer][0], __ATOMIC_ACQUIRE) < call) _mm_pause();
        const float *first = slots[call & 1][0], *second = slots[call & 1][1];
        for (int i = 0; i < count; i++) output[i] = first[i] + second[i];
        input[0] = output[count - 1] * 0.0f + (float)rank; /* the next input depends on it */
    }
    self->us_per_call = (seconds_now() - start) / (CALLS - WARM_UP + 1) * 1e6;
    return NULL;
}

static int compare(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(void) {
    const int sizes[] = {4, 1024, 4096, 16384, 65536};
    const int size_count = sizeof sizes / sizeof sizes[0];
    double medians[sizeof sizes / sizeof sizes[0]];
    printf("%-8s %12s\n", "size", "median us");
    for (int k = 0; k < size_count; k++) {
        double runs[RUNS];
        for (int r = 0; r < RUNS; r++) {
            memset(flags, 0, sizeof flags);
            Rank ranks[2] = {{0, sizes[k], 0}, {1, sizes[k], 0}};
            pthread_t threads[2];
            for (int i = 0; i < 2; i++) pthread_create(&threads[i], NULL, run_rank, &ranks[i]);
            for (int i = 0; i < 2; i++) pthread_join(threads[i], NULL);
            runs[r] = ranks[0].us_per_call > ranks[1].us_per_call ? ranks[0].us_per_call
                                                                  : ranks[1].us_per_call;
        }
        qsort(runs, RUNS, sizeof runs[0], compare);
        medians[k] = runs[RUNS / 2];
        printf("%-8d %12.2f\n", sizes[k], medians[k]);
    }
    printf("{\"float32_one_shot_floor_us\": {");
    for (int k = 0; k < size_count; k++)
        printf("%s\"%d\": %.3f", k ? ", " : "", sizes[k], medians[k]);
    printf("}}\n");
    return 0;
}
