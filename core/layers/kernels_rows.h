/* The kernels of kernels.c for one element type, included once per type with:
 *   ELEM           the tensors' element type (float; uint16_t holding bfloat16),
 *   NAME(base)     the function's name for this type,
 *   LOAD(p, i)     element i of p as a float,
 *   STORE(p, i, v) float v stored as element i of p (rounded to the type),
 *   ROUND(v)       float v rounded to the type's precision and back.
 * Arithmetic is in float32; results are rounded where torch's path for the type rounds. */

/* sum of a[i] * LOAD(b, i), a in float32: lanes of independent partial sums, which vectorize. */
static inline float NAME(dot)(const float *a, const ELEM *b, long n) {
    float lanes[LANES] = {0};
    long i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) lanes[j] += a[i + j] * LOAD(b, i + j);
    float sum = 0.0f;
    for (int j = 0; j < LANES; j++) sum += lanes[j];
    for (; i < n; i++) sum += a[i] * LOAD(b, i);
    return sum;
}

/* out = weight * (x / rms(x)) per row; with residual, residual_out = x + residual first and
 * the norm is of that sum. row: room for one row in float32. */
WIDEST_CPU static void NAME(rms_norm_rows)(const ELEM *x, const ELEM *residual,
                                           const ELEM *weight, ELEM *out, ELEM *residual_out,
                                           long rows, long hidden, float eps, float *row) {
    for (long r = 0; r < rows; r++) {
        const ELEM *source = x + r * hidden;
        if (residual != NULL) {
            const ELEM *add = residual + r * hidden;
            ELEM *sum = residual_out + r * hidden;
            for (long i = 0; i < hidden; i++) STORE(sum, i, LOAD(source, i) + LOAD(add, i));
            source = sum;
        }
        for (long i = 0; i < hidden; i++) row[i] = LOAD(source, i);
        float inv = 1.0f / sqrtf(dot_f32(row, row, hidden) / (float)hidden + eps);
        ELEM *dst = out + r * hidden;
        for (long i = 0; i < hidden; i++) STORE(dst, i, LOAD(weight, i) * ROUND(row[i] * inv));
    }
}

/* qkv rows [rows, (q_heads + 2 kv_heads) d]: queries and keys rotated ("rotate half" form,
 * cos/sin [rows, d], float32), queries to q_out [rows, q_heads, d], keys and values to their
 * cache slots ([slots, kv_heads, d] each). */
WIDEST_CPU static void NAME(rope_store_rows)(const ELEM *qkv, long rows, long q_heads,
                                             long kv_heads, long d, const float *cos,
                                             const float *sin, ELEM *q_out, ELEM *key_cache,
                                             ELEM *value_cache, const int64_t *slots) {
    long half = d / 2, width = (q_heads + 2 * kv_heads) * d;
    for (long r = 0; r < rows; r++) {
        const ELEM *row = qkv + r * width;
        const float *c = cos + r * d, *s = sin + r * d;
        for (long h = 0; h < q_heads + kv_heads; h++) {
            const ELEM *x = row + h * d;
            ELEM *dst = h < q_heads ? q_out + (r * q_heads + h) * d
                                    : key_cache + (slots[r] * kv_heads + h - q_heads) * d;
            for (long i = 0; i < half; i++) {
                float front = LOAD(x, i) * c[i], turned = -LOAD(x, i + half) * s[i];
                STORE(dst, i, front + turned);
            }
            for (long i = 0; i < half; i++) {
                float back = LOAD(x, i + half) * c[i + half], turned = LOAD(x, i) * s[i + half];
                STORE(dst, i + half, back + turned);
            }
        }
        memcpy(value_cache + slots[r] * kv_heads * d, row + (q_heads + kv_heads) * d,
               (size_t)(kv_heads * d) * sizeof(ELEM));
    }
}

/* One query token per sequence: out[b, h] = softmax(scale q[b, h] . K) V over the first
 * lengths[b] cached tokens of sequence b (its blocks: blocks[b * per_seq ...]), K and V of
 * KV head kv_index[h]. scores: room for the longest sequence; work: for 2 d floats. */
WIDEST_CPU static void NAME(decode_attention_rows)(
    const ELEM *q, const ELEM *key_cache, const ELEM *value_cache, const int64_t *blocks,
    long per_seq, const int64_t *lengths, long batch, long heads, const int64_t *kv_index,
    long kv_heads, long d, long block_size, float scale, ELEM *out, float *scores,
    float *work) {
    float *query = work, *acc = work + d;
    for (long b = 0; b < batch; b++) {
        const int64_t *table = blocks + b * per_seq;
        long length = (long)lengths[b];
        for (long h = 0; h < heads; h++) {
            const ELEM *source = q + (b * heads + h) * d;
            for (long i = 0; i < d; i++) query[i] = LOAD(source, i);
            long kv = (long)kv_index[h];
            long blocks_used = (length + block_size - 1) / block_size;
            float top = -INFINITY;
            for (long k = 0; k < blocks_used; k++) {
                long first = k * block_size;
                long count = length - first < block_size ? length - first : block_size;
                const ELEM *keys = key_cache + (table[k] * block_size * kv_heads + kv) * d;
                for (long t = 0; t < count; t++) {
                    float score = NAME(dot)(query, keys + t * kv_heads * d, d) * scale;
                    scores[first + t] = score;
                    top = score > top ? score : top;
                }
            }
            for (long t = 0; t < length; t++) scores[t] = exp_approx(scores[t] - top);
            float total = sum_of(scores, length);
            for (long i = 0; i < d; i++) acc[i] = 0.0f;
            for (long k = 0; k < blocks_used; k++) {
                long first = k * block_size;
                long count = length - first < block_size ? length - first : block_size;
                const ELEM *values = value_cache + (table[k] * block_size * kv_heads + kv) * d;
                for (long t = 0; t < count; t++) {
                    const ELEM *value = values + t * kv_heads * d;
                    float weight = scores[first + t];
                    for (long i = 0; i < d; i++) acc[i] += weight * LOAD(value, i);
                }
            }
            float inv = 1.0f / total;
            ELEM *dst = out + (b * heads + h) * d;
            for (long i = 0; i < d; i++) STORE(dst, i, acc[i] * inv);
        }
    }
}

/* gate_up rows [rows, 2 size] = [gate | up]: out [rows, size] = silu(gate) * up. */
WIDEST_CPU static void NAME(silu_mul_rows)(const ELEM *gate_up, ELEM *out, long rows,
                                           long size) {
    for (long r = 0; r < rows; r++) {
        const ELEM *gate = gate_up + r * 2 * size, *up = gate + size;
        ELEM *dst = out + r * size;
        for (long i = 0; i < size; i++) {
            float g = LOAD(gate, i);
            STORE(dst, i, ROUND(g / (1.0f + exp_approx(-g))) * LOAD(up, i));
        }
    }
}
