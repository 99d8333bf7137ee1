/* The per-layer operations of a decoder step between its weight multiplies, in C, for
 * float32 and bfloat16 tensors on the CPU (see kernels.py, which checks dtypes, shapes and
 * contiguity and passes raw addresses): RMSNorm with the residual add, RoPE with the KV cache
 * store, decode attention over a paged cache, and SiLU-and-multiply. Each replaces several
 * torch operations whose dispatch, not arithmetic, dominates at decode batch sizes.
 *
 * Built with -ffp-contract=off: RoPE rounds as torch does (a product, a product, a sum, then
 * to the element type), so it is bit-identical to the torch path; the others sum in a
 * different order or use the polynomial exp below, within a few float32 ulps of torch. Loops
 * are written so that gcc vectorizes them (independent partial sums in lanes) for the widest
 * instruction set the CPU has (target_clones), with no -ffast-math (-fno-trapping-math only:
 * it changes no value).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "native_all_reduce.h"
#include "native_wait.h" /* shardline_seconds_now */

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
 * without branches or library calls so that a loop over it vectorizes (on AVX2, only built
 * with -fno-trapping-math, as pyproject.toml builds it: else GCC keeps the clamps as branches,
 * and silu * up ran 4x slower than torch's at 16 rows). */
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

/* Query heads of one KV head that decode attention scores together (vector kernels). */
#define ATTENTION_GROUP 4

/* Floats of scratch decode attention needs for sequences of up to longest tokens: the scores
 * of ATTENTION_GROUP query heads, then their queries widened to float32 (bfloat16 tensors; the
 * portable kernel's query and sums, 2 d, after its one head's scores, fit too). */
static inline long attention_scratch_floats(long longest, long d) {
    return ATTENTION_GROUP * (longest + d);
}

/* ---- a team of threads ---------------------------------------------------------------------
 * A rank with several torch threads shares out each weight multiply with a team: the calling
 * thread and threads - 1 helpers claim chunks of the work one at a time from a shared ticket,
 * so a helper that is not running on a busy host holds up only the chunk it has claimed. A
 * chunk's outputs are computed as one thread computes them, so results do not depend on the
 * team's size, with one exception: decode attention splits long sequences into pieces when
 * the team has several threads (attention_pieces), and those results differ from one
 * thread's within rounding. Helpers wait for work spinning (TEAM_SPIN_S), then yielding the
 * CPU (until TEAM_YIELD_S), then asleep on a futex; the caller waits for the last chunk
 * spinning, then yielding. A call made while another thread's call has the team, or in a
 * forked child (which has none of the helpers), runs every chunk in its own thread. */

#define TEAM_SPIN_S 50e-6
#define TEAM_YIELD_S 2e-4
#define TEAM_CALLER_SPINS 4096
#define TEAM_MAX_CHUNKS 4096
#define TEAM_CAPSULE "shardline.layers._kernels.Team"

/* Runs one chunk of posted work; worker: which of the team's threads runs it (0: the caller,
 * 1 to helpers: a helper), for scratch space of its own. */
typedef void (*ChunkRun)(const void *context, long chunk, int worker);

typedef struct {
    _Alignas(64) _Atomic uint64_t ticket; /* chunks << 32 | the next chunk to claim */
    _Alignas(64) _Atomic long finished;   /* chunks of the posted work done */
    _Alignas(64) _Atomic uint32_t bell;   /* bumped for each posting; sleeping helpers wait on it */
    _Atomic int sleepers, closing, helpers_numbered;
    _Atomic int busy; /* a caller has posted work and not yet seen it finish */
    /* The posted work: written by the caller only while no chunk of the last one runs. */
    ChunkRun run;
    const void *context;
    pid_t owner;
    int helpers_started;
    pthread_t helpers[];
} Team;

/* Claims the posted work's next chunk into *chunk: 1, or 0 when every chunk is claimed. */
static int claim_chunk(Team *team, long *chunk) {
    uint64_t ticket = atomic_load(&team->ticket);
    while ((uint32_t)ticket < (uint32_t)(ticket >> 32))
        if (atomic_compare_exchange_weak(&team->ticket, &ticket, ticket + 1)) {
            *chunk = (long)(uint32_t)ticket;
            return 1;
        }
    return 0;
}

/* Runs chunks of the posted work as worker until none is left to claim. */
static void run_claimed_chunks(Team *team, int worker) {
    long chunk;
    while (claim_chunk(team, &chunk)) {
        team->run(team->context, chunk, worker);
        atomic_fetch_add_explicit(&team->finished, 1, memory_order_release);
    }
}

static int team_has_work(Team *team) {
    uint64_t ticket = atomic_load(&team->ticket);
    return (uint32_t)ticket < (uint32_t)(ticket >> 32) || atomic_load(&team->closing);
}

/* A helper's wait for a chunk to claim (or for the team to close): spin, yield, sleep. */
static void wait_for_work(Team *team) {
    double start = shardline_seconds_now();
    for (long checks = 1; !team_has_work(team); checks++) {
        SHARDLINE_CPU_RELAX();
        if (checks % 64 != 0) continue;
        double waited = shardline_seconds_now() - start;
        if (waited < TEAM_SPIN_S) continue;
        if (waited < TEAM_YIELD_S) {
            sched_yield();
            continue;
        }
        /* The caller bumps the bell after posting, then wakes the sleepers it counts: work
         * posted after the check below has changed the bell, so the wait returns at once. */
        uint32_t bell = atomic_load(&team->bell);
        atomic_fetch_add(&team->sleepers, 1);
        if (!team_has_work(team))
            syscall(SYS_futex, &team->bell, FUTEX_WAIT_PRIVATE, bell, NULL, NULL, 0);
        atomic_fetch_sub(&team->sleepers, 1);
    }
}

static void *helper_main(void *argument) {
    Team *team = argument;
    int worker = atomic_fetch_add(&team->helpers_numbered, 1) + 1;
    while (!atomic_load(&team->closing)) {
        run_claimed_chunks(team, worker);
        wait_for_work(team);
    }
    return NULL;
}

static void wake_helpers(Team *team) {
    atomic_fetch_add(&team->bell, 1);
    if (atomic_load(&team->sleepers) > 0)
        syscall(SYS_futex, &team->bell, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}

/* The threads work given to team runs on (NULL: 1, this one). */
static int team_workers(const Team *team) { return team == NULL ? 1 : 1 + team->helpers_started; }

/* run(context, c, worker) for every chunk c < chunks, shared out by team (NULL: this thread
 * alone, worker 0); returns when all have run. */
static void team_run(Team *team, long chunks, ChunkRun run, const void *context) {
    if (team == NULL || team->helpers_started == 0 || chunks < 2 ||
        atomic_exchange(&team->busy, 1)) { /* busy: another thread's call has the team */
        for (long c = 0; c < chunks; c++) run(context, c, 0);
        return;
    }
    team->run = run;
    team->context = context;
    atomic_store_explicit(&team->finished, 0, memory_order_relaxed);
    atomic_store(&team->ticket, (uint64_t)chunks << 32);
    wake_helpers(team);
    run_claimed_chunks(team, 0);
    for (long spins = 0; atomic_load_explicit(&team->finished, memory_order_acquire) < chunks;
         spins++) {
        if (spins < TEAM_CALLER_SPINS) SHARDLINE_CPU_RELAX();
        else sched_yield();
    }
    atomic_store(&team->busy, 0);
}

/* A team of threads (the caller and threads - 1 helpers), or NULL with MemoryError. Helpers
 * that cannot be started are left out (a smaller team). */
static Team *team_new(int threads) {
    Team *team = calloc(1, sizeof(Team) + sizeof(pthread_t) * (size_t)threads);
    if (team == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    team->owner = getpid();
    sigset_t all, old; /* helpers take no signals: Python handles them in its main thread */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    for (int i = 0; i < threads - 1; i++) {
        if (pthread_create(&team->helpers[i], NULL, helper_main, team) != 0) break;
        pthread_setname_np(team->helpers[i], "shardline-team"); /* as top -H and py-spy show */
        team->helpers_started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return team;
}

/* Ends the team's helpers and frees it. */
static void team_end(Team *team) {
    if (team->owner == getpid()) { /* a forked child's copy has no threads to end */
        atomic_store(&team->closing, 1);
        wake_helpers(team);
        for (int i = 0; i < team->helpers_started; i++) pthread_join(team->helpers[i], NULL);
    }
    free(team);
}

static void team_close(PyObject *capsule) {
    Team *team = PyCapsule_GetPointer(capsule, TEAM_CAPSULE);
    if (team != NULL) team_end(team);
}

/* The team an argument names (None: no team); NULL with an exception where it is not one,
 * with *failed set. A forked child's copy of a team: NULL (the caller runs alone). */
static Team *team_of(PyObject *argument, int *failed) {
    *failed = 0;
    if (argument == Py_None) return NULL;
    Team *team = PyCapsule_GetPointer(argument, TEAM_CAPSULE);
    if (team == NULL) *failed = 1;
    return team != NULL && team->owner == getpid() ? team : NULL;
}

/* ---- linear: y = x W^T + b, W blocked for the kernel ------------------------------------
 * W [out, in] is stored block after block: block k holds outputs 64k..64k+63 input by input
 * ([in][64]); the last holds the rest ([in][out % 64] when out is not a multiple of 64), so the
 * layout takes exactly out x in elements. The elements are float32, or bfloat16 (weights held
 * in half the memory): each is widened exactly to float32 as it is read and multiplied in
 * float32, so a bfloat16 weight gives the very sums its float32 copy would (the same terms in
 * the same order). A full bfloat16 block row holds its outputs in pairs, m and 16 + m of each
 * 32 side by side (weights_2x16), so that one load widens into two vectors with a shift and a
 * mask, no shuffle. A tile of rows of x keeps its sums in registers, 4
 * vectors of 16 per row and block, broadcasting x[r, i] against the block's row i: no
 * horizontal sums. Up to LINEAR_PAIR_MAX_ROWS rows (decodes) go through two full blocks at a
 * time: two streams through memory, which one core reads faster than one. One row takes four
 * blocks (four streams) in one pass where there are four, else two. Two or
 * more take them a piece (LINEAR_PIECE inputs) at a time, which every tile
 * of up to 3 rows takes from the L1 cache while the tiles prefetch the next piece, so the
 * weight streams in while it is computed on: 4 to 32 rows 1.1-1.6x and 64 rows 1.1x faster
 * than tiles of 6 rows against one block, each of which read the block in turn (one thread,
 * one run; at one row the prefetches cost 5-7%). More rows (a prefill) are compute-bound:
 * tiles of 6 rows against one block, in one pass. Every output's sum is the same on every
 * path (the same terms in the same order; the sums kept between pieces are stored whole).
 * AVX-512 (F, BW, VL), checked at run time; else AVX2 and FMA (linear_blocks_avx2). */

#define LINEAR_BLOCK 64
#define LINEAR_TILE_ROWS 6
#define LINEAR_PAIR_MAX_ROWS 64
#define LINEAR_PAIR_TILE_ROWS 3
/* Rows of a block pair in a piece: 32 x 128 floats, 16 KiB (L1 holds it and the next). */
#define LINEAR_PIECE 32
/* Rows ahead a bfloat16 weight's one-row pass prefetches in each block (below). */
#define LINEAR_ROW_AHEAD 16

/* Which kernels a linear call asks for: those this CPU takes for its rows (the widest, but
 * the AVX2 ones for one row of weights that are not codes, and a few of Q8_0, where
 * cpu_halves_avx512: rows_on_avx512), the AVX2 ones, or the AVX-512 ones (those rows too).
 * Each gives the same sums. */
enum { KERNELS_CHOSEN = 0, KERNELS_AVX2 = 1, KERNELS_AVX512 = 2 };

#include "quantized_blocks.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_BLOCKED_LINEAR 1
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

/* Whether this CPU runs the AVX512 functions. */
static int cpu_has_avx512(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}

/* Which element type the kernels instantiated for TYPE read: 1 for bfloat16. */
#define IS_BF16_f32 0
#define IS_BF16_bf16 1

/* The address of element `at` of a weight of float32 or bfloat16 (bf16) elements. */
static inline const void *weight_at(const void *weight, long at, int bf16) {
    return (const char *)weight + at * (bf16 ? (long)sizeof(uint16_t) : (long)sizeof(float));
}

/* Vectors k and k + 1 (k even: outputs 16k..16k+31) of a full block's row from its element
 * at, as float32: float32 (two loads), or bfloat16 stored in pairs (output 16k + m at 2m,
 * 16k + 16 + m at 2m + 1) widened exactly (a bfloat16's bits are a float32's upper half): one
 * load, the pairs' low halves shifted up and their high halves masked. */
AVX512 static inline void weights_2x16(const void *w, long at, const int bf16, __m512 *first,
                                       __m512 *second) {
    if (!bf16) {
        *first = _mm512_loadu_ps((const float *)w + at);
        *second = _mm512_loadu_ps((const float *)w + at + 16);
        return;
    }
    __m512i pairs = _mm512_loadu_si512((const uint16_t *)w + at);
    *first = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    *second = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* 16 weights of the last (narrower) block's row from its element at, stored in order, as
 * float32 (bfloat16 widened exactly); only the lanes in mask (the others 0; memory past them
 * is never touched). */
AVX512 static inline __m512 masked_weights_16(const void *w, long at, __mmask16 mask,
                                              const int bf16) {
    if (!bf16) return _mm512_maskz_loadu_ps(mask, (const float *)w + at);
    __m256i half = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)w + at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* R rows against one block: full (64 outputs, rows of 64) or the last (width < 64 outputs,
 * rows of width: masked loads and stores, which never touch memory past the mask); weights
 * of TYPE (f32, bf16). */
#define DEFINE_LINEAR_TILE(R, TYPE)                                                          \
    AVX512 static void linear_tile_##R##_##TYPE(const void *block, long in, const float *x, \
                                                float *y, long y_stride, long width,        \
                                                const float *bias) {                         \
        const int bf16 = IS_BF16_##TYPE;                                                     \
        __m512 acc[R][4];                                                                    \
        __mmask16 m0 = tail_mask(width, 0), m1 = tail_mask(width, 1);                       \
        __mmask16 m2 = tail_mask(width, 2), m3 = tail_mask(width, 3);                       \
        for (int r = 0; r < R; r++)                                                          \
            for (int k = 0; k < 4; k++) acc[r][k] = _mm512_setzero_ps();                     \
        if (width == LINEAR_BLOCK) {                                                         \
            for (long i = 0; i < in; i++) {                                                  \
                long row = i * LINEAR_BLOCK;                                                 \
                __m512 w0, w1, w2, w3;                                                       \
                weights_2x16(block, row, bf16, &w0, &w1);                                    \
                weights_2x16(block, row + 32, bf16, &w2, &w3);                               \
                LINEAR_TILE_STEP(R)                                                          \
            }                                                                                \
        } else {                                                                             \
            for (long i = 0; i < in; i++) {                                                  \
                long row = i * width;                                                        \
                __m512 w0 = masked_weights_16(block, row, m0, bf16);                         \
                __m512 w1 = masked_weights_16(block, row + 16, m1, bf16);                    \
                __m512 w2 = masked_weights_16(block, row + 32, m2, bf16);                    \
                __m512 w3 = masked_weights_16(block, row + 48, m3, bf16);                    \
                LINEAR_TILE_STEP(R)                                                          \
            }                                                                                \
        }                                                                                    \
        __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;                          \
        if (bias) {                                                                          \
            b0 = _mm512_maskz_loadu_ps(m0, bias), b1 = _mm512_maskz_loadu_ps(m1, bias + 16); \
            b2 = _mm512_maskz_loadu_ps(m2, bias + 32);                                       \
            b3 = _mm512_maskz_loadu_ps(m3, bias + 48);                                       \
        }                                                                                    \
        for (int r = 0; r < R; r++) {                                                        \
            float *out = y + r * y_stride;                                                   \
            _mm512_mask_storeu_ps(out, m0, _mm512_add_ps(acc[r][0], b0));                    \
            _mm512_mask_storeu_ps(out + 16, m1, _mm512_add_ps(acc[r][1], b1));               \
            _mm512_mask_storeu_ps(out + 32, m2, _mm512_add_ps(acc[r][2], b2));               \
            _mm512_mask_storeu_ps(out + 48, m3, _mm512_add_ps(acc[r][3], b3));               \
        }                                                                                    \
    }

/* Every row of the tile times the block's row i (w0..w3), into its four sums. */
#define LINEAR_TILE_STEP(R)                                                                  \
    for (int r = 0; r < R; r++) {                                                            \
        __m512 value = _mm512_set1_ps(x[r * in + i]);                                        \
        acc[r][0] = _mm512_fmadd_ps(w0, value, acc[r][0]);                                   \
        acc[r][1] = _mm512_fmadd_ps(w1, value, acc[r][1]);                                   \
        acc[r][2] = _mm512_fmadd_ps(w2, value, acc[r][2]);                                   \
        acc[r][3] = _mm512_fmadd_ps(w3, value, acc[r][3]);                                   \
    }

/* The lanes of vector k (outputs 16k..16k+15) that are among the block's width outputs. */
static inline __mmask16 tail_mask(long width, int k) {
    long left = width - 16 * k;
    return left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
}

/* One row against the B full blocks at block (outputs 0..64B-1 of y and bias): the same
 * sums, in the same order, as linear_tile_1 on each block. B = 4 streams through memory at
 * once read faster than 2 (decode, alternating builds in one run: TP=2 float32 52.2-52.3 ->
 * 54.8-54.9 tok/s, bfloat16 weights 98.9-99.4 -> 105.8-109.6, TP=1 float32 53.2-53.8 ->
 * 55.1-57.5; 6 or 8 blocks no faster than 4). A bfloat16 weight's rows are prefetched
 * LINEAR_ROW_AHEAD rows ahead in each block: its widening puts more instructions between
 * loads, so fewer reads are in flight without (a TP=2 rank's weights in one bfloat16 buffer,
 * one thread, two blocks, alternating in one run: 9.7 GB/s without, 12.1 / 12.6 / 12.0 with 8
 * / 16 / 32 rows ahead; float32's loads keep enough in flight alone). */
#define DEFINE_LINEAR_ROW_BLOCKS(B, TYPE)                                                    \
    AVX512 static void linear_row_##B##_blocks_##TYPE(const void *block, long in,            \
                                                      const float *x, float *y,              \
                                                      const float *bias) {                   \
        const int bf16 = IS_BF16_##TYPE;                                                     \
        __m512 acc[B][4];                                                                    \
        for (int b = 0; b < B; b++)                                                          \
            for (int k = 0; k < 4; k++) acc[b][k] = _mm512_setzero_ps();                     \
        for (long i = 0; i < in; i++) {                                                      \
            __m512 value = _mm512_set1_ps(x[i]);                                             \
            if (bf16) /* prefetches never fault: past the blocks' end is harmless */        \
                for (int b = 0; b < B; b++)                                                  \
                    prefetch_block_row(block, (b * in + i + LINEAR_ROW_AHEAD) * LINEAR_BLOCK,\
                                       bf16);                                                \
            for (int b = 0; b < B; b++)                                                      \
                for (int k = 0; k < 4; k += 2) {                                             \
                    __m512 w[2];                                                             \
                    weights_2x16(block, (b * in + i) * LINEAR_BLOCK + 16 * k, bf16, &w[0],   \
                                 &w[1]);                                                     \
                    for (int j = 0; j < 2; j++)                                              \
                        acc[b][k + j] = _mm512_fmadd_ps(w[j], value, acc[b][k + j]);         \
                }                                                                            \
        }                                                                                    \
        for (int b = 0; b < B; b++)                                                          \
            for (int k = 0; k < 4; k++) {                                                    \
                long at = b * LINEAR_BLOCK + 16 * k;                                         \
                __m512 sum = bias ? _mm512_add_ps(acc[b][k], _mm512_loadu_ps(bias + at))     \
                                  : acc[b][k];                                               \
                _mm512_storeu_ps(y + at, sum);                                               \
            }                                                                                \
    }

/* R rows against rows [first, first + steps) of the two full blocks from block (the second
 * in * 64 elements after the first): linear_tile_R's sums for each. sums (R x 128: a row's 64
 * of the first block, then the second's) holds them between pieces: they start at 0 where
 * first is 0, else from there; at the blocks' end (last) they go to y's rows (y_stride apart;
 * 128 outputs, plus the bias when there is one), else back to sums. On the way, fetch rows
 * from ahead in both blocks are prefetched, spread over the steps. */
#define DEFINE_LINEAR_PAIR_TILE(R, TYPE)                                                     \
    AVX512 static void linear_pair_tile_##R##_##TYPE(                                        \
        const void *block, long in, long first, long steps, int last, const float *x,       \
        float *sums, float *y, long y_stride, const float *bias, const void *ahead,         \
        long fetch) {                                                                        \
        const int bf16 = IS_BF16_##TYPE;                                                     \
        __m512 acc[R][8];                                                                    \
        for (int r = 0; r < R; r++)                                                          \
            for (int k = 0; k < 8; k++)                                                      \
                acc[r][k] = first ? _mm512_loadu_ps(sums + r * 2 * LINEAR_BLOCK + 16 * k)   \
                                  : _mm512_setzero_ps();                                     \
        long one = first * LINEAR_BLOCK, two = one + in * LINEAR_BLOCK;                      \
        long spacing = fetch > 0 && steps > fetch ? steps / fetch : 1, fetched = 0;          \
        for (long i = 0; i < steps; i++) {                                                   \
            if (fetched < fetch && i % spacing == 0) {                                       \
                prefetch_block_row(ahead, fetched * LINEAR_BLOCK, bf16);                     \
                prefetch_block_row(ahead, (fetched + in) * LINEAR_BLOCK, bf16);              \
                fetched++;                                                                   \
            }                                                                                \
            __m512 value[R];                                                                 \
            for (int r = 0; r < R; r++) value[r] = _mm512_set1_ps(x[r * in + first + i]);   \
            for (int k = 0; k < 8; k += 2) {                                                 \
                long row = (k < 4 ? one : two) + i * LINEAR_BLOCK;                           \
                __m512 w[2];                                                                 \
                weights_2x16(block, row + 16 * (k & 3), bf16, &w[0], &w[1]);                 \
                for (int j = 0; j < 2; j++) {                                                \
                    if (R > 1) __asm__("" : "+v"(w[j])); /* one load for every row, not R */\
                    for (int r = 0; r < R; r++)                                              \
                        acc[r][k + j] = _mm512_fmadd_ps(w[j], value[r], acc[r][k + j]);      \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < R; r++)                                                          \
            for (int k = 0; k < 8; k++) {                                                    \
                if (!last) {                                                                 \
                    _mm512_storeu_ps(sums + r * 2 * LINEAR_BLOCK + 16 * k, acc[r][k]);      \
                    continue;                                                                \
                }                                                                            \
                __m512 b = bias ? _mm512_loadu_ps(bias + 16 * k) : _mm512_setzero_ps();      \
                _mm512_storeu_ps(y + r * y_stride + 16 * k, _mm512_add_ps(acc[r][k], b));    \
            }                                                                                \
    }

/* The cache lines of one block row (64 elements from element at of block) into the L1
 * cache. */
static inline void prefetch_block_row(const void *block, long at, int bf16) {
    const char *row = weight_at(block, at, bf16);
    for (int line = 0; line < (bf16 ? 2 : 4); line++)
        _mm_prefetch(row + 64 * line, _MM_HINT_T0);
}

#define DEFINE_LINEAR_KERNELS(TYPE)                                                          \
    DEFINE_LINEAR_TILE(1, TYPE)                                                              \
    DEFINE_LINEAR_TILE(2, TYPE)                                                              \
    DEFINE_LINEAR_TILE(3, TYPE)                                                              \
    DEFINE_LINEAR_TILE(4, TYPE)                                                              \
    DEFINE_LINEAR_TILE(5, TYPE)                                                              \
    DEFINE_LINEAR_TILE(6, TYPE)                                                              \
    DEFINE_LINEAR_ROW_BLOCKS(2, TYPE)                                                        \
    DEFINE_LINEAR_ROW_BLOCKS(4, TYPE)                                                        \
    DEFINE_LINEAR_PAIR_TILE(1, TYPE)                                                         \
    DEFINE_LINEAR_PAIR_TILE(2, TYPE)                                                         \
    DEFINE_LINEAR_PAIR_TILE(3, TYPE)
DEFINE_LINEAR_KERNELS(f32)
DEFINE_LINEAR_KERNELS(bf16)

/* The kernel called name, of weights of bfloat16 (bf16) or float32, on args. */
#define OF_TYPE(name, args) (bf16 ? name##_bf16 args : name##_f32 args)

/* 2 to LINEAR_PAIR_MAX_ROWS rows against the two full blocks from block (outputs 0..127 of y
 * and bias), a piece at a time, in tiles of up to 3 rows; the tiles share out the prefetch of
 * the next piece. */
static void linear_rows_two_blocks(const void *block, int bf16, long in, const float *x,
                                   float *y, long y_stride, long rows, const float *bias) {
    float sums[LINEAR_PAIR_MAX_ROWS * 2 * LINEAR_BLOCK];
    long tiles = (rows + LINEAR_PAIR_TILE_ROWS - 1) / LINEAR_PAIR_TILE_ROWS;
    for (long at = 0; at == 0 || at < in; at += LINEAR_PIECE) { /* in = 0: y = bias */
        long steps = in - at < LINEAR_PIECE ? in - at : LINEAR_PIECE, next = at + steps;
        long fetch = in - next < LINEAR_PIECE ? in - next : LINEAR_PIECE;
        int last = next == in;
        for (long tile = 0; tile < tiles; tile++) {
            long r = tile * LINEAR_PAIR_TILE_ROWS;
            long count = rows - r < LINEAR_PAIR_TILE_ROWS ? rows - r : LINEAR_PAIR_TILE_ROWS;
            long from = tile * fetch / tiles, to = (tile + 1) * fetch / tiles;
            const float *xr = x + r * in;
            const void *ahead = weight_at(block, (next + from) * LINEAR_BLOCK, bf16);
            float *sr = sums + r * 2 * LINEAR_BLOCK, *yr = y + r * y_stride;
#define PAIR_TILE(R)                                                                         \
    OF_TYPE(linear_pair_tile_##R,                                                            \
            (block, in, at, steps, last, xr, sr, yr, y_stride, bias, ahead, to - from))
            switch (count) {
            case 3: PAIR_TILE(3); break;
            case 2: PAIR_TILE(2); break;
            default: PAIR_TILE(1); break;
            }
#undef PAIR_TILE
        }
    }
}

/* y's outputs in blocks [first, end) of the weight (float32, or bfloat16: bf16; the last
 * block may be narrower): one row through four full blocks at a time, up to
 * LINEAR_PAIR_MAX_ROWS rows (and the full blocks one row leaves) through two, else (and a
 * block left over) tiles of up to 6 rows against one block. */
static void linear_blocks(const void *weight, int bf16, const float *x, float *y,
                          const float *bias, long rows, long out, long in, long first,
                          long end) {
    long full = out / LINEAR_BLOCK;
    if (rows == 1) {
#define ROW_BLOCKS(B)                                                                        \
    for (; first + B <= end && first + B <= full; first += B)                                \
        OF_TYPE(linear_row_##B##_blocks,                                                     \
                (weight_at(weight, first * in * LINEAR_BLOCK, bf16), in, x,                  \
                 y + first * LINEAR_BLOCK, bias ? bias + first * LINEAR_BLOCK : NULL));
        ROW_BLOCKS(4)
        ROW_BLOCKS(2)
#undef ROW_BLOCKS
    }
    if (rows <= LINEAR_PAIR_MAX_ROWS)
        for (; first + 2 <= end && first + 2 <= full; first += 2)
            linear_rows_two_blocks(weight_at(weight, first * in * LINEAR_BLOCK, bf16), bf16, in,
                                   x, y + first * LINEAR_BLOCK, out, rows,
                                   bias ? bias + first * LINEAR_BLOCK : NULL);
    for (long k = first; k < end; k++) {
        /* the last may be narrower */
        const void *block = weight_at(weight, k * in * LINEAR_BLOCK, bf16);
        long width = out - k * LINEAR_BLOCK < LINEAR_BLOCK ? out - k * LINEAR_BLOCK : LINEAR_BLOCK;
        const float *block_bias = bias ? bias + k * LINEAR_BLOCK : NULL;
        for (long r = 0; r < rows; r += LINEAR_TILE_ROWS) {
            long tile = rows - r < LINEAR_TILE_ROWS ? rows - r : LINEAR_TILE_ROWS;
            const float *xr = x + r * in;
            float *yr = y + r * out + k * LINEAR_BLOCK;
#define TILE(R) OF_TYPE(linear_tile_##R, (block, in, xr, yr, out, width, block_bias))
            switch (tile) {
            case 6: TILE(6); break;
            case 5: TILE(5); break;
            case 4: TILE(4); break;
            case 3: TILE(3); break;
            case 2: TILE(2); break;
            default: TILE(1); break;
            }
#undef TILE
        }
    }
}
#undef OF_TYPE

#include "quantized_linear.h"

/* The same blocked layouts on a CPU without AVX-512 but with AVX2 and FMA (8 lanes, 16
 * vector registers), each output's sum in the same order as the AVX-512 kernels (so the same
 * bits): one row streams four full blocks at once (row_blocks_avx2); more rows go through a
 * block's parts a few rows at a time, a piece of inputs at a time (AVX2_QUARTERS_FROM,
 * AVX2_PIECE); a narrower last block loads its lanes masked, a row at a time. */
#define AVX2_FMA __attribute__((target("avx2,fma")))

static int cpu_has_avx2_fma(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* The four vectors of outputs 32 half .. 32 half + 31 of a full block's row from its element
 * at, in output order, as float32 (bfloat16 pairs widened exactly: see weights_2x16). */
AVX2_FMA static inline __attribute__((always_inline)) void half_row_8x4(const void *w, long at,
                                                                        int half, const int bf16,
                                                                        __m256 v[4]) {
    if (!bf16) {
        const float *row = (const float *)w + at + 32 * half;
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(row + 8 * j);
        return;
    }
    const uint16_t *row = (const uint16_t *)w + at + 32 * half;
    __m256i low = _mm256_loadu_si256((const __m256i *)row);         /* outputs 0..7, 16..23 */
    __m256i high = _mm256_loadu_si256((const __m256i *)(row + 16)); /* 8..15, 24..31 */
    __m256i upper = _mm256_set1_epi32((int)0xFFFF0000u);
    v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(low, 16));
    v[1] = _mm256_castsi256_ps(_mm256_slli_epi32(high, 16));
    v[2] = _mm256_castsi256_ps(_mm256_and_si256(low, upper));
    v[3] = _mm256_castsi256_ps(_mm256_and_si256(high, upper));
}

/* The lanes below `lanes` (of 8) as a maskload/maskstore mask. */
AVX2_FMA static inline __m256i lanes_below(long lanes) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)lanes),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* 8 weights (lanes 1..8 of them) of a narrower last block's row, stored in order, from its
 * element at, as float32; memory past them is never touched. */
AVX2_FMA static inline __attribute__((always_inline)) __m256 tail_weights_8(const void *w,
                                                                            long at, long lanes,
                                                                            const int bf16) {
    if (!bf16) {
        const float *row = (const float *)w + at;
        return lanes >= 8 ? _mm256_loadu_ps(row) : _mm256_maskload_ps(row, lanes_below(lanes));
    }
    const uint16_t *row = (const uint16_t *)w + at;
    __m128i half;
    if (lanes >= 8) {
        half = _mm_loadu_si128((const __m128i *)row);
    } else {
        uint16_t part[8] = {0};
        memcpy(part, row, sizeof(uint16_t) * (size_t)lanes);
        half = _mm_loadu_si128((const __m128i *)part);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* More than one row goes through a full block's parts a tile of rows at a time, each weight
 * vector loaded once for all of a tile's rows: from AVX2_QUARTERS_FROM float32 rows on,
 * quarters (16 outputs) against up to 6 rows (12 sums, 2 weight vectors and a broadcast: 15 of
 * the 16 vector registers); fewer float32 rows, halves (32 outputs) against up to 3 rows, and
 * bfloat16 ones (whose widening needs registers too) against up to 2. */
#define AVX2_QUARTERS_FROM 12
#define AVX2_QUARTER_ROWS 6
/* A tile's sums, 6 rows of 2 vectors or 3 of 4: sized exactly (larger, GCC keeps them in
 * memory, 1.6x slower). */
#define AVX2_TILE_SUMS 12

/* Inputs of a piece: up to LINEAR_PAIR_MAX_ROWS rows take a block a piece at a time, which
 * the tiles after the first of a part read from the L1 cache, while the first prefetches a
 * later piece (bfloat16: the next, into L1; float32: the second, into L1, up to
 * AVX2_NEAR_PREFETCH_ROWS rows, else the fourth, into L2), so the weight streams in while it
 * is computed on. Against halves without prefetching (one thread, one run): bfloat16 2-16
 * rows 1.07-1.35x, float32 12-16 rows 1.05-1.11x (200 rows, one pass: 1.2x). Fewer float32
 * rows take a block half by half, each through every piece (AVX2_HALF_PIECE), without
 * prefetching: piece by piece, with or without, was 1.2-1.6x slower there (and prefetching
 * the halves' lines into L1 two pieces ahead 1.0-1.1x slower at 2-8 rows). */
#define AVX2_PIECE 32
#define AVX2_HALF_PIECE 64
/* Float32 rows up to this many prefetch into L1 (a TP=2 rank's step of SmolLM2's weights at
 * 12-16 rows on an AMD EPYC with AVX2: 1.08-1.12x against into L2 four pieces ahead, builds
 * alternating in one process; into L1 four ahead was no faster; at 32 and 64 rows L1 was
 * 0.96-0.98x, so those keep L2). */
#define AVX2_NEAR_PREFETCH_ROWS 16

/* The sums of R rows of x (in apart) over inputs [first, first + steps) of the part of a full
 * block whose outputs start at `at` (VECTORS of 8 outputs: 2, of float32 weights, or 4). sums
 * (rows of LINEAR_BLOCK) holds the sums between pieces: they start at 0 where first is 0,
 * else from there; at the last piece they go to y's rows (out apart), plus the bias where
 * given, else back to sums. With ahead, each step also prefetches the cache line a row
 * further from there, into L1 where near, else into L2. */
AVX2_FMA static inline __attribute__((always_inline)) void part_tile_avx2(
    const void *block, const int bf16, long in, long at, long first, long steps, int last,
    const float *x, float *sums, float *y, long out, const float *bias, const char *ahead,
    const int near, const int VECTORS, const int R) {
    const long row_bytes = LINEAR_BLOCK * (bf16 ? (long)sizeof(uint16_t) : (long)sizeof(float));
    __m256 acc[AVX2_TILE_SUMS]; /* row r's vector j at VECTORS r + j */
    for (int r = 0; r < R; r++)
        for (int j = 0; j < VECTORS; j++)
            acc[VECTORS * r + j] =
                first ? _mm256_loadu_ps(sums + LINEAR_BLOCK * r + at + 8 * j) : _mm256_setzero_ps();
    for (long i = first; i < first + steps; i++) {
        const char *line = ahead ? ahead + (i - first) * row_bytes : NULL;
        if (line && near)
            _mm_prefetch(line, _MM_HINT_T0);
        else if (line)
            _mm_prefetch(line, _MM_HINT_T1);
        __m256 w[4];
        if (VECTORS == 4) { /* every row's value, then each weight vector against them */
            __m256 value[AVX2_TILE_SUMS / 4];
            half_row_8x4(block, i * LINEAR_BLOCK, (int)(at / 32), bf16, w);
            for (int r = 0; r < R; r++) value[r] = _mm256_broadcast_ss(x + r * in + i);
            for (int j = 0; j < 4; j++)
                for (int r = 0; r < R; r++)
                    acc[4 * r + j] = _mm256_fmadd_ps(w[j], value[r], acc[4 * r + j]);
        } else { /* a row's value against both weight vectors, row by row */
            const float *row = (const float *)block + i * LINEAR_BLOCK + at;
            w[0] = _mm256_loadu_ps(row);
            w[1] = _mm256_loadu_ps(row + 8);
            for (int r = 0; r < R; r++) {
                __m256 value = _mm256_broadcast_ss(x + r * in + i);
                acc[2 * r] = _mm256_fmadd_ps(w[0], value, acc[2 * r]);
                acc[2 * r + 1] = _mm256_fmadd_ps(w[1], value, acc[2 * r + 1]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < VECTORS; j++) {
            __m256 sum = acc[VECTORS * r + j];
            long o = at + 8 * j;
            if (!last)
                _mm256_storeu_ps(sums + LINEAR_BLOCK * r + o, sum);
            else
                _mm256_storeu_ps(y + r * out + o,
                                 bias ? _mm256_add_ps(sum, _mm256_loadu_ps(bias + o)) : sum);
        }
}

/* Every row of x against outputs [from, to) of a full block, in parts of width outputs (16:
 * float32 quarters; 32: halves) over inputs [first, first + steps) (see part_tile_avx2); with
 * ahead (a later piece's first row), the first tile of each part prefetches that part's lines
 * of that piece (into L1 where near). */
AVX2_FMA static inline __attribute__((always_inline)) void parts_avx2(
    const void *block, const int bf16, long in, long from, long to, long width, long first,
    long steps, int last, long rows, const float *x, float *sums, float *y, long out,
    const float *bias, const char *ahead, const int near) {
    const long tile = width == 16 ? AVX2_QUARTER_ROWS : bf16 ? 2 : 3;
    for (long at = from; at < to; at += width)
        for (long r = 0; r < rows; r += tile) {
            long left = rows - r < tile ? rows - r : tile;
            const float *xr = x + r * in;
            float *sr = sums + LINEAR_BLOCK * (r < LINEAR_PAIR_MAX_ROWS ? r : 0), *yr = y + r * out;
            const char *part_ahead = ahead && r == 0 ? ahead + at * (bf16 ? 2 : 4) : NULL;
#define PART_TILE(VECTORS, R)                                                                \
    part_tile_avx2(block, bf16, in, at, first, steps, last, xr, sr, yr, out, bias, part_ahead, \
                   near, VECTORS, R)
            if (width == 16)
                switch (left) {
                case 6: PART_TILE(2, 6); break;
                case 5: PART_TILE(2, 5); break;
                case 4: PART_TILE(2, 4); break;
                case 3: PART_TILE(2, 3); break;
                case 2: PART_TILE(2, 2); break;
                default: PART_TILE(2, 1); break;
                }
            else if (left >= 3 && !bf16)
                PART_TILE(4, 3);
            else if (left >= 2)
                PART_TILE(4, 2);
            else
                PART_TILE(4, 1);
#undef PART_TILE
        }
}

/* One row against the B full blocks at block (outputs 0..64B-1 of y and bias), each
 * output's sum in linear_row_B_blocks' order. Four blocks' 32 sums are twice the 16 registers
 * (GCC keeps the rest in the L1 cache), yet four streams through memory read faster than one
 * block's (a TP=2 rank's 121 weights in one buffer, one thread, on an AVX-512 CPU, builds
 * alternating: float32 22.0-23.5 -> 16.8-17.3 ms, bfloat16 11.0-13.0 -> 8.1-9.2; two blocks
 * no faster than four, four taken a piece of 16 inputs at a time with their sums in
 * registers slower than either). */
AVX2_FMA static inline __attribute__((always_inline)) void row_blocks_avx2(
    const void *block, const int bf16, long in, const float *x, float *y, const float *bias,
    const int B) {
    __m256 acc[4 * 8];
    for (int j = 0; j < 8 * B; j++) acc[j] = _mm256_setzero_ps();
    for (long i = 0; i < in; i++) {
        __m256 value = _mm256_set1_ps(x[i]), w[4];
        for (int b = 0; b < B; b++)
            for (int half = 0; half < 2; half++) {
                half_row_8x4(block, (b * in + i) * LINEAR_BLOCK, half, bf16, w);
                for (int j = 0; j < 4; j++)
                    acc[8 * b + 4 * half + j] =
                        _mm256_fmadd_ps(w[j], value, acc[8 * b + 4 * half + j]);
            }
    }
    for (int j = 0; j < 8 * B; j++) {
        __m256 sum = bias ? _mm256_add_ps(acc[j], _mm256_loadu_ps(bias + 8 * j)) : acc[j];
        _mm256_storeu_ps(y + 8 * j, sum);
    }
}

/* y's outputs in blocks [first, end) of the weight (see linear_blocks), on AVX2 and FMA. */
AVX2_FMA static inline __attribute__((always_inline)) void linear_blocks_avx2_of(
    const void *weight, const int bf16, const float *x, float *y, const float *bias, long rows,
    long out, long in, long first, long end) {
    float sums[LINEAR_PAIR_MAX_ROWS * LINEAR_BLOCK];
    for (long k = first; k < end; k++) {
        const void *block = weight_at(weight, k * in * LINEAR_BLOCK, bf16);
        long width = out - k * LINEAR_BLOCK < LINEAR_BLOCK ? out - k * LINEAR_BLOCK : LINEAR_BLOCK;
        const float *block_bias = bias ? bias + k * LINEAR_BLOCK : NULL;
        float *yk = y + k * LINEAR_BLOCK;
        if (width < LINEAR_BLOCK) {
            long vectors = (width + 7) / 8;
            for (long r = 0; r < rows; r++) {
                __m256 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
                for (long i = 0; i < in; i++) {
                    __m256 value = _mm256_set1_ps(x[r * in + i]);
                    for (int j = 0; j < 8; j++)
                        if (j < vectors)
                            acc[j] = _mm256_fmadd_ps(
                                tail_weights_8(block, i * width + 8 * j, width - 8 * j, bf16),
                                value, acc[j]);
                }
                for (int j = 0; j < 8 && j < vectors; j++) {
                    __m256i mask = lanes_below(width - 8 * j);
                    __m256 sum = acc[j];
                    if (block_bias)
                        sum = _mm256_add_ps(sum, _mm256_maskload_ps(block_bias + 8 * j, mask));
                    _mm256_maskstore_ps(yk + r * out + 8 * j, mask, sum);
                }
            }
            continue;
        }
        if (rows == 1) {
            long blocks = end - k >= 4 && k + 4 <= out / LINEAR_BLOCK ? 4 : 1;
            if (blocks == 4)
                row_blocks_avx2(block, bf16, in, x, yk, block_bias, 4);
            else
                row_blocks_avx2(block, bf16, in, x, yk, block_bias, 1);
            k += blocks - 1;
            continue;
        }
        long row_bytes = LINEAR_BLOCK * (bf16 ? (long)sizeof(uint16_t) : (long)sizeof(float));
        if (!bf16 && rows < AVX2_QUARTERS_FROM) { /* half by half (see AVX2_PIECE) */
            for (long at = 0; at < LINEAR_BLOCK; at += 32)
                for (long from = 0; from == 0 || from < in; from += AVX2_HALF_PIECE) {
                    long steps = in - from < AVX2_HALF_PIECE ? in - from : AVX2_HALF_PIECE;
                    parts_avx2(block, 0, in, at, at + 32, 32, from, steps, from + steps >= in,
                               rows, x, sums, yk, out, block_bias, NULL, 0);
                }
            continue;
        }
        /* More rows than the sums hold (a prefill, compute-bound): one pass each tile. */
        long piece = rows <= LINEAR_PAIR_MAX_ROWS ? AVX2_PIECE : (in > 0 ? in : 1);
        const int near = bf16 || rows <= AVX2_NEAR_PREFETCH_ROWS;
        long part = bf16 ? 32 : 16, pieces_ahead = bf16 ? 1 : near ? 2 : 4;
        for (long from = 0; from == 0 || from < in; from += piece) { /* in = 0: y = bias */
            long steps = in - from < piece ? in - from : piece;
            /* Later pieces follow this one in memory, also into the next block. */
            long ahead_row = from + (pieces_ahead - 1) * piece + steps;
            const char *ahead =
                rows <= LINEAR_PAIR_MAX_ROWS ? (const char *)block + ahead_row * row_bytes : NULL;
            parts_avx2(block, bf16, in, 0, LINEAR_BLOCK, part, from, steps, from + steps >= in,
                       rows, x, sums, yk, out, block_bias, ahead, near);
        }
    }
}

AVX2_FMA static void linear_blocks_avx2(const void *weight, int bf16, const float *x, float *y,
                                        const float *bias, long rows, long out, long in,
                                        long first, long end) {
    if (bf16)
        linear_blocks_avx2_of(weight, 1, x, y, bias, rows, out, in, first, end);
    else
        linear_blocks_avx2_of(weight, 0, x, y, bias, rows, out, in, first, end);
}

#include "quantized_linear_avx2.h"

/* Whether this CPU runs the blocked linear kernel: AVX-512, else AVX2 with FMA. */
static int cpu_runs_blocked_linear(void) { return cpu_has_avx512() || cpu_has_avx2_fma(); }

/* Whether this CPU runs AVX-512 in two 256-bit halves: AMD's family 19h with AVX-512 (Zen 4;
 * Zen 3, the same family, has none), and AVX2, FMA and F16C. There one row streams a weight
 * faster through the AVX2 kernels than through the AVX-512 ones: a TP=2 rank's 121 float32
 * weights in one buffer, one thread, the two alternating in one run, 24.1 -> 26.0 GB/s,
 * bfloat16 21.4 -> 24.0 (benchmarks/linear_kernels.py's AVX2 rows show it); a file's blocks
 * 1.12-1.2x (Q4_0, Q4_1, Q4_K), 1.18x (Q5_K), 1.28-1.65x (Q8_0), 1.31-2.0x (Q6_K), 1.36-1.76x
 * (INT8_SCALED), three runs of benchmarks/block_kernels.py. Codes (VNNI against AVX2) come out
 * about even (0.94-1.09x): they keep the AVX-512 kernels; from 2 rows every kind's AVX-512
 * kernels are faster (float32 2 rows 21.6 GB/s against 16.5, 16 rows 8.0 against 5.2). */
static int cpu_halves_avx512(void) {
    return cpu_has_avx512() && cpu_has_avx2_f16c() && __builtin_cpu_is("amdfam19h");
}

/* Up to how many rows a Q8_0 weight takes the AVX2 kernels where cpu_halves_avx512: there
 * its AVX-512 kernel lags beyond one row too (3072 x 512, one thread, calls alternating: AVX2
 * 1.45-1.58x as fast at 2-4 rows, 1.10-1.12x at 6-8, 0.96x at 12; Q4_0 and Q6_K about even
 * or slower on AVX2 from 2 rows). */
#define Q8_0_AVX2_ROWS_WHERE_HALVED 8

/* Whether rows of a weight of kind (not codes) go through the AVX-512 kernels, where avx512
 * (the kernels a call may take) allows and the CPU takes them for the rows (see
 * cpu_halves_avx512); halves: that CPU, and the call left the choice to it. */
static int rows_on_avx512(int avx512, int halves, int kind, long rows) {
    if (!avx512 || !halves) return avx512;
    return !(rows == 1 || (kind == WEIGHT_Q8_0 && rows <= Q8_0_AVX2_ROWS_WHERE_HALVED));
}

typedef struct {
    const void *weight;
    const float *x, *bias;
    float *y;
    int kind, avx512; /* kind: WEIGHT_*; avx512: the AVX-512 kernels, else the AVX2 ones */
    int halves; /* cpu_halves_avx512, and the kernels left to it: see rows_on_avx512 */
    long rows, out, in, blocks_per_chunk;
    const QuantizedRows *xq; /* x quantized, where the weight has code-kind blocks */
} LinearJob;

/* Whether a weight held as kind has blocks of the code kind (itself, or a segment). */
static int has_codes(const void *weight, int kind) {
    if (is_code_kind(kind)) return 1;
    if (kind != WEIGHT_SEGMENTED) return 0;
    const SegmentTable *table = weight;
    for (int i = 0; i < table->count; i++)
        if (is_code_kind(table->segment[i].kind)) return 1;
    return 0;
}

/* A job's outputs in blocks [first, end) of weight, held as kind, which is a kind of
 * quantization blocks, from block base on. */
static void quantized_chunk(const LinearJob *job, int kind, const void *weight, long base,
                            long first, long end) {
    if (is_code_kind(kind)) { /* VNNI where the AVX-512 kernels run and it has it */
        int vnni = job->avx512 && cpu_has_avx512_vnni();
        void (*run)(const uint8_t *, long, const QuantizedRows *, float *, const float *, long,
                    long, long, long, long) =
            kind == WEIGHT_Q8_CODES_F16 ? (vnni ? code_bytes_blocks : code_bytes_blocks_avx2)
            : kind == WEIGHT_Q4_CODES_F16 ? (vnni ? code_blocks_f16 : code_blocks_f16_avx2)
                                          : (vnni ? code_blocks : code_blocks_avx2);
        run(weight, base, job->xq, job->y, job->bias, job->rows, job->out, job->in, first, end);
        return;
    }
    /* the AVX2 ones need F16C too: callers check */
    (rows_on_avx512(job->avx512, job->halves, kind, job->rows) ? quantized_blocks
                                                               : quantized_blocks_avx2)(
        kind, weight, base, job->x, job->y, job->bias, job->rows, job->out, job->in, first, end);
}

/* A job's outputs in blocks [first, end) of a WEIGHT_SEGMENTED weight: each segment's part. */
static void segmented_chunk(const LinearJob *job, long first, long end) {
    const SegmentTable *table = job->weight;
    const uint8_t *bytes = (const uint8_t *)job->weight + sizeof *table;
    long start = 0, groups = job->in / QUANT_GROUP;
    for (int i = 0; i < table->count && start < end; i++) {
        int kind = table->segment[i].kind;
        long stop = table->segment[i].end_block;
        long from = first > start ? first : start, to = end < stop ? end : stop;
        if (from < to) quantized_chunk(job, kind, bytes, start, from, to);
        bytes += (stop - start) * groups * quantized_group_bytes(kind);
        start = stop;
    }
}

static void linear_chunk(const void *context, long chunk, int worker) {
    const LinearJob *job = context;
    long blocks = (job->out + LINEAR_BLOCK - 1) / LINEAR_BLOCK;
    long first = chunk * job->blocks_per_chunk;
    long end = first + job->blocks_per_chunk < blocks ? first + job->blocks_per_chunk : blocks;
    if (job->kind == WEIGHT_SEGMENTED)
        segmented_chunk(job, first, end);
    else if (is_quantized(job->kind))
        quantized_chunk(job, job->kind, job->weight, 0, first, end);
    else
        (rows_on_avx512(job->avx512, job->halves, job->kind, job->rows) ? linear_blocks
                                                                        : linear_blocks_avx2)(
            job->weight, job->kind == WEIGHT_BFLOAT16, job->x, job->y, job->bias, job->rows,
            job->out, job->in, first, end);
}

/* A job's outputs shared out by team (NULL: this thread alone) in chunks of blocks: four for
 * one row (its pass's blocks), two up to LINEAR_PAIR_MAX_ROWS rows (a pair), one otherwise. */
static void run_linear_job(Team *team, LinearJob *job) {
    long blocks = (job->out + LINEAR_BLOCK - 1) / LINEAR_BLOCK;
    long per_chunk = job->rows == 1 ? 4 : job->rows <= LINEAR_PAIR_MAX_ROWS ? 2 : 1;
    while ((blocks + per_chunk - 1) / per_chunk > TEAM_MAX_CHUNKS) per_chunk *= 2;
    job->blocks_per_chunk = per_chunk;
    team_run(team, (blocks + per_chunk - 1) / per_chunk, linear_chunk, job);
}

/* y = x W^T + b, W blocked (held as kind says: WEIGHT_*; quantized kinds need AVX-512, or
 * AVX2 with FMA and F16C), on the kernels asked for (KERNELS_*: the AVX-512 ones only where
 * the CPU has them, the AVX2 ones where it has those: callers check), shared out by team
 * (run_linear_job). A weight with code-kind blocks (has_codes) multiplies x quantized once
 * here, into activations: space of at least quantized_rows_floats(rows, in) floats (unused
 * otherwise: may be NULL). */
static void blocked_linear_rows_on(Team *team, int kernels, const void *weight, int kind,
                                   const float *x, float *y, const float *bias, long rows,
                                   long out, long in, float *activations) {
    int avx512 = kernels == KERNELS_AVX512 || (kernels == KERNELS_CHOSEN && cpu_has_avx512());
    LinearJob job = {.weight = weight, .kind = kind, .avx512 = avx512, .x = x, .bias = bias,
                     .y = y, .rows = rows, .out = out, .in = in,
                     .halves = kernels == KERNELS_CHOSEN && avx512 && cpu_halves_avx512()};
    QuantizedRows xq;
    if (has_codes(weight, kind)) {
        xq = quantized_rows_in(activations, rows, in);
        quantize_rows(x, rows, in, &xq);
        job.xq = &xq;
    }
    run_linear_job(team, &job);
}

/* blocked_linear_rows_on the kernels this CPU takes for the rows (KERNELS_CHOSEN). */
static void blocked_linear_rows(Team *team, const void *weight, int kind, const float *x,
                                float *y, const float *bias, long rows, long out, long in,
                                float *activations) {
    blocked_linear_rows_on(team, KERNELS_CHOSEN, weight, kind, x, y, bias, rows, out, in,
                           activations);
}

/* The 16 lanes' sums of p[0..15], as lanes 0..15 of one vector: pairs of vectors interleaved
 * and added (unpacks within 128-bit lanes), then the four 128-bit lanes folded (shuffles). */
AVX512 static inline __m512 sum_each_of_16(const __m512 *p) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a, b, a, b] partials of p[2i], p[2i+1] */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                                 _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: [p4i, p4i+1, p4i+2, p4i+3] partials */
        __m512d low = _mm512_unpacklo_pd(_mm512_castps_pd(pairs[2 * i]),
                                         _mm512_castps_pd(pairs[2 * i + 1]));
        __m512d high = _mm512_unpackhi_pd(_mm512_castps_pd(pairs[2 * i]),
                                          _mm512_castps_pd(pairs[2 * i + 1]));
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(low), _mm512_castpd_ps(high));
    }
    __m512 front = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                 _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    __m512 back = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(front, back, 0x88),
                         _mm512_shuffle_f32x4(front, back, 0xDD));
}

/* 16 elements from base[at] as float32: float32, or bfloat16 (bf16) widened exactly. */
AVX512 static inline __m512 load_16(const void *base, long at, const int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)base + at);
    __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* One sequence's attention for `members` query heads (group: their numbers; queries: their
 * rows as float32) that read one KV head, d a multiple of 16, on AVX-512: the scores of 16
 * cached tokens at a time (one vector of partial products per token, summed lane by lane
 * together), each 16 tokens' keys read once for all the heads (in L1 after the first), then
 * the weighted values summed in registers, 64 of d at a time, each value read once for all the
 * heads. The heads share only the loads: each head's sums are the ones it gets alone, in the
 * same order (the portable kernel's softmax, exp_approx; its sums in another order). The cache
 * and out hold float32, or bfloat16 (bf16: keys and values widened exactly, the output rounded
 * once, as the portable kernel does). stats: see ATTEND_KV_HEAD. Inlined with
 * `members`, d and bf16 constants (attend_group_avx512), so the heads' sums stay in registers. */
AVX512 static inline __attribute__((always_inline)) void attend_heads_avx512(
    const float *const *queries, const void *keys_of_head, const void *values_of_head,
    const int64_t *table, long length, long block_size, long stride, const long d,
    const int bf16, const long *group, const long members, float scale, void *out,
    float *scores, float *stats) {
    long chunks = d / 16, blocks_used = (length + block_size - 1) / block_size;
    __m512 scale_v = _mm512_set1_ps(scale), top_v[ATTENTION_GROUP];
    for (long g = 0; g < members; g++) top_v[g] = _mm512_set1_ps(-INFINITY);
    for (long k = 0; k < blocks_used; k++) {
        long first = k * block_size;
        long count = length - first < block_size ? length - first : block_size;
        long keys = table[k] * block_size * stride;
        for (long t0 = 0; t0 < count; t0 += 16) {
            long n = count - t0 < 16 ? count - t0 : 16;
            __mmask16 lanes = (__mmask16)((1u << n) - 1);
            for (long g = 0; g < members; g++) {
                const float *query = queries[g];
                __m512 partial[16];
                for (long j = 0; j < 16; j++) {
                    __m512 sum = _mm512_setzero_ps();
                    if (j < n) {
                        long key = keys + (t0 + j) * stride;
                        for (long c = 0; c < chunks; c++)
                            sum = _mm512_fmadd_ps(load_16(keys_of_head, key + 16 * c, bf16),
                                                  _mm512_loadu_ps(query + 16 * c), sum);
                    }
                    partial[j] = sum;
                }
                __m512 score = _mm512_mul_ps(sum_each_of_16(partial), scale_v);
                _mm512_mask_storeu_ps(scores + g * length + first + t0, lanes, score);
                top_v[g] = _mm512_mask_max_ps(top_v[g], lanes, top_v[g], score);
            }
        }
    }
    __m512 inv[ATTENTION_GROUP];
    for (long g = 0; g < members; g++) {
        float *head_scores = scores + g * length, top = _mm512_reduce_max_ps(top_v[g]);
        for (long t = 0; t < length; t++) head_scores[t] = exp_approx(head_scores[t] - top);
        float total = sum_of(head_scores, length);
        inv[g] = _mm512_set1_ps(1.0f / total);
        if (stats != NULL) stats[2 * group[g]] = top, stats[2 * group[g] + 1] = total;
    }
    for (long c = 0; c < chunks; c += 4) {
        long m = chunks - c < 4 ? chunks - c : 4;
        __m512 acc[ATTENTION_GROUP][4];
        for (long g = 0; g < members; g++)
            for (long i = 0; i < 4; i++) acc[g][i] = _mm512_setzero_ps();
        for (long k = 0; k < blocks_used; k++) {
            long first = k * block_size;
            long count = length - first < block_size ? length - first : block_size;
            long values = table[k] * block_size * stride + 16 * c;
            for (long t = 0; t < count; t++) {
                long value = values + t * stride;
                __m512 v0 = load_16(values_of_head, value, bf16);
                __m512 v1 = m > 1 ? load_16(values_of_head, value + 16, bf16) : v0;
                __m512 v2 = m > 2 ? load_16(values_of_head, value + 32, bf16) : v0;
                __m512 v3 = m > 3 ? load_16(values_of_head, value + 48, bf16) : v0;
                for (long g = 0; g < members; g++) {
                    __m512 weight = _mm512_set1_ps(scores[g * length + first + t]);
                    acc[g][0] = _mm512_fmadd_ps(weight, v0, acc[g][0]);
                    if (m > 1) acc[g][1] = _mm512_fmadd_ps(weight, v1, acc[g][1]);
                    if (m > 2) acc[g][2] = _mm512_fmadd_ps(weight, v2, acc[g][2]);
                    if (m > 3) acc[g][3] = _mm512_fmadd_ps(weight, v3, acc[g][3]);
                }
            }
        }
        for (long g = 0; g < members; g++) {
            long at = group[g] * d + 16 * c;
            for (long i = 0; i < m; i++) {
                __m512 result = _mm512_mul_ps(acc[g][i], inv[g]);
                if (!bf16) {
                    _mm512_storeu_ps((float *)out + at + 16 * i, result);
                    continue;
                }
                float lane[16];
                _mm512_storeu_ps(lane, result);
                for (int e = 0; e < 16; e++)
                    ((uint16_t *)out)[at + 16 * i + e] = float_to_bf16(lane[e]);
            }
        }
    }
}

/* The next (up to ATTENTION_GROUP) query heads from *h on that read KV head kv, in order:
 * their numbers in group, their rows of q as float32 in queries (bfloat16 rows widened into
 * widened, room for ATTENTION_GROUP rows of d); advances *h past them; returns how many. */
static long next_group(const void *q, int bf16, long d, long heads, const int64_t *kv_index,
                       long kv, long *h, long *group, const float **queries, float *widened) {
    long members = 0;
    for (; *h < heads && members < ATTENTION_GROUP; ++*h)
        if (kv_index[*h] == kv) group[members++] = *h;
    for (long g = 0; g < members; g++) {
        if (!bf16) {
            queries[g] = (const float *)q + group[g] * d;
            continue;
        }
        for (long i = 0; i < d; i++)
            widened[g * d + i] = bf16_to_float(((const uint16_t *)q)[group[g] * d + i]);
        queries[g] = widened + g * d;
    }
    return members;
}

/* Where KV head kv's keys and values begin in the caches (float32, or bfloat16: bf16). */
static inline const char *kv_head_start(const void *cache, long kv, long d, int bf16) {
    return (const char *)cache + kv * d * (bf16 ? sizeof(uint16_t) : sizeof(float));
}

/* ---- decode attention on AVX2 with FMA: attend_heads_avx512's sums in its order, on vectors
 * of 8 (a vector of 16 lanes is two here, lanes 0..7 and 8..15), so the same bits. */

/* 8 elements from base[at] as float32: float32, or bfloat16 (bf16) widened exactly. */
AVX2_FMA static inline __m256 load_8(const void *base, long at, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)base + at);
    __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* Lane j: the sum of p[j]'s 8 lanes as sum_each_of_16 sums 8 lanes of a vector: each 128-bit
 * half's (x0 + x2) + (x1 + x3), then the low half's plus the high half's. */
AVX2_FMA static inline __m256 sum_each_of_8(const __m256 *p) {
    __m256 pairs[4], quads[2];
    for (int i = 0; i < 4; i++) /* per 128-bit half: [a, b, a, b] partials of p[2i], p[2i+1] */
        pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                                 _mm256_unpackhi_ps(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 2; i++) { /* per 128-bit half: the half's sums of p4i .. p4i+3 */
        __m256d low = _mm256_unpacklo_pd(_mm256_castps_pd(pairs[2 * i]),
                                          _mm256_castps_pd(pairs[2 * i + 1]));
        __m256d high = _mm256_unpackhi_pd(_mm256_castps_pd(pairs[2 * i]),
                                           _mm256_castps_pd(pairs[2 * i + 1]));
        quads[i] = _mm256_add_ps(_mm256_castpd_ps(low), _mm256_castpd_ps(high));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                         _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}

/* attend_heads_avx512 on AVX2: the scores of 8 cached tokens at a time (two vectors of
 * partial products per token, for a 16-lane vector's lanes 0..7 and 8..15, each summed as
 * sum_each_of_16 sums them: one half for the 8 tokens, then the other, so that a half's sums
 * and queries fit the 16 registers), then the weighted values 16 of d at a time. */
AVX2_FMA static inline __attribute__((always_inline)) void attend_heads_avx2(
    const float *const *queries, const void *keys_of_head, const void *values_of_head,
    const int64_t *table, long length, long block_size, long stride, const long d,
    const int bf16, const long *group, const long members, float scale, void *out,
    float *scores, float *stats) {
    long chunks = d / 16, blocks_used = (length + block_size - 1) / block_size;
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 lowest = _mm256_set1_ps(-INFINITY), scale_v = _mm256_set1_ps(scale);
    __m256 top_v[ATTENTION_GROUP];
    for (long g = 0; g < members; g++) top_v[g] = lowest;
    for (long k = 0; k < blocks_used; k++) {
        long first = k * block_size;
        long count = length - first < block_size ? length - first : block_size;
        long keys = table[k] * block_size * stride;
        for (long t0 = 0; t0 < count; t0 += 8) {
            long n = count - t0 < 8 ? count - t0 : 8;
            __m256 live = _mm256_cmp_ps(lane, _mm256_set1_ps((float)n), _CMP_LT_OQ);
            for (long g = 0; g < members; g++) {
                __m256 halves[2]; /* of the 8 tokens' sums: lanes 0..7's, lanes 8..15's */
                for (long half = 0; half < 2; half++) {
                    const float *query = queries[g] + 8 * half;
                    __m256 partial[8];
                    for (long j = 0; j < 8; j++) {
                        __m256 sum = _mm256_setzero_ps();
                        long key = keys + (t0 + j) * stride + 8 * half;
                        for (long c = 0; j < n && c < chunks; c++)
                            sum = _mm256_fmadd_ps(load_8(keys_of_head, key + 16 * c, bf16),
                                                  _mm256_loadu_ps(query + 16 * c), sum);
                        partial[j] = sum;
                    }
                    halves[half] = sum_each_of_8(partial);
                }
                __m256 score = _mm256_mul_ps(_mm256_add_ps(halves[0], halves[1]), scale_v);
                float *at = scores + g * length + first + t0;
                if (n == 8) {
                    _mm256_storeu_ps(at, score);
                } else {
                    float lanes[8];
                    _mm256_storeu_ps(lanes, score);
                    memcpy(at, lanes, (size_t)n * sizeof(float));
                }
                top_v[g] = _mm256_max_ps(top_v[g], _mm256_blendv_ps(lowest, score, live));
            }
        }
    }
    __m256 inv[ATTENTION_GROUP];
    for (long g = 0; g < members; g++) {
        float widest[8], top = -INFINITY, *head_scores = scores + g * length;
        _mm256_storeu_ps(widest, top_v[g]);
        for (int j = 0; j < 8; j++) top = widest[j] > top ? widest[j] : top;
        for (long t = 0; t < length; t++) head_scores[t] = exp_approx(head_scores[t] - top);
        float total = sum_of(head_scores, length);
        inv[g] = _mm256_set1_ps(1.0f / total);
        if (stats != NULL) stats[2 * group[g]] = top, stats[2 * group[g] + 1] = total;
    }
    for (long c = 0; c < d; c += 16) {
        __m256 acc[ATTENTION_GROUP][2];
        for (long g = 0; g < members; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
        for (long k = 0; k < blocks_used; k++) {
            long first = k * block_size;
            long count = length - first < block_size ? length - first : block_size;
            long values = table[k] * block_size * stride + c;
            for (long t = 0; t < count; t++) {
                __m256 v0 = load_8(values_of_head, values + t * stride, bf16);
                __m256 v1 = load_8(values_of_head, values + t * stride + 8, bf16);
                for (long g = 0; g < members; g++) {
                    __m256 weight = _mm256_set1_ps(scores[g * length + first + t]);
                    acc[g][0] = _mm256_fmadd_ps(weight, v0, acc[g][0]);
                    acc[g][1] = _mm256_fmadd_ps(weight, v1, acc[g][1]);
                }
            }
        }
        for (long g = 0; g < members; g++) {
            float lanes[16];
            _mm256_storeu_ps(lanes, _mm256_mul_ps(acc[g][0], inv[g]));
            _mm256_storeu_ps(lanes + 8, _mm256_mul_ps(acc[g][1], inv[g]));
            long at = group[g] * d + c;
            for (int e = 0; e < 16; e++) {
                if (bf16)
                    ((uint16_t *)out)[at + e] = float_to_bf16(lanes[e]);
                else
                    ((float *)out)[at + e] = lanes[e];
            }
        }
    }
}

/* For ISA avx512 (TARGET AVX512) and avx2 (AVX2_FMA): attend_group_ISA, attend_heads_ISA with
 * members (1 to ATTENTION_GROUP) made a constant; and attend_kv_head_ISA, one sequence's decode
 * attention for the query heads that read KV head kv, d a multiple of 16, float32 or bfloat16
 * (bf16) tensors: those heads ATTENTION_GROUP at a time (for float32, d 64 and 128, the Llama
 * family's, made constants: 5-8% faster on AVX-512); q and out: the sequence's rows; scores:
 * attention_scratch_floats; stats (NULL: not kept): each head h's largest score and softmax
 * sum, at 2 h and 2 h + 1. attend_kv_head_ISA is not cloned per caller: its inlined kernels
 * are large. */
#define ATTEND_KV_HEAD(ISA, TARGET)                                                            \
    TARGET static inline __attribute__((always_inline)) void attend_group_##ISA(               \
        const float *const *queries, const void *keys_of_head, const void *values_of_head,    \
        const int64_t *table, long length, long block_size, long stride, const long d,         \
        const int bf16, const long *group, long members, float scale, void *out,               \
        float *scores, float *stats) {                                                         \
        switch (members) {                                                                     \
        case 1: ATTEND_HEADS(ISA, 1); break;                                                   \
        case 2: ATTEND_HEADS(ISA, 2); break;                                                   \
        case 3: ATTEND_HEADS(ISA, 3); break;                                                   \
        default: ATTEND_HEADS(ISA, 4); break;                                                  \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    TARGET __attribute__((noclone)) static void attend_kv_head_##ISA(                          \
        int bf16, const void *q, const void *key_cache, const void *value_cache,               \
        const int64_t *table, long length, long heads, const int64_t *kv_index, long kv,       \
        long kv_heads, long d, long block_size, float scale, void *out, float *scores,         \
        float *stats) {                                                                        \
        long stride = kv_heads * d, group[ATTENTION_GROUP], members;                           \
        const char *keys = kv_head_start(key_cache, kv, d, bf16);                              \
        const char *values = kv_head_start(value_cache, kv, d, bf16);                          \
        const float *queries[ATTENTION_GROUP];                                                 \
        for (long h = 0;                                                                       \
             (members = next_group(q, bf16, d, heads, kv_index, kv, &h, group, queries,        \
                                   scores + ATTENTION_GROUP * length)) > 0;) {                 \
            if (bf16)                                                                          \
                ATTEND_GROUP(ISA, d, 1);                                                       \
            else if (d == 64)                                                                  \
                ATTEND_GROUP(ISA, 64, 0);                                                      \
            else if (d == 128)                                                                 \
                ATTEND_GROUP(ISA, 128, 0);                                                     \
            else                                                                               \
                ATTEND_GROUP(ISA, d, 0);                                                       \
        }                                                                                      \
    }
#define ATTEND_HEADS(ISA, count)                                                               \
    attend_heads_##ISA(queries, keys_of_head, values_of_head, table, length, block_size,      \
                       stride, d, bf16, group, count, scale, out, scores, stats)
#define ATTEND_GROUP(ISA, head_dim, type)                                                      \
    attend_group_##ISA(queries, keys, values, table, length, block_size, stride, head_dim,     \
                       type, group, members, scale, out, scores, stats)
ATTEND_KV_HEAD(avx512, AVX512)
ATTEND_KV_HEAD(avx2, AVX2_FMA)
#undef ATTEND_KV_HEAD
#undef ATTEND_HEADS
#undef ATTEND_GROUP

/* One sequence's decode attention for the query heads reading KV head kv (see
 * ATTEND_KV_HEAD), on AVX-512 where avx512, else on AVX2 with FMA: the same bits. */
static void attend_kv_head(int avx512, int bf16, const void *q, const void *key_cache,
                           const void *value_cache, const int64_t *table, long length,
                           long heads, const int64_t *kv_index, long kv, long kv_heads, long d,
                           long block_size, float scale, void *out, float *scores,
                           float *stats) {
    if (avx512)
        attend_kv_head_avx512(bf16, q, key_cache, value_cache, table, length, heads, kv_index, kv,
                              kv_heads, d, block_size, scale, out, scores, stats);
    else
        attend_kv_head_avx2(bf16, q, key_cache, value_cache, table, length, heads, kv_index, kv,
                            kv_heads, d, block_size, scale, out, scores, stats);
}

/* decode_attention_rows_f32 (bf16 0) or _bf16 (1) for d a multiple of 16, on AVX-512 where
 * avx512, else on AVX2 with FMA: each sequence's KV heads in turn (attend_kv_head). */
static void decode_attention_by_kv_head(int avx512, int bf16, const void *q,
                                        const void *key_cache, const void *value_cache,
                                        const int64_t *blocks, long per_seq,
                                        const int64_t *lengths, long batch, long heads,
                                        const int64_t *kv_index, long kv_heads, long d,
                                        long block_size, float scale, void *out, float *scores) {
    size_t row = (size_t)(heads * d) * (bf16 ? sizeof(uint16_t) : sizeof(float));
    for (long b = 0; b < batch; b++)
        for (long kv = 0; kv < kv_heads; kv++)
            attend_kv_head(avx512, bf16, (const char *)q + b * row, key_cache, value_cache,
                           blocks + b * per_seq, (long)lengths[b], heads, kv_index, kv, kv_heads,
                           d, block_size, scale, (char *)out + b * row, scores, NULL);
}
#endif

/* ---- Python bindings: addresses and sizes as ints, floats as floats ---- */

/* Every slot inside the cache's num_slots, else IndexError (-1). */
static int check_slots(const int64_t *slots, long rows, long num_slots) {
    for (long r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) {
            PyErr_Format(PyExc_IndexError, "slot %lld is outside the cache's %ld slots",
                         (long long)slots[r], num_slots);
            return -1;
        }
    return 0;
}

/* A decode batch's lengths fit its blocks, the blocks are the cache's and each query head
 * reads one of the KV heads, else ValueError / IndexError (-1); *longest: the longest length. */
static int check_decode(const int64_t *lengths, long batch, long per_seq, long block_size,
                        const int64_t *blocks, long num_blocks, const int64_t *kv_index,
                        long heads, long kv_heads, long *longest) {
    *longest = 0;
    for (long b = 0; b < batch; b++) {
        if (lengths[b] < 1 || lengths[b] > per_seq * block_size) {
            PyErr_Format(PyExc_ValueError, "sequence length %lld does not fit %ld blocks of %ld",
                         (long long)lengths[b], per_seq, block_size);
            return -1;
        }
        *longest = lengths[b] > *longest ? (long)lengths[b] : *longest;
    }
    for (long i = 0; i < batch * per_seq; i++)
        if (blocks[i] < 0 || blocks[i] >= num_blocks) {
            PyErr_Format(PyExc_IndexError, "block %lld is outside the cache's %ld blocks",
                         (long long)blocks[i], num_blocks);
            return -1;
        }
    for (long h = 0; h < heads; h++)
        if (kv_index[h] < 0 || kv_index[h] >= kv_heads) {
            PyErr_Format(PyExc_IndexError, "query head %ld reads KV head %lld of %ld", h,
                         (long long)kv_index[h], kv_heads);
            return -1;
        }
    return 0;
}

/* Whether decode attention of head size d runs a vector kernel (AVX-512, else AVX2 with FMA),
 * which can attend one KV head, or a piece of one, at a time (the portable kernel attends
 * whole sequences). */
static int attends_by_kv_head(long d) {
#ifdef HAVE_BLOCKED_LINEAR
    return d % 16 == 0 && cpu_runs_blocked_linear();
#else
    return 0;
#endif
}

/* Decode attention over float32 (bf16 0) or bfloat16 (1) tensors on the widest kernel this
 * CPU runs (the AVX2 one in place of AVX-512 where only_avx2, the same bits); scores: room for
 * attention_scratch_floats(longest, d). */
static void attend(int only_avx2, int bf16, const void *q, const void *key_cache,
                   const void *value_cache, const int64_t *blocks, long per_seq,
                   const int64_t *lengths, long batch, long heads, const int64_t *kv_index,
                   long kv_heads, long d, long block_size, float scale, void *out, float *scores,
                   long longest) {
#ifdef HAVE_BLOCKED_LINEAR
    if (attends_by_kv_head(d)) {
        decode_attention_by_kv_head(!only_avx2 && cpu_has_avx512(), bf16, q, key_cache,
                                    value_cache, blocks, per_seq, lengths, batch, heads, kv_index,
                                    kv_heads, d, block_size, scale, out, scores);
        return;
    }
#else
    (void)only_avx2;
#endif
    if (bf16)
        decode_attention_rows_bf16(q, key_cache, value_cache, blocks, per_seq, lengths, batch,
                                   heads, kv_index, kv_heads, d, block_size, scale, out, scores,
                                   scores + longest);
    else
        decode_attention_rows_f32(q, key_cache, value_cache, blocks, per_seq, lengths, batch,
                                  heads, kv_index, kv_heads, d, block_size, scale, out, scores,
                                  scores + longest);
}

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

static PyObject *embedding_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 8, "embedding_rows") < 0) return NULL;
    long bf16 = SIZE(0), table_rows = SIZE(2), hidden = SIZE(3), count = SIZE(5);
    long first = SIZE(6);
    const char *table = ADDRESS(1);
    const int64_t *ids = ADDRESS(4);
    char *out = ADDRESS(7);
    if (PyErr_Occurred()) return NULL;
    size_t row_bytes = (size_t)hidden * (bf16 ? 2 : 4);
    for (long i = 0; i < count; i++) {
        int64_t row = ids[i] - first;
        if (row >= 0 && row < table_rows)
            memcpy(out + i * row_bytes, table + row * row_bytes, row_bytes);
        else
            memset(out + i * row_bytes, 0, row_bytes);
    }
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
    if (PyErr_Occurred() || check_slots(slots, rows, num_slots) < 0) return NULL;
    if (bf16)
        rope_store_rows_bf16(qkv, rows, q_heads, kv_heads, d, cos, sin, q_out, key_cache,
                             value_cache, slots);
    else
        rope_store_rows_f32(qkv, rows, q_heads, kv_heads, d, cos, sin, q_out, key_cache,
                            value_cache, slots);
    Py_RETURN_NONE;
}

static PyObject *decode_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 17, "decode_attention") < 0) return NULL;
    long bf16 = SIZE(0), only_avx2 = SIZE(16);
    void *q = ADDRESS(1), *key_cache = ADDRESS(2), *value_cache = ADDRESS(3), *out = ADDRESS(15);
    const int64_t *blocks = ADDRESS(4), *lengths = ADDRESS(6), *kv_index = ADDRESS(9);
    long per_seq = SIZE(5), batch = SIZE(7), heads = SIZE(8), kv_heads = SIZE(10), d = SIZE(11);
    long block_size = SIZE(12), num_blocks = SIZE(13);
    float scale = REAL(14);
    long longest;
    if (PyErr_Occurred() || check_decode(lengths, batch, per_seq, block_size, blocks, num_blocks,
                                         kv_index, heads, kv_heads, &longest) < 0)
        return NULL;
    float *scores = malloc((size_t)attention_scratch_floats(longest, d) * sizeof(float));
    if (scores == NULL) return PyErr_NoMemory();
    attend(only_avx2 != 0, bf16 != 0, q, key_cache, value_cache, blocks, per_seq, lengths, batch,
           heads, kv_index, kv_heads, d, block_size, scale, out, scores, longest);
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

/* ---- a decoder layer's halves (float32, blocked weights, decodes only) --------------------
 * The attention half: [residual add +] RMSNorm, the qkv linear, RoPE + the cache store, decode
 * attention, the o_proj linear (its bias, if any, comes after the all-reduce); the MLP half:
 * [residual add +] RMSNorm, the gate_up linear, SiLU x up, the down linear. The kernels of the
 * one-operation calls above, in the same order on the same values: results are bit-identical
 * to that path. attention_block and mlp_block run one half; decode_layers runs every layer of
 * a step, with the all-reduces between the halves made through a communicator's C entry point
 * (native_all_reduce.h). times (a double[3], or NULL): seconds added to the matmuls ([0]),
 * attention ([1]) and the all-reduces ([2]), for the profile. */

/* Adds the time since *since to times[part] (when timing) and restarts the clock. */
static inline void lap(double *times, int part, double *since) {
    if (times == NULL) return;
    double now = shardline_seconds_now();
    if (part >= 0) times[part] += now - *since;
    *since = now;
}

enum { LAP_MATMUL = 0, LAP_ATTENTION = 1, LAP_COMM = 2, LAP_OTHER = -1 };

/* 0 where this CPU runs the blocked linear kernel (AVX-512, or AVX2 and FMA), else
 * RuntimeError (-1). */
static int blocked_linear_or_error(void) {
#ifdef HAVE_BLOCKED_LINEAR
    if (cpu_runs_blocked_linear()) return 0;
#endif
    PyErr_SetString(PyExc_RuntimeError, "the blocked linear kernel needs a CPU with AVX-512 "
                                        "(F, BW and VL) or with AVX2 and FMA");
    return -1;
}

/* One layer's weights and cache (blocked linears, each held as its kind says: WEIGHT_*;
 * biases may be NULL). */
typedef struct {
    const void *qkv_weight, *o_weight, *gate_up_weight, *down_weight;
    const float *input_norm, *qkv_bias, *o_bias, *post_norm, *gate_up_bias, *down_bias;
    const int64_t *kv_index;
    float *key_cache, *value_cache;
    float input_eps, post_eps;
    int qkv_kind, o_kind, gate_up_kind, down_kind;
} Layer;

/* The sizes every layer of a rank shares, and one step's decode batch. */
typedef struct {
    long rows, hidden, q_heads, kv_heads, d, size, num_blocks, block_size, per_seq, longest;
    float scale;
    const float *cos, *sin;
    const int64_t *slots, *blocks, *lengths;
} Step;

/* A team of several threads attends each sequence's KV heads in pieces of this many tokens
 * (rounded up to whole cache blocks), merged by their softmax sums, so that a long sequence's
 * attention shares out over its threads (one thread attends each whole: pieces cost it 3-10%);
 * a sequence of one piece is attended whole. */
#define ATTENTION_PIECE_TOKENS 256

/* Cache blocks of one attention piece. */
static long attention_piece_blocks(const Step *step) {
    return (ATTENTION_PIECE_TOKENS + step->block_size - 1) / step->block_size;
}

/* Pieces of the step's longest sequence for workers threads (the other sequences have as
 * many, the last ones empty); 1 for one thread, for a head size the vector kernels do not
 * take (a chunk is a whole sequence there) and for a step without attention (an MLP half
 * alone: no cache blocks). */
static long attention_pieces(const Step *step, int workers) {
    if (workers == 1 || !attends_by_kv_head(step->d) || step->block_size == 0) return 1;
    long blocks = (step->longest + step->block_size - 1) / step->block_size;
    return (blocks + attention_piece_blocks(step) - 1) / attention_piece_blocks(step);
}

/* Floats at the start of a half's scratch for its linears' quantized inputs (a multiple of
 * 16: what follows stays 64-byte aligned): room for rows of the widest input. */
static long activation_floats(const Step *step) {
    long widest = step->hidden > step->size ? step->hidden : step->size;
    if (step->q_heads * step->d > widest) widest = step->q_heads * step->d;
    return (quantized_rows_floats(step->rows, widest) + 15) / 16 * 16;
}

/* Floats of scratch one half of a layer needs (attention's is the larger unless the MLP is
 * wide): activation_floats, then normed rows, qkv, queries, attended rows, a norm row, the
 * attention scores of each of workers threads and the attention pieces' outputs and sums
 * (attention_pieces). */
static size_t scratch_floats(const Step *step, int workers) {
    long qkv_width = (step->q_heads + 2 * step->kv_heads) * step->d;
    long pieces = attention_pieces(step, workers);
    long attention = step->rows * (step->hidden + qkv_width + 2 * step->q_heads * step->d) +
                     step->hidden + workers * attention_scratch_floats(step->longest, step->d) +
                     (pieces > 1 ? step->rows * step->q_heads * pieces * (step->d + 2) : 0);
    long mlp = step->rows * (step->hidden + 3 * step->size) + step->hidden;
    return (size_t)(activation_floats(step) + (attention > mlp ? attention : mlp));
}

#ifdef HAVE_BLOCKED_LINEAR
/* A step's decode attention over one layer's cache: a chunk is one KV head of a sequence
 * (parts = kv_heads, where a vector kernel takes d) or a whole sequence (parts = 1), so a
 * batch of one shares out too; each worker scores in its own piece of scores
 * (attention_scratch_floats). With pieces > 1 (attention_pieces) a KV head's chunk is one
 * piece of the sequence's cache blocks: its heads' outputs go to partial and their
 * largest scores and sums to stats ([sequence][piece][q_heads] rows of d and 2 floats), and
 * merge_pieces makes out of them. */
typedef struct {
    const Layer *layer;
    const Step *step;
    const float *q;
    float *out, *scores, *partial, *stats;
    long parts, pieces;
    int avx512; /* the AVX-512 kernels, else the AVX2 ones */
} AttentionJob;

static void attention_chunk(const void *context, long chunk, int worker) {
    const AttentionJob *job = context;
    const Step *step = job->step;
    long per_sequence = job->parts * job->pieces, sequence = chunk / per_sequence;
    long length = (long)step->lengths[sequence], at = sequence * step->q_heads * step->d;
    const int64_t *table = step->blocks + sequence * step->per_seq;
    float *scores = job->scores + worker * attention_scratch_floats(step->longest, step->d);
    if (job->parts == 1) {
        attend(0, 0, job->q + at, job->layer->key_cache, job->layer->value_cache, table,
               step->per_seq, step->lengths + sequence, 1, step->q_heads, job->layer->kv_index,
               step->kv_heads, step->d, step->block_size, step->scale, job->out + at, scores,
               step->longest);
        return;
    }
    long kv = chunk % per_sequence / job->pieces, piece = chunk % job->pieces;
    float *out = job->out + at, *stats = NULL;
    if (job->pieces > 1) {
        long blocks = (length + step->block_size - 1) / step->block_size;
        long span = attention_piece_blocks(step), first = piece * span;
        long end = first + span < blocks ? first + span : blocks;
        long slice = (sequence * job->pieces + piece) * step->q_heads;
        out = job->partial + slice * step->d, stats = job->stats + 2 * slice;
        if (first >= end) { /* a sequence shorter than the longest: this piece is past it */
            for (long h = 0; h < step->q_heads; h++)
                if (job->layer->kv_index[h] == kv) stats[2 * h + 1] = 0.0f;
            return;
        }
        long until = end * step->block_size < length ? end * step->block_size : length;
        table += first, length = until - first * step->block_size;
    }
    attend_kv_head(job->avx512, 0, job->q + at, job->layer->key_cache,
                   job->layer->value_cache, table, length, step->q_heads, job->layer->kv_index, kv,
                   step->kv_heads, step->d, step->block_size, step->scale, out, scores, stats);
}

/* out's row of each sequence and query head from its pieces' (attention_chunk): their outputs
 * weighted by each piece's share of the whole softmax's sum (its sum scaled from its own
 * largest score to the largest of all). */
static void merge_pieces(const AttentionJob *job) {
    long heads = job->step->q_heads, d = job->step->d, pieces = job->pieces;
    for (long sequence = 0; sequence < job->step->rows; sequence++)
        for (long h = 0; h < heads; h++) {
            /* piece p's row: (sequence * pieces + p) * heads + h, p = 0 .. pieces - 1 */
            long first = sequence * pieces * heads + h;
            const float *stats = job->stats + 2 * first, *part = job->partial + first * d;
            float top = -INFINITY, total = 0.0f, weight[pieces];
            for (long p = 0; p < pieces; p++)
                if (stats[2 * p * heads + 1] > 0.0f && stats[2 * p * heads] > top)
                    top = stats[2 * p * heads];
            for (long p = 0; p < pieces; p++) {
                const float *piece = stats + 2 * p * heads; /* largest score, sum */
                weight[p] = piece[1] > 0.0f ? piece[1] * expf(piece[0] - top) : 0.0f;
                total += weight[p];
            }
            float *out = job->out + (sequence * heads + h) * d;
            for (long i = 0; i < d; i++) out[i] = 0.0f;
            for (long p = 0; p < pieces; p++) {
                float share = weight[p] / total;
                for (long i = 0; weight[p] > 0.0f && i < d; i++)
                    out[i] += share * part[p * heads * d + i];
            }
        }
}

/* partial = o_proj(attention(norm(x [+ residual]))); residual_out = x + residual where
 * residual is given. partial may be x. */
static void attention_half(Team *team, const Layer *layer, const Step *step, const float *x,
                           const float *residual, float *residual_out, float *partial,
                           float *scratch, double *times) {
    long rows = step->rows, hidden = step->hidden, d = step->d;
    long qkv_width = (step->q_heads + 2 * step->kv_heads) * d, width = step->q_heads * d;
    float *activations = scratch, *normed = scratch + activation_floats(step);
    float *qkv = normed + rows * hidden, *q = qkv + rows * qkv_width;
    float *attended = q + rows * width, *row = attended + rows * width, *scores = row + hidden;
    int workers = team_workers(team);
    long pieces = attention_pieces(step, workers);
    float *piece_outputs = scores + workers * attention_scratch_floats(step->longest, d);
    double since = times ? shardline_seconds_now() : 0.0;
    rms_norm_rows_f32(x, residual, layer->input_norm, normed, residual_out, rows, hidden,
                      layer->input_eps, row);
    lap(times, LAP_OTHER, &since);
    blocked_linear_rows(team, layer->qkv_weight, layer->qkv_kind, normed, qkv,
                        layer->qkv_bias, rows, qkv_width, hidden, activations);
    lap(times, LAP_MATMUL, &since);
    rope_store_rows_f32(qkv, rows, step->q_heads, step->kv_heads, d, step->cos, step->sin, q,
                        layer->key_cache, layer->value_cache, step->slots);
    lap(times, LAP_OTHER, &since);
    AttentionJob attention = {.layer = layer, .step = step, .q = q, .out = attended,
                              .scores = scores, .partial = piece_outputs,
                              .stats = piece_outputs + rows * step->q_heads * pieces * d,
                              .parts = attends_by_kv_head(d) ? step->kv_heads : 1,
                              .pieces = pieces, .avx512 = cpu_has_avx512()};
    team_run(team, rows * attention.parts * pieces, attention_chunk, &attention);
    if (pieces > 1) merge_pieces(&attention);
    lap(times, LAP_ATTENTION, &since);
    blocked_linear_rows(team, layer->o_weight, layer->o_kind, attended, partial, NULL, rows,
                        hidden, width, activations);
    lap(times, LAP_MATMUL, &since);
}

/* partial = down(silu(gate) * up of norm(x + residual)); residual_out = x + residual. */
static void mlp_half(Team *team, const Layer *layer, const Step *step, const float *x,
                     const float *residual, float *residual_out, float *partial, float *scratch,
                     double *times) {
    long rows = step->rows, hidden = step->hidden, size = step->size;
    float *activations = scratch, *normed = scratch + activation_floats(step);
    float *gate_up = normed + rows * hidden;
    float *activated = gate_up + 2 * rows * size, *row = activated + rows * size;
    double since = times ? shardline_seconds_now() : 0.0;
    rms_norm_rows_f32(x, residual, layer->post_norm, normed, residual_out, rows, hidden,
                      layer->post_eps, row);
    lap(times, LAP_OTHER, &since);
    blocked_linear_rows(team, layer->gate_up_weight, layer->gate_up_kind, normed, gate_up,
                        layer->gate_up_bias, rows, 2 * size, hidden, activations);
    lap(times, LAP_MATMUL, &since);
    silu_mul_rows_f32(gate_up, activated, rows, size);
    lap(times, LAP_OTHER, &since);
    blocked_linear_rows(team, layer->down_weight, layer->down_kind, activated, partial, NULL,
                        rows, hidden, size, activations);
    lap(times, LAP_MATMUL, &since);
}

/* x += bias, per row (NULL: nothing). */
static void add_bias(float *x, const float *bias, long rows, long hidden) {
    if (bias == NULL) return;
    for (long r = 0; r < rows; r++)
        for (long i = 0; i < hidden; i++) x[r * hidden + i] += bias[i];
}

/* The all-reduce between halves through entry (NULL: one rank, nothing to do); 0, or the
 * entry's failure status with the communicator's message in error. */
static int reduce_between(const shardline_native_all_reduce *entry, float *partial,
                          double *times, char *error, size_t size) {
    if (entry == NULL) return 0;
    double since = times ? shardline_seconds_now() : 0.0;
    int status = entry->all_reduce(entry->context, partial, error, size);
    lap(times, LAP_COMM, &since);
    return status;
}
#endif

/* 0 where a weight of `in` inputs held as kind (WEIGHT_*) runs here, else ValueError (-1):
 * quantized kinds need AVX-512 (or AVX2, FMA and F16C) and whole groups of inputs. */
static int check_kind(int kind, long in, const char *what) {
    if (kind < 0 || kind >= WEIGHT_KINDS) {
        PyErr_Format(PyExc_ValueError, "%s weight kind %d; allowed: 0 to %d", what, kind,
                     WEIGHT_KINDS - 1);
        return -1;
    }
    if (!reads_blocks(kind)) return 0;
#ifdef HAVE_BLOCKED_LINEAR
    if ((cpu_has_avx512() || cpu_has_avx2_f16c()) && in % QUANT_GROUP == 0) return 0;
#endif
    PyErr_Format(PyExc_ValueError,
                 "%s weight held in quantization blocks (kind %d): needs a CPU with AVX-512 "
                 "(or AVX2, FMA and F16C) and inputs in whole groups of %d (%ld)",
                 what, kind, QUANT_GROUP, in);
    return -1;
}

/* Checks a step's decode batch against the cache and fills step->longest (-1: exception). */
static int check_step(Step *step, const int64_t *kv_index) {
    return check_slots(step->slots, step->rows, step->num_blocks * step->block_size) < 0 ||
                   check_decode(step->lengths, step->rows, step->per_seq, step->block_size,
                                step->blocks, step->num_blocks, kv_index, step->q_heads,
                                step->kv_heads, &step->longest) < 0
               ? -1
               : 0;
}

static PyObject *attention_block(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 30, "attention_block") < 0) return NULL;
    const float *x = ADDRESS(0), *residual = ADDRESS(1);
    Layer layer = {.input_norm = ADDRESS(2), .input_eps = REAL(3), .qkv_weight = ADDRESS(6),
                   .qkv_bias = ADDRESS(7), .key_cache = ADDRESS(14),
                   .value_cache = ADDRESS(15), .kv_index = ADDRESS(21),
                   .o_weight = ADDRESS(23), .qkv_kind = SIZE(28), .o_kind = SIZE(29)};
    Step step = {.rows = SIZE(4), .hidden = SIZE(5), .q_heads = SIZE(8), .kv_heads = SIZE(9),
                 .d = SIZE(10), .cos = ADDRESS(11), .sin = ADDRESS(12), .slots = ADDRESS(13),
                 .num_blocks = SIZE(16), .block_size = SIZE(17), .blocks = ADDRESS(18),
                 .per_seq = SIZE(19), .lengths = ADDRESS(20), .scale = REAL(22)};
    float *partial = ADDRESS(24), *residual_out = ADDRESS(25);
    double *times = ADDRESS(26);
    int failed;
    Team *team = team_of(args[27], &failed);
    if (failed || PyErr_Occurred() || blocked_linear_or_error() < 0 ||
        check_kind(layer.qkv_kind, step.hidden, "qkv") < 0 ||
        check_kind(layer.o_kind, step.q_heads * step.d, "o_proj") < 0 ||
        check_step(&step, layer.kv_index) < 0)
        return NULL;
#ifdef HAVE_BLOCKED_LINEAR
    float *scratch = malloc(sizeof(float) * scratch_floats(&step, team_workers(team)));
    if (scratch == NULL) return PyErr_NoMemory();
    attention_half(team, &layer, &step, x, residual, residual_out, partial, scratch, times);
    free(scratch);
#endif
    Py_RETURN_NONE;
}

static PyObject *mlp_block(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 16, "mlp_block") < 0) return NULL;
    const float *x = ADDRESS(0), *residual = ADDRESS(1);
    Layer layer = {.post_norm = ADDRESS(2), .post_eps = REAL(3), .gate_up_weight = ADDRESS(6),
                   .gate_up_bias = ADDRESS(7), .down_weight = ADDRESS(9),
                   .gate_up_kind = SIZE(14), .down_kind = SIZE(15)};
    Step step = {.rows = SIZE(4), .hidden = SIZE(5), .size = SIZE(8)};
    float *partial = ADDRESS(10), *residual_out = ADDRESS(11);
    double *times = ADDRESS(12);
    int failed;
    Team *team = team_of(args[13], &failed);
    if (failed || PyErr_Occurred() || blocked_linear_or_error() < 0 ||
        check_kind(layer.gate_up_kind, step.hidden, "gate_up") < 0 ||
        check_kind(layer.down_kind, step.size, "down") < 0)
        return NULL;
#ifdef HAVE_BLOCKED_LINEAR
    float *scratch = malloc(sizeof(float) * scratch_floats(&step, team_workers(team)));
    if (scratch == NULL) return PyErr_NoMemory();
    mlp_half(team, &layer, &step, x, residual, residual_out, partial, scratch, times);
    free(scratch);
#endif
    Py_RETURN_NONE;
}

/* A failed native all-reduce as Python sees it: (message, timed_out). */
static PyObject *native_failure(int status, const char *error) {
    return Py_BuildValue("(sO)", error, status == SHARDLINE_NATIVE_TIMED_OUT ? Py_True : Py_False);
}

/* Fields of one layer in decode_layers' table of addresses (int64), in this order. */
enum {
    TABLE_INPUT_NORM, TABLE_QKV_WEIGHT, TABLE_QKV_BIAS, TABLE_O_WEIGHT, TABLE_O_BIAS,
    TABLE_POST_NORM, TABLE_GATE_UP_WEIGHT, TABLE_GATE_UP_BIAS, TABLE_DOWN_WEIGHT,
    TABLE_DOWN_BIAS, TABLE_KV_INDEX, TABLE_KEY_CACHE, TABLE_VALUE_CACHE, TABLE_QKV_KIND,
    TABLE_O_KIND, TABLE_GATE_UP_KIND, TABLE_DOWN_KIND, TABLE_FIELDS
};

static PyObject *decode_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 25, "decode_layers") < 0) return NULL;
    const int64_t *table = ADDRESS(0);
    const double *eps = ADDRESS(1);
    long layers = SIZE(2);
    const float *x = ADDRESS(3), *residual = ADDRESS(4);
    Step step = {.rows = SIZE(5), .hidden = SIZE(6), .q_heads = SIZE(7), .kv_heads = SIZE(8),
                 .d = SIZE(9), .size = SIZE(10), .scale = REAL(11), .cos = ADDRESS(12),
                 .sin = ADDRESS(13), .slots = ADDRESS(14), .num_blocks = SIZE(15),
                 .block_size = SIZE(16), .blocks = ADDRESS(17), .per_seq = SIZE(18),
                 .lengths = ADDRESS(19)};
    float *hidden_out = ADDRESS(20), *residual_out = ADDRESS(21);
    PyObject *all_reduce = args[22];
    double *times = ADDRESS(23);
    int failed;
    Team *team = team_of(args[24], &failed);
    if (failed || PyErr_Occurred() || blocked_linear_or_error() < 0) return NULL;
    const shardline_native_all_reduce *entry = NULL;
    if (all_reduce != Py_None) {
        entry = PyCapsule_GetPointer(all_reduce, SHARDLINE_NATIVE_ALL_REDUCE);
        if (entry == NULL) return NULL;
    }
    for (long l = 0; l < layers; l++) {
        const int64_t *fields = table + l * TABLE_FIELDS;
        if (check_step(&step, (const int64_t *)fields[TABLE_KV_INDEX]) < 0 ||
            check_kind((int)fields[TABLE_QKV_KIND], step.hidden, "qkv") < 0 ||
            check_kind((int)fields[TABLE_O_KIND], step.q_heads * step.d, "o_proj") < 0 ||
            check_kind((int)fields[TABLE_GATE_UP_KIND], step.hidden, "gate_up") < 0 ||
            check_kind((int)fields[TABLE_DOWN_KIND], step.size, "down") < 0)
            return NULL;
    }
    char error[512] = "";
    int status = 0;
#ifdef HAVE_BLOCKED_LINEAR
    float *scratch = malloc(sizeof(float) * scratch_floats(&step, team_workers(team)));
    if (scratch == NULL) return PyErr_NoMemory();
    size_t row_bytes = sizeof(float) * (size_t)(step.rows * step.hidden);
    Py_BEGIN_ALLOW_THREADS
    for (long l = 0; l < layers && status == 0; l++) {
        const int64_t *fields = table + l * TABLE_FIELDS;
#define FIELD(name) ((void *)fields[TABLE_##name])
        Layer layer = {.input_norm = FIELD(INPUT_NORM), .qkv_weight = FIELD(QKV_WEIGHT),
                       .qkv_bias = FIELD(QKV_BIAS), .o_weight = FIELD(O_WEIGHT),
                       .o_bias = FIELD(O_BIAS), .post_norm = FIELD(POST_NORM),
                       .gate_up_weight = FIELD(GATE_UP_WEIGHT),
                       .gate_up_bias = FIELD(GATE_UP_BIAS), .down_weight = FIELD(DOWN_WEIGHT),
                       .down_bias = FIELD(DOWN_BIAS), .kv_index = FIELD(KV_INDEX),
                       .key_cache = FIELD(KEY_CACHE), .value_cache = FIELD(VALUE_CACHE),
                       .input_eps = (float)eps[2 * l], .post_eps = (float)eps[2 * l + 1],
                       .qkv_kind = (int)fields[TABLE_QKV_KIND],
                       .o_kind = (int)fields[TABLE_O_KIND],
                       .gate_up_kind = (int)fields[TABLE_GATE_UP_KIND],
                       .down_kind = (int)fields[TABLE_DOWN_KIND]};
#undef FIELD
        if (l > 0) /* the previous layer's output and residual stream */
            attention_half(team, &layer, &step, hidden_out, residual_out, residual_out,
                           hidden_out, scratch, times);
        else if (residual != NULL) /* a later pipeline stage: the stream comes with x */
            attention_half(team, &layer, &step, x, residual, residual_out, hidden_out, scratch,
                           times);
        else { /* the first layer: x is the residual stream */
            attention_half(team, &layer, &step, x, NULL, NULL, hidden_out, scratch, times);
            memcpy(residual_out, x, row_bytes);
        }
        status = reduce_between(entry, hidden_out, times, error, sizeof error);
        if (status != 0) break;
        add_bias(hidden_out, layer.o_bias, step.rows, step.hidden);
        mlp_half(team, &layer, &step, hidden_out, residual_out, residual_out, hidden_out,
                 scratch, times);
        status = reduce_between(entry, hidden_out, times, error, sizeof error);
        add_bias(hidden_out, layer.down_bias, step.rows, step.hidden);
    }
    Py_END_ALLOW_THREADS
    free(scratch);
#endif
    if (status != 0) return native_failure(status, error);
    Py_RETURN_NONE;
}

static PyObject *native_all_reduce_call(PyObject *self, PyObject *const *args,
                                        Py_ssize_t nargs) {
    if (take_args(args, nargs, 2, "native_all_reduce_call") < 0) return NULL;
    const shardline_native_all_reduce *entry =
        PyCapsule_GetPointer(args[0], SHARDLINE_NATIVE_ALL_REDUCE);
    void *data = ADDRESS(1);
    if (entry == NULL || PyErr_Occurred()) return NULL;
    char error[512] = "";
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = entry->all_reduce(entry->context, data, error, sizeof error);
    Py_END_ALLOW_THREADS
    if (status != 0) return native_failure(status, error);
    Py_RETURN_NONE;
}

static PyObject *blocked_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 10, "blocked_linear") < 0) return NULL;
    const void *weight = ADDRESS(0);
    const float *x = ADDRESS(1), *bias = ADDRESS(3);
    float *y = ADDRESS(2);
    long rows = SIZE(4), out = SIZE(5), in = SIZE(6);
    int kind = (int)SIZE(8);
    long kernels = SIZE(9);
    int failed;
    Team *team = team_of(args[7], &failed);
    if (failed || PyErr_Occurred() || blocked_linear_or_error() < 0 ||
        check_kind(kind, in, "blocked_linear") < 0)
        return NULL;
    if (kernels < KERNELS_CHOSEN || kernels > KERNELS_AVX512) {
        PyErr_Format(PyExc_ValueError,
                     "blocked_linear: kernels = %ld; allowed: KERNELS_CHOSEN (0), KERNELS_AVX2 "
                     "(1), KERNELS_AVX512 (2)",
                     kernels);
        return NULL;
    }
#ifdef HAVE_BLOCKED_LINEAR
    if (kernels == KERNELS_AVX2 &&
        !(reads_blocks(kind) ? cpu_has_avx2_f16c() : cpu_has_avx2_fma())) {
        PyErr_SetString(PyExc_RuntimeError, "blocked_linear: KERNELS_AVX2; this CPU has no AVX2 "
                                            "and FMA (and F16C for quantized weights)");
        return NULL;
    }
    if (kernels == KERNELS_AVX512 && !cpu_has_avx512()) {
        PyErr_SetString(PyExc_RuntimeError,
                        "blocked_linear: KERNELS_AVX512; this CPU has no AVX-512 F, BW and VL");
        return NULL;
    }
    float *activations = NULL;
    if (has_codes(weight, kind)) {
        activations = malloc(sizeof(float) * (size_t)quantized_rows_floats(rows, in));
        if (activations == NULL) return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    blocked_linear_rows_on(team, (int)kernels, weight, kind, x, y, bias, rows, out, in,
                           activations);
    Py_END_ALLOW_THREADS
    free(activations);
#endif
    Py_RETURN_NONE;
}

#ifdef HAVE_BLOCKED_LINEAR
/* Output o of row x through a blocked weight of out x in (float32, or bfloat16: bf16) without
 * a bias, as every blocked kernel sums it: input by input from 0, each product added by one
 * fused multiply-add. Its values lie in o's block, one row of the block an input, where a full
 * bfloat16 block holds each 32 outputs in pairs (shardline.layers.kernels.blocked). */
static float blocked_output(const void *weight, int bf16, long out, long in, long o,
                           const float *x) {
    long block = o / LINEAR_BLOCK, within = o % LINEAR_BLOCK;
    long width = out - block * LINEAR_BLOCK < LINEAR_BLOCK ? out - block * LINEAR_BLOCK
                                                         : LINEAR_BLOCK;
    if (bf16 && width == LINEAR_BLOCK) {
        long t = within % 32;
        within += (t < 16 ? 2 * t : 2 * (t - 16) + 1) - t;
    }
    long at = block * LINEAR_BLOCK * in + within;
    float sum = 0.0f;
    if (bf16) {
        const uint16_t *column = (const uint16_t *)weight + at;
        for (long i = 0; i < in; i++) sum = fmaf(bf16_to_float(column[i * width]), x[i], sum);
    } else {
        const float *column = (const float *)weight + at;
        for (long i = 0; i < in; i++) sum = fmaf(column[i * width], x[i], sum);
    }
    return sum;
}

/* How far the screen logits a may lie from their exact sums, at most: their bounds times the
 * row's size plus the codes' norms times the row's spread (what quantizing it missed; 0 where
 * the screen multiplies the row in floats), enlarged by 2^-20 of itself and of |a|, which
 * covers the float32 rounding of this, of a +- it and of a itself (a sum of two passes; 7
 * roundings of 2^-24 of those at most), and by 2^-120, far more than the sums can lose where
 * they underflow (2^-149 an operation). Four outputs at a time (SSE, every x86-64 CPU has it). */
static inline __m128 reach_of(__m128 a, __m128 bounds, __m128 norms, __m128 size,
                              __m128 spread) {
    __m128 reach = _mm_add_ps(_mm_mul_ps(size, bounds), _mm_mul_ps(spread, norms));
    __m128 magnitude = _mm_add_ps(_mm_andnot_ps(_mm_set1_ps(-0.0f), a), reach);
    reach = _mm_add_ps(reach, _mm_mul_ps(_mm_set1_ps(0x1p-20f), magnitude));
    return _mm_add_ps(reach, _mm_set1_ps(0x1p-120f));
}

/* Four outputs from v of a row's screen logits (approx), their bounds and their codes' norms;
 * past valid (a row's last outputs), a logit of -FLT_MAX, a bound and a norm of 0, which the
 * caller passes over. */
static inline void four_outputs(const float *approx, const float *bounds, const float *norms,
                                long v, long valid, __m128 *a, __m128 *b, __m128 *n) {
    if (v + 4 <= valid) {
        *a = _mm_loadu_ps(approx + v), *b = _mm_loadu_ps(bounds + v);
        *n = _mm_loadu_ps(norms + v);
        return;
    }
    float some[4] = {-FLT_MAX, -FLT_MAX, -FLT_MAX, -FLT_MAX}, zero[4] = {0}, none[4] = {0};
    memcpy(some, approx + v, sizeof(float) * (size_t)(valid - v));
    memcpy(zero, bounds + v, sizeof(float) * (size_t)(valid - v));
    memcpy(none, norms + v, sizeof(float) * (size_t)(valid - v));
    *a = _mm_loadu_ps(some), *b = _mm_loadu_ps(zero), *n = _mm_loadu_ps(none);
}

/* The first of the largest of outputs [0, valid) of row x through the blocked head (what the
 * blocked kernel would compute for each), from the screen's logits (approx), their bounds (how
 * far each may lie from its exact sum, per unit of the row's size: its norm, or more) and
 * their codes' norms (per unit of the row's spread: how far the row the screen multiplied lies
 * from x): only the outputs whose reach touches the highest floor (approx - reach) can be the
 * largest, and only they are summed exactly. Returns 0, deciding nothing, where size, spread
 * or a screen logit is not finite, an exact sum is NaN, or more than most outputs are in
 * reach. */
static int settle_row(const float *approx, const float *bounds, const float *norms,
                      float row_size, float row_spread, const float *x, long in, long valid,
                      const void *head, int bf16, long out, long most, float *best,
                      int64_t *index) {
    if (!isfinite(row_size) || !isfinite(row_spread)) return 0;
    __m128 size = _mm_set1_ps(row_size), spread = _mm_set1_ps(row_spread);
    __m128 floors = _mm_set1_ps(-INFINITY), a, b, n;
    __m128 finite = _mm_castsi128_ps(_mm_set1_epi32(-1)), largest = _mm_set1_ps(FLT_MAX);
    for (long v = 0; v < valid; v += 4) {
        four_outputs(approx, bounds, norms, v, valid, &a, &b, &n);
        floors = _mm_max_ps(floors, _mm_sub_ps(a, reach_of(a, b, n, size, spread)));
        /* NaN compares false */
        finite = _mm_and_ps(finite, _mm_cmple_ps(_mm_andnot_ps(_mm_set1_ps(-0.0f), a), largest));
    }
    if (_mm_movemask_ps(finite) != 15) return 0;
    floors = _mm_max_ps(floors, _mm_shuffle_ps(floors, floors, _MM_SHUFFLE(1, 0, 3, 2)));
    floors = _mm_max_ps(floors, _mm_shuffle_ps(floors, floors, _MM_SHUFFLE(2, 3, 0, 1)));
    long candidates = 0;
    for (long v = 0; v < valid; v += 4) {
        four_outputs(approx, bounds, norms, v, valid, &a, &b, &n);
        __m128 upper = _mm_add_ps(a, reach_of(a, b, n, size, spread));
        int reaching = _mm_movemask_ps(_mm_cmpge_ps(upper, floors));
        for (int lane = 0; lane < 4 && v + lane < valid; lane++) {
            if (!(reaching >> lane & 1)) continue;
            if (++candidates > most) return 0;
            float sum = blocked_output(head, bf16, out, in, v + lane, x);
            if (isnan(sum)) return 0;
            if (candidates == 1 || sum > *best) *best = sum, *index = v + lane;
        }
    }
    return candidates > 0;
}

/* The L2 norm of x's in values, rounded up to float32 (infinite where a value is not
 * finite). */
static float norm_above(const float *x, long in) {
    double squares = 0.0;
    for (long i = 0; i < in; i++) squares += (double)x[i] * x[i];
    /* 1e-6 above: float64's rounding of it is ~1e-16, float32's 6e-8 */
    return (float)(sqrt(squares) * (1.0 + 1e-6));
}

/* A screen's logits of x's rows into approx (rows x out floats; 2 rows x out of room), with
 * each row's size and spread for settle_row: held as WEIGHT_Q8_0, the rows in float32 (size
 * their norm, spread 0); as WEIGHT_Q8_CODES_F16, the rows quantized twice (quantize_rows_twice,
 * into activations: quantized_rows_floats(2 rows, in) floats) in integers, each row's two
 * passes added. */
static void screen_logits(Team *team, const void *screen, int kind, const float *x, long rows,
                          long out, long in, float *approx, float *activations, float *size,
                          float *spread) {
    if (kind == WEIGHT_Q8_0) {
        blocked_linear_rows(team, screen, kind, x, approx, NULL, rows, out, in, NULL);
        for (long r = 0; r < rows; r++) size[r] = norm_above(x + r * in, in), spread[r] = 0.0f;
        return;
    }
    QuantizedRows xq = quantized_rows_in(activations, 2 * rows, in);
    quantize_rows_twice(x, rows, in, &xq, spread, size);
    LinearJob job = {.weight = screen, .kind = kind, .avx512 = cpu_has_avx512(), .x = x,
                     .y = approx, .rows = 2 * rows, .out = out, .in = in, .xq = &xq};
    run_linear_job(team, &job);
    for (long r = 0; r < rows; r++) /* row r from rows 2 r and 2 r + 1: those were read */
        for (long v = 0; v < out; v++)
            approx[r * out + v] = approx[2 * r * out + v] + approx[(2 * r + 1) * out + v];
}
#endif

/* screened_argmax(head, bf16, screen, kind, bounds, norms, x, rows, out, in, valid, approx,
 * best, index, most, team): each row of x's largest output among [0, valid) through the
 * blocked head (float32 or bfloat16 elements: bf16) and its first index, into best and index,
 * as the blocked kernel's logits would give them. The screen holds the head's values as kind's
 * blocks: WEIGHT_Q8_0 (multiplied by x's rows in float32) or WEIGHT_Q8_CODES_F16 (by x's rows
 * quantized to about 16 bits, in integers: needs AVX-512 VNNI); it makes every row's logits
 * into approx (2 rows x out floats of room), shared out by team. bounds and norms (valid floats
 * each) bound each output's |approx - exact| per unit of a row's norm and of what quantizing it
 * missed (Python's GreedyScreen says how), and settle_row sums the few outputs in reach
 * exactly. True where every row was settled, else False (the caller then computes the head's
 * logits). */
static PyObject *screened_argmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 16, "screened_argmax") < 0) return NULL;
    const void *head = ADDRESS(0), *screen = ADDRESS(2);
    int bf16 = SIZE(1) != 0, kind = (int)SIZE(3), failed;
    const float *bounds = ADDRESS(4), *norms = ADDRESS(5), *x = ADDRESS(6);
    long rows = SIZE(7), out = SIZE(8), in = SIZE(9), valid = SIZE(10), most = SIZE(14);
    float *approx = ADDRESS(11), *best = ADDRESS(12);
    int64_t *index = ADDRESS(13);
    Team *team = team_of(args[15], &failed);
    if (failed || PyErr_Occurred() || blocked_linear_or_error() < 0 ||
        check_kind(kind, in, "screened_argmax") < 0)
        return NULL;
    if (valid < 1 || valid > out || rows < 1) {
        PyErr_Format(PyExc_ValueError, "screened_argmax: valid %ld of out %ld, rows %ld; "
                     "allowed: 1 <= valid <= out, rows >= 1", valid, out, rows);
        return NULL;
    }
    int settled = 1;
#ifdef HAVE_BLOCKED_LINEAR
    if (kind != WEIGHT_Q8_0 && !(kind == WEIGHT_Q8_CODES_F16 && cpu_has_avx512_vnni())) {
        PyErr_Format(PyExc_ValueError, "screened_argmax: screen kind %d; allowed: WEIGHT_Q8_0, "
                     "or WEIGHT_Q8_CODES_F16 on a CPU with AVX-512 VNNI", kind);
        return NULL;
    }
    float *space = malloc(sizeof(float) * (size_t)(quantized_rows_floats(2 * rows, in) +
                                                   2 * rows));
    if (space == NULL) return PyErr_NoMemory();
    float *size = space, *spread = space + rows;
    Py_BEGIN_ALLOW_THREADS
    screen_logits(team, screen, kind, x, rows, out, in, approx, space + 2 * rows, size, spread);
    for (long r = 0; r < rows && settled; r++)
        settled = settle_row(approx + r * out, bounds, norms, size[r], spread[r], x + r * in,
                             in, valid, head, bf16, out, most, best + r, index + r);
    Py_END_ALLOW_THREADS
    free(space);
#endif
    return PyBool_FromLong(settled);
}

/* A part of a weight held from its file's blocks: the blocks of rows [first, first + rows). */
typedef struct {
    const GGUFType *type;
    const uint8_t *raw;
    long stride, first, rows;
} FilePart;

/* A weight being held as kind from its file's parts (pack_file_blocks), blocks_per_chunk
 * blocks of LINEAR_BLOCK rows a chunk: one thread writes a block's bytes (8 outputs share a
 * byte of fifth bits). */
typedef struct {
    int kind;
    uint8_t *dest;
    long out, in, blocks_per_chunk;
    LoadedWeight weight;
    const FilePart *parts;
    Py_ssize_t count;
    const uint8_t *covered; /* a row a part covers: 1, else its values must be zeros */
    _Atomic int refused;    /* a value or a type not held: the weight is not held so */
} PackJob;

static void pack_chunk(const void *context, long chunk, int worker) {
    PackJob *job = (PackJob *)context;
    if (atomic_load_explicit(&job->refused, memory_order_relaxed)) return;
    long blocks = (job->out + LINEAR_BLOCK - 1) / LINEAR_BLOCK;
    long block = chunk * job->blocks_per_chunk;
    long stop = block + job->blocks_per_chunk < blocks ? block + job->blocks_per_chunk : blocks;
    long first = block * LINEAR_BLOCK;
    long end = stop * LINEAR_BLOCK < job->out ? stop * LINEAR_BLOCK : job->out;
    long block_bytes = job->in / QUANT_GROUP * quantized_group_bytes(job->kind);
    memset(job->dest + block * block_bytes, 0, (size_t)((stop - block) * block_bytes));
    int held = 1;
    for (Py_ssize_t i = 0; i < job->count && held; i++) {
        const FilePart *part = &job->parts[i];
        long from = part->first > first ? part->first : first;
        long to = part->first + part->rows < end ? part->first + part->rows : end;
        if (from < to)
            held = pack_file_rows(job->kind, part->type,
                                  part->raw + (from - part->first) * part->stride, part->stride,
                                  from, to - from, job->out, job->in, &job->weight, job->dest);
    }
    const LoadedWeight *weight = &job->weight;
    for (long r = first; r < end && held; r++)
        for (long i = 0; i < job->in && !job->covered[r] && held; i++)
            held = bits_of(weight->values[r * weight->row_stride + i * weight->column_stride]) == 0;
    if (!held) atomic_store_explicit(&job->refused, 1, memory_order_relaxed);
}

/* Rows of float32 values (``in`` a multiple of 32 each, row after row) as GGUF Q8_0 blocks,
 * with the arithmetic of ggml's reference quantizer (the gguf package's, so its bytes): per
 * 32 values d = max |x| / 127, each code roundf(x * (1 / d)) (0 where d is 0), d stored as
 * float16; the blocks into raw (34 bytes each, row after row), the values they decode to
 * (float16 d widened, times the code) into decoded, and per row, into sums (float64
 * [3, rows]): the sums of (x - decoded)^2, x^2 and decoded^2. 0 where a value, or a block's
 * float16 d, is not finite (the rows written so far are left as they are), else 1. */
static int quantize_q8_0_rows(const float *values, long rows, long in, uint8_t *raw,
                              float *decoded, double *sums) {
    for (long r = 0; r < rows; r++) {
        const float *x = values + r * in;
        float *y = decoded + r * in;
        uint8_t *block = raw + r * (in / 32) * 34;
        double gap[4] = {0}, exact[4] = {0}, screened[4] = {0}; /* lanes: they vectorize */
        for (long b = 0; b < in; b += 32, block += 34) {
            float largest = 0.0f;
            for (int i = 0; i < 32; i++) {
                float magnitude = fabsf(x[b + i]);
                if (!(magnitude <= FLT_MAX)) return 0;
                largest = magnitude > largest ? magnitude : largest;
            }
            float d = largest / 127.0f, inverse = d == 0.0f ? 0.0f : 1.0f / d;
            uint16_t half = shardline_float_to_half(d);
            float scale = shardline_half_to_float(half);
            if (!isfinite(scale)) return 0;
            block[0] = (uint8_t)(half & 0xffu);
            block[1] = (uint8_t)(half >> 8);
            for (int i = 0; i < 32; i++) {
                /* roundf (halves away from zero) of at most 127 in magnitude: its whole part
                 * and fraction are exact. */
                float scaled = x[b + i] * inverse, magnitude = fabsf(scaled);
                int whole = (int)magnitude;
                whole += magnitude - (float)whole >= 0.5f;
                int8_t code = (int8_t)(scaled < 0.0f ? -whole : whole);
                block[2 + i] = (uint8_t)code;
                y[b + i] = (float)code * scale; /* a code of 0 decodes to +0.0 */
            }
            for (int i = 0; i < 32; i++) {
                double value = x[b + i], held = y[b + i], difference = value - held;
                gap[i & 3] += difference * difference;
                exact[i & 3] += value * value;
                screened[i & 3] += held * held;
            }
        }
        sums[r] = (gap[0] + gap[1]) + (gap[2] + gap[3]);
        sums[rows + r] = (exact[0] + exact[1]) + (exact[2] + exact[3]);
        sums[2 * rows + r] = (screened[0] + screened[1]) + (screened[2] + screened[3]);
    }
    return 1;
}

static PyObject *quantize_q8_0(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 6, "quantize_q8_0") < 0) return NULL;
    const float *values = ADDRESS(0);
    long rows = SIZE(1), in = SIZE(2);
    uint8_t *raw = ADDRESS(3);
    float *decoded = ADDRESS(4);
    double *sums = ADDRESS(5);
    if (PyErr_Occurred()) return NULL;
    if (rows < 0 || in < 0 || in % 32) {
        PyErr_Format(PyExc_ValueError,
                     "quantize_q8_0: rows %ld, in %ld; allowed: rows from 0, in a multiple of 32",
                     rows, in);
        return NULL;
    }
    int finite;
    Py_BEGIN_ALLOW_THREADS;
    finite = quantize_q8_0_rows(values, rows, in, raw, decoded, sums);
    Py_END_ALLOW_THREADS;
    return PyBool_FromLong(finite);
}

/* pack_file_blocks(kind, dest, out, in, weight, parts, team): weight the loaded values
 * (address, row stride, column stride, in elements); parts a sequence of (type name, raw
 * address, raw row stride, first row, rows), the file's blocks of those rows of the weight;
 * a row no part covers must be zeros (a vocabulary's padding), held so; shared out by team
 * (None: this thread) blocks of rows a chunk. */
static PyObject *pack_file_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 7, "pack_file_blocks") < 0) return NULL;
    int kind = (int)SIZE(0), failed;
    uint8_t *dest = ADDRESS(1);
    long out = SIZE(2), in = SIZE(3);
    unsigned long long values;
    LoadedWeight weight;
    if (!PyArg_ParseTuple(args[4], "Kll", &values, &weight.row_stride, &weight.column_stride))
        return NULL;
    weight.values = (const float *)(uintptr_t)values;
    Team *team = team_of(args[6], &failed);
    if (PyErr_Occurred() || failed) return NULL;
    if (!is_quantized(kind)) {
        PyErr_Format(PyExc_ValueError, "pack_file_blocks: kind %d; allowed: %d to %d", kind,
                     WEIGHT_Q8_0, WEIGHT_SEGMENTED - 1);
        return NULL;
    }
    PyObject *parts = PySequence_Fast(args[5], "pack_file_blocks: parts must be a sequence");
    if (parts == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(parts);
    FilePart *part = PyMem_Calloc((size_t)count + 1, sizeof *part);
    uint8_t *covered = out > 0 ? PyMem_Calloc((size_t)out, 1) : NULL;
    PyObject *result = NULL;
    if (part == NULL || (out > 0 && covered == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    if (out < 1 || in < 1) {
        PyErr_Format(PyExc_ValueError, "pack_file_blocks: out %ld, in %ld; allowed: from 1", out,
                     in);
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        const char *name;
        unsigned long long raw;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(parts, i), "sKlll", &name, &raw,
                              &part[i].stride, &part[i].first, &part[i].rows))
            goto done;
        part[i].raw = (const uint8_t *)(uintptr_t)raw;
        part[i].type = gguf_type(name);
        if (part[i].type == NULL) {
            PyErr_Format(PyExc_ValueError, "pack_file_blocks: no block type %s (%s)", name,
                         GGUF_TYPE_NAMES);
            goto done;
        }
        long first = part[i].first, last = first + part[i].rows;
        if (first < 0 || part[i].rows < 0 || last > out) {
            PyErr_Format(PyExc_ValueError,
                         "pack_file_blocks: part %zd, rows [%ld, %ld), lies outside out %ld", i,
                         first, last, out);
            goto done;
        }
        for (long r = first; r < last; r++) covered[r]++;
    }
    for (long r = 0; r < out; r++)
        if (covered[r] > 1) {
            PyErr_Format(PyExc_ValueError, "pack_file_blocks: parts overlap at row %ld", r);
            goto done;
        }
    long blocks = (out + LINEAR_BLOCK - 1) / LINEAR_BLOCK, per_chunk = 1;
    while ((blocks + per_chunk - 1) / per_chunk > TEAM_MAX_CHUNKS) per_chunk *= 2;
    PackJob job = {.kind = kind, .dest = dest, .out = out, .in = in, .weight = weight,
                   .blocks_per_chunk = per_chunk, .parts = part, .count = count,
                   .covered = covered};
    /* A type a kind does not hold, or inputs not in its blocks: refused before any work. */
    int held = in % QUANT_GROUP == 0;
    for (Py_ssize_t i = 0; i < count && held; i++)
        held = holds_type(kind, part[i].type) && in % part[i].type->block_values == 0;
    if (held) {
        Py_BEGIN_ALLOW_THREADS
        team_run(team, (blocks + per_chunk - 1) / per_chunk, pack_chunk, &job);
        Py_END_ALLOW_THREADS
        held = !atomic_load(&job.refused);
    }
    result = PyBool_FromLong(held);
done:
    PyMem_Free(covered);
    PyMem_Free(part);
    Py_DECREF(parts);
    return result;
}

static PyObject *quantized_size(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 3, "quantized_size") < 0) return NULL;
    int kind = (int)SIZE(0);
    long out = SIZE(1), in = SIZE(2);
    if (PyErr_Occurred()) return NULL;
    if (!is_quantized(kind)) {
        PyErr_Format(PyExc_ValueError, "quantized_size: kind %d; allowed: %d to %d", kind,
                     WEIGHT_Q8_0, WEIGHT_SEGMENTED - 1);
        return NULL;
    }
    return PyLong_FromLong(quantized_bytes(kind, out, in));
}

static PyObject *kind_holds(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 2, "kind_holds") < 0) return NULL;
    int kind = (int)SIZE(0);
    const char *name = PyUnicode_AsUTF8(args[1]);
    if (PyErr_Occurred()) return NULL;
    const GGUFType *type = gguf_type(name);
    if (!is_quantized(kind) || type == NULL) {
        PyErr_Format(PyExc_ValueError,
                     "kind_holds: kind %d, type %s; allowed: kinds %d to %d, types %s", kind,
                     name, WEIGHT_Q8_0, WEIGHT_SEGMENTED - 1, GGUF_TYPE_NAMES);
        return NULL;
    }
    return PyBool_FromLong(holds_type(kind, type));
}

static PyObject *team(PyObject *self, PyObject *argument) {
    long threads = PyLong_AsLong(argument);
    if (threads == -1 && PyErr_Occurred()) return NULL;
    if (threads < 1 || threads > 4096) {
        PyErr_Format(PyExc_ValueError, "team: threads = %ld; allowed: 1 to 4096", threads);
        return NULL;
    }
    Team *made = team_new((int)threads);
    if (made == NULL) return NULL;
    PyObject *capsule = PyCapsule_New(made, TEAM_CAPSULE, team_close);
    if (capsule == NULL) team_end(made);
    return capsule;
}

static PyObject *team_threads(PyObject *self, PyObject *argument) {
    int failed;
    Team *of = team_of(argument, &failed);
    if (failed) return NULL;
    return PyLong_FromLong(team_workers(of));
}

static PyObject *blocked_linear_available(PyObject *self, PyObject *unused) {
#ifdef HAVE_BLOCKED_LINEAR
    return PyBool_FromLong(cpu_runs_blocked_linear());
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *linear_isa(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (take_args(args, nargs, 2, "linear_isa") < 0) return NULL;
    long rows = SIZE(0);
    int kind = (int)SIZE(1);
    if (PyErr_Occurred()) return NULL;
#ifdef HAVE_BLOCKED_LINEAR
    if (cpu_runs_blocked_linear())
        return PyUnicode_FromString(
            rows_on_avx512(cpu_has_avx512(), cpu_halves_avx512(), kind, rows) ? "avx512"
                                                                               : "avx2");
#endif
    Py_RETURN_NONE;
}

static PyObject *quantized_linear_available(PyObject *self, PyObject *unused) {
#ifdef HAVE_BLOCKED_LINEAR
    return PyBool_FromLong(cpu_has_avx512() || cpu_has_avx2_f16c());
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *int8_dot_available(PyObject *self, PyObject *unused) {
#ifdef HAVE_BLOCKED_LINEAR
    return PyBool_FromLong(cpu_has_avx512_vnni());
#else
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef methods[] = {
    {"rms_norm", (PyCFunction)(void (*)(void))rms_norm, METH_FASTCALL,
     "rms_norm(bf16, x, residual or 0, weight, out, residual_out or 0, rows, hidden, eps)"},
    {"embedding_rows", (PyCFunction)(void (*)(void))embedding_rows, METH_FASTCALL,
     "embedding_rows(bf16, table, rows, hidden, ids, count, first, out): out's row i the "
     "table's row ids[i] - first where that is one of its rows, else zeros"},
    {"rope_store", (PyCFunction)(void (*)(void))rope_store, METH_FASTCALL,
     "rope_store(bf16, qkv, rows, q_heads, kv_heads, d, cos, sin, q_out, key_cache, "
     "value_cache, slots, num_slots)"},
    {"decode_attention", (PyCFunction)(void (*)(void))decode_attention, METH_FASTCALL,
     "decode_attention(bf16, q, key_cache, value_cache, blocks, per_seq, lengths, batch, "
     "heads, kv_index, kv_heads, d, block_size, num_blocks, scale, out, only_avx2): only_avx2 "
     "runs the AVX2 kernel where the CPU has AVX-512 too (the same bits)"},
    {"silu_mul", (PyCFunction)(void (*)(void))silu_mul, METH_FASTCALL,
     "silu_mul(bf16, gate_up, out, rows, size)"},
    {"screened_argmax", (PyCFunction)(void (*)(void))screened_argmax, METH_FASTCALL,
     "screened_argmax(head, bf16, screen, kind, bounds, norms, x, rows, out, in, valid, "
     "approx, best, index, most, team or None): each row's largest output of the blocked head "
     "and its first index, found through the head's screen (WEIGHT_Q8_0 or "
     "WEIGHT_Q8_CODES_F16); False where a row was not settled"},
    {"blocked_linear", (PyCFunction)(void (*)(void))blocked_linear, METH_FASTCALL,
     "blocked_linear(weight, x, y, bias or 0, rows, out, in, team or None, kind, kernels): "
     "float32 rows, the weight blocked by LINEAR_BLOCK outputs and held as kind says "
     "(WEIGHT_FLOAT32, _BFLOAT16, or quantization blocks), on the kernels this CPU takes "
     "for the rows (KERNELS_CHOSEN: linear_isa), the AVX2 ones (KERNELS_AVX2) or the "
     "AVX-512 ones (KERNELS_AVX512), which all give the same bits; without the GIL"},
    {"quantize_q8_0", (PyCFunction)(void (*)(void))quantize_q8_0, METH_FASTCALL,
     "quantize_q8_0(values, rows, in, raw, decoded, sums): float32 rows (C order) as GGUF "
     "Q8_0 blocks into raw, the values they decode to into decoded and per row the float64 "
     "sums of (value - decoded)^2, value^2, decoded^2 into sums [3, rows] (addresses); "
     "False where a value or a block's scale is not finite"},
    {"pack_file_blocks", (PyCFunction)(void (*)(void))pack_file_blocks, METH_FASTCALL,
     "pack_file_blocks(kind, dest, out, in, weight, parts, team or None): a weight (float32 "
     "out x in as loaded: (address, row stride, column stride)), shared out by team, into "
     "dest (quantized_size(kind, ...) bytes) as kind (WEIGHT_Q8_0, _Q4_0, _Q4_1, _Q4_K, "
     "_Q5_K, _Q6_K, _INT8_SCALED, _Q4_CODES, _Q4_CODES_F16, _Q8_CODES_F16) from its "
     "file's blocks: parts, (GGUF type name, address, row stride in bytes, first row, "
     "rows), a row no part covers held as zeros; False where kind does not hold a part's "
     "type or a value so held is not the weight's"},
    {"quantized_size", (PyCFunction)(void (*)(void))quantized_size, METH_FASTCALL,
     "quantized_size(kind, out, in): the bytes pack_file_blocks writes"},
    {"kind_holds", (PyCFunction)(void (*)(void))kind_holds, METH_FASTCALL,
     "kind_holds(kind, type name): whether pack_file_blocks holds the file's blocks of that "
     "GGUF type as that kind (WEIGHT_Q8_0, ...; each value is still checked as it packs)"},
    {"team", team, METH_O,
     "team(threads): a team of threads (this one and threads - 1 helpers) that the linear calls "
     "share each multiply with; its helpers end when it is freed"},
    {"team_threads", team_threads, METH_O,
     "team_threads(team or None): the threads a call given it runs on (1 for None, or in a "
     "forked child)"},
    {"attention_block", (PyCFunction)(void (*)(void))attention_block, METH_FASTCALL,
     "attention_block(x, residual or 0, norm_weight, eps, rows, hidden, qkv_weight, qkv_bias "
     "or 0, q_heads, kv_heads, d, cos, sin, slots, key_cache, value_cache, num_blocks, "
     "block_size, blocks, per_seq, lengths, kv_index, scale, o_weight, partial, residual_out "
     "or 0, times or 0, team or None, qkv_kind, o_kind): float32, blocked weights held as "
     "their kinds say (WEIGHT_*)"},
    {"decode_layers", (PyCFunction)(void (*)(void))decode_layers, METH_FASTCALL,
     "decode_layers(table, eps, layers, x, residual or 0, rows, hidden, q_heads, kv_heads, d, "
     "size, scale, cos, sin, slots, num_blocks, block_size, blocks, per_seq, lengths, "
     "hidden_out, residual_out, all_reduce capsule or None, times or 0, team or None): every "
     "layer of a decode step; None, or the all-reduce's failure (message, timed_out)"},
    {"mlp_block", (PyCFunction)(void (*)(void))mlp_block, METH_FASTCALL,
     "mlp_block(x, residual or 0, norm_weight, eps, rows, hidden, gate_up_weight, gate_up_bias "
     "or 0, size, down_weight, partial, residual_out or 0, times or 0, team or None, "
     "gate_up_kind, down_kind): float32, blocked weights held as their kinds say (WEIGHT_*)"},
    {"native_all_reduce_call", (PyCFunction)(void (*)(void))native_all_reduce_call,
     METH_FASTCALL,
     "native_all_reduce_call(capsule, data): one call of a communicator's native all-reduce "
     "(native_all_reduce.h) on the tensor at data, without the GIL; None, or its failure "
     "(message, timed_out)"},
    {"quantized_linear_available", quantized_linear_available, METH_NOARGS,
     "whether this CPU runs blocked_linear on weights held in quantization blocks (AVX-512 "
     "F, BW and VL, or AVX2 with FMA and F16C)"},
    {"int8_dot_available", int8_dot_available, METH_NOARGS,
     "whether this CPU multiplies int8 codes in integers (AVX-512 VNNI): a greedy screen held "
     "as WEIGHT_Q8_CODES_F16"},
    {"blocked_linear_available", blocked_linear_available, METH_NOARGS,
     "whether this CPU runs blocked_linear (AVX-512 F, BW and VL, or AVX2 and FMA)"},
    {"linear_isa", (PyCFunction)(void (*)(void))linear_isa, METH_FASTCALL,
     "linear_isa(rows, kind): 'avx512' or 'avx2', the kernels that multiply that many rows "
     "by a blocked weight held as kind (WEIGHT_FLOAT32, _BFLOAT16 or a file's blocks, not "
     "codes) here (KERNELS_CHOSEN); None where blocked_linear does not run"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "Per-layer decode operations in C on raw float32 or bfloat16 addresses (use "
    "shardline.layers.kernels).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    PyObject *result = PyModule_Create(&module);
    if (result != NULL &&
        (PyModule_AddIntConstant(result, "LINEAR_BLOCK", LINEAR_BLOCK) < 0 ||
         PyModule_AddIntConstant(result, "LAYER_TABLE_FIELDS", TABLE_FIELDS) < 0 ||
         PyModule_AddIntConstant(result, "QUANT_GROUP", QUANT_GROUP) < 0 ||
         PyModule_AddIntConstant(result, "WEIGHT_FLOAT32", WEIGHT_FLOAT32) < 0 ||
         PyModule_AddIntConstant(result, "KERNELS_CHOSEN", KERNELS_CHOSEN) < 0 ||
         PyModule_AddIntConstant(result, "KERNELS_AVX2", KERNELS_AVX2) < 0 ||
         PyModule_AddIntConstant(result, "KERNELS_AVX512", KERNELS_AVX512) < 0 ||
         PyModule_AddIntConstant(result, "WEIGHT_BFLOAT16", WEIGHT_BFLOAT16) < 0 ||
         PyModule_AddIntConstant(result, "WEIGHT_Q8_0", WEIGHT_Q8_0) < 0 ||
         PyModule_AddIntConstant(result, "WEIGHT_Q4_0", WEIGHT_Q4_0) < 0 ||
         PyModule_AddIntConstant(result, "WEIGHT_Q4_1", WEIGHT_Q4_1) < 0 ||
         PyModule_AddIntConstant(result, "WEIGHT_INT8_SCALED", WEIGHT_INT8_SCALED) < 0 ||
         PyModule_AddIntConstant(result, "WEIGHT_Q4_K", WEIGHT_Q4_K) < 0 ||
         PyModule_AddIntConstant(result, "WEIGHT_Q6_K", WEIGHT_Q6_K) < 0 ||
         PyModule_AddIntConstant(result, "WEIGHT_Q5_K", WEIGHT_Q5_K) < 0 ||
         PyModule_AddIntConstant(result, "WEIGHT_Q4_CODES", WEIGHT_Q4_CODES) < 0 ||
         PyModule_AddIntConstant(result, "WEIGHT_Q4_CODES_F16", WEIGHT_Q4_CODES_F16) < 0 ||
         PyModule_AddIntConstant(result, "WEIGHT_Q8_CODES_F16", WEIGHT_Q8_CODES_F16) < 0 ||
         PyModule_AddIntConstant(result, "WEIGHT_SEGMENTED", WEIGHT_SEGMENTED) < 0 ||
         PyModule_AddIntConstant(result, "SEGMENTS_MAX", SEGMENTS_MAX) < 0 ||
         PyModule_AddIntConstant(result, "SEGMENT_TABLE_BYTES", sizeof(SegmentTable)) < 0))
        Py_CLEAR(result);
    return result;
}
