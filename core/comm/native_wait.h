/* shardline.comm.waiting.wait_until's phases for C code that waits without the GIL (a native
 * all-reduce entry point between a decode step's layers): check spin_checks times in a row
 * (a pause between checks), then keep checking until yield_s has passed, yielding the CPU
 * between checks when share_cpu, then sleep between checks from first_sleep_s doubling up to
 * max_sleep_s, until timeout_s. The policy's fields come from the communicator's Polling, so
 * the C and Python waits of one group behave alike. Header only: each extension that includes
 * it gets its own copy (a plugin does not link against the core's extension). */
#ifndef SHARDLINE_NATIVE_WAIT_H
#define SHARDLINE_NATIVE_WAIT_H

#include <sched.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SHARDLINE_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define SHARDLINE_CPU_RELAX() __asm__ __volatile__("yield")
#else
#define SHARDLINE_CPU_RELAX() ((void)0)
#endif

typedef struct {
    int spin_checks, share_cpu;
    double yield_s, first_sleep_s, max_sleep_s, timeout_s;
} shardline_wait_policy;

/* CLOCK_MONOTONIC in seconds: time.monotonic()'s clock. */
static inline double shardline_seconds_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* Wait until check(context) returns non-zero (1: ready; negative: failed, stop waiting) and
 * return that value, or 0 once timeout_s has passed. */
static inline int shardline_wait(int (*check)(void *context), void *context,
                                 const shardline_wait_policy *policy) {
    int state;
    for (int spin = 0; spin < policy->spin_checks; spin++) {
        if ((state = check(context)) != 0) return state;
        SHARDLINE_CPU_RELAX();
    }
    double start = shardline_seconds_now(), sleep_s = policy->first_sleep_s;
    while ((state = check(context)) == 0) {
        double waited = shardline_seconds_now() - start;
        if (waited >= policy->timeout_s) return 0;
        if (waited < policy->yield_s) {
            if (policy->share_cpu) sched_yield();
            continue;
        }
        struct timespec pause = {(time_t)sleep_s, (long)((sleep_s - (time_t)sleep_s) * 1e9)};
        nanosleep(&pause, NULL);
        sleep_s = sleep_s * 2 < policy->max_sleep_s ? sleep_s * 2 : policy->max_sleep_s;
    }
    return state;
}

#endif
