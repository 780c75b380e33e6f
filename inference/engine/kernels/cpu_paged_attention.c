/* Paged decode attention on CPU, float32, reading K/V in place through the block tables.
 *
 * What and why: inference/engine/kernels/cpu_paged_attention.py (which builds this file with the
 * machine's C compiler and calls it through ctypes). Layout as the Triton kernel's
 * (paged_attention.py): pools [Hkv, num_slots, D] contiguous; token position p of row b lives in
 * slot tables[b * table_stride + p / block_size] * block_size + p % block_size; q and out [B, Hq, D]
 * with any row / head strides and contiguous head dims; query head h reads KV head h / G.
 *
 * Per (row, KV head) pair: the G query heads' scores over the row's tokens (one pass over K),
 * an exact softmax, then one pass over V. The pairs are split over `threads` OpenMP threads. Built
 * with -fopenmp, this library needs libgomp.so.1, which the loader resolves to the copy torch has
 * already loaded: the kernel runs on torch's own OpenMP thread pool (whose threads are still
 * spinning from the step's previous op), not on threads of its own that would compete with them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q;
    int64_t q_stride_b, q_stride_h;
    const float *k, *v;
    int64_t pool_stride_h; /* num_slots * D */
    const int64_t *tables;
    int64_t table_stride;
    const int64_t *lens;
    float *out;
    int64_t out_stride_b, out_stride_h;
    int64_t rows, q_heads, kv_heads, head_dim, block_size;
    float scale;
} decode_args;

/* e^x for x <= 0 (scores minus their maximum), relative error ~1e-7: Cephes' expf polynomial with
 * Cody-Waite range reduction, written out so the loop vectorizes (glibc's vector expf needs -ffast-math,
 * and its scalar one took about half of the kernel's time). */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n, n in [-126, 0] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline __attribute__((always_inline)) float dot(const float *x, const float *y, int64_t n) {
    if (n % 16) {
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < n; i++) acc += x[i] * y[i];
        return acc;
    }
    /* 16 lanes, then halved: the compiler's own lane reduction was a chain of scalar adds that took
     * most of the scores pass (perf) */
    float lanes[16] = {0};
    for (int64_t i = 0; i < n; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] += x[i + l] * y[i + l];
    for (int l = 0; l < 8; l++) lanes[l] += lanes[l + 8];
    for (int l = 0; l < 4; l++) lanes[l] += lanes[l + 4];
    return (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
}

/* A token's K or V row into the cache ahead of its use. A row's blocks lie anywhere in the pool, so the
 * hardware prefetcher, which follows one address stream, stalls at every block boundary; each pass asks
 * for the next block (the V pass's first one, after the K pass) while it works on this one. */
static inline __attribute__((always_inline)) void prefetch_row(const float *row, const int64_t d) {
    for (int64_t c = 0; c < d; c += 16) __builtin_prefetch(row + c, 0, 3); /* 16 floats: one 64-byte line */
}

/* Row b, KV head h: writes the G query heads' outputs. scores [G * len], acc [G * D]. Inlined into
 * attend_d64 / attend_d128 so that their loops over the head dim have a known length (no
 * vectorizer prologue and epilogue per dot product: 1.6x faster at D = 64). */
static inline __attribute__((always_inline)) void attend_d(const decode_args *a, int64_t b, int64_t h, float *scores,
                                                           float *acc, const int64_t d) {
    const int64_t g_count = a->q_heads / a->kv_heads, bs = a->block_size;
    const int64_t len = a->lens[b];
    float *out0 = a->out + b * a->out_stride_b + h * g_count * a->out_stride_h;
    if (len <= 0) { /* defined as zeros, as the Triton kernel */
        for (int64_t g = 0; g < g_count; g++) memset(out0 + g * a->out_stride_h, 0, d * sizeof(float));
        return;
    }
    const float *q0 = a->q + b * a->q_stride_b + h * g_count * a->q_stride_h;
    const float *kh = a->k + h * a->pool_stride_h, *vh = a->v + h * a->pool_stride_h;
    const int64_t *table = a->tables + b * a->table_stride;

    for (int64_t t0 = 0, blk = 0; t0 < len; t0 += bs, blk++) {
        const int64_t n = len - t0 < bs ? len - t0 : bs;
        const float *kb = kh + table[blk] * bs * d;
        /* the next block's rows (another place in the pool) */
        const float *next = t0 + bs < len ? kh + table[blk + 1] * bs * d : vh + table[0] * bs * d;
        for (int64_t i = 0; i < n; i++) {
            prefetch_row(next + i * d, d);
            for (int64_t g = 0; g < g_count; g++)
                scores[g * len + t0 + i] = dot(q0 + g * a->q_stride_h, kb + i * d, d) * a->scale;
        }
    }
    for (int64_t g = 0; g < g_count; g++) {
        float *s = scores + g * len, top = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : top)
        for (int64_t t = 0; t < len; t++) top = s[t] > top ? s[t] : top;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            s[t] = exp_nonpositive(s[t] - top);
            sum += s[t];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    memset(acc, 0, g_count * d * sizeof(float));
    for (int64_t t0 = 0, blk = 0; t0 < len; t0 += bs, blk++) {
        const int64_t n = len - t0 < bs ? len - t0 : bs;
        const float *vb = vh + table[blk] * bs * d;
        if (t0 + bs < len)
            for (int64_t i = 0; i < bs; i++) prefetch_row(vh + table[blk + 1] * bs * d + i * d, d);
        for (int64_t g = 0; g < g_count; g++) { /* the block's V rows stay in L1 across the G heads */
            const float *w = scores + g * len + t0;
            float *ag = acc + g * d;
            for (int64_t i = 0; i < n; i++) {
#pragma omp simd
                for (int64_t j = 0; j < d; j++) ag[j] += w[i] * vb[i * d + j];
            }
        }
    }
    for (int64_t g = 0; g < g_count; g++) memcpy(out0 + g * a->out_stride_h, acc + g * d, d * sizeof(float));
}

static void attend_d64(const decode_args *a, int64_t b, int64_t h, float *s, float *acc) { attend_d(a, b, h, s, acc, 64); }
static void attend_d128(const decode_args *a, int64_t b, int64_t h, float *s, float *acc) { attend_d(a, b, h, s, acc, 128); }
static void attend_any(const decode_args *a, int64_t b, int64_t h, float *s, float *acc) {
    attend_d(a, b, h, s, acc, a->head_dim);
}

/* Returns 0, or 1 when out of memory (the Python side raises). */
int paged_decode_f32(const float *q, int64_t q_stride_b, int64_t q_stride_h, const float *k, const float *v,
                     int64_t pool_stride_h, const int64_t *tables, int64_t table_stride, const int64_t *lens,
                     float *out, int64_t out_stride_b, int64_t out_stride_h, int64_t rows, int64_t q_heads,
                     int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, int threads) {
    const decode_args a = {q, q_stride_b, q_stride_h, k, v, pool_stride_h, tables, table_stride, lens, out,
                           out_stride_b, out_stride_h, rows, q_heads, kv_heads, head_dim, block_size, scale};
    int64_t max_len = 1;
    for (int64_t b = 0; b < rows; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    void (*attend)(const decode_args *, int64_t, int64_t, float *, float *) =
        head_dim == 64 ? attend_d64 : head_dim == 128 ? attend_d128 : attend_any;
    const int64_t g_count = q_heads / kv_heads, pairs = rows * kv_heads;
    int status = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (pairs > 1) reduction(| : status)
    {
        float *scores = malloc(sizeof(float) * g_count * max_len), *acc = malloc(sizeof(float) * g_count * head_dim);
        const int ok = scores && acc;
        status |= !ok;
        /* interleaved: rows arrive sorted by length, so neighbours cost alike */
#pragma omp for schedule(static, 1)
        for (int64_t p = 0; p < pairs; p++)
            if (ok) attend(&a, p / kv_heads, p % kv_heads, scores, acc);
        free(scores);
        free(acc);
    }
    return status;
}
