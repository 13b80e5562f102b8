/* The decoder layers of a dense Qwen2-style model, all of them, in one native call per step.
 *
 * Why: a single-stream decode step of a small model is ~170 tensor ops and kernel calls from
 * Python (two RMSNorms, four linear products, RoPE + cache write, attention, SwiGLU and two
 * residual adds per layer), each costing 2-14 us of dispatch around microseconds of work:
 * measured on the 57M benchmark Qwen2 with int4 weights, 3 ms of a 4.9 ms step were not the
 * weights' products. Here the layer loop runs in C: the products and the attention through
 * the same kernels the Python path calls (linear.c, paged_attention.c, reached by function
 * pointer), the elementwise steps (RMSNorm, SiLU * up, residual adds) written here.
 *
 * Per layer, for the step's T rows (h: (T, hidden) residual stream, updated in place):
 *   x = rmsnorm(h) * w1; qkv = x Wqkv + b; [Qwen3: rmsnorm of each q and k head];
 *   RoPE + K/V into the cache; a = attention(q)
 *   [last layer, when out_rows is given: keep only those rows of a and h, in order]
 *   h += a Wo; x = rmsnorm(h) * w2; g|u = x Wgu; h += (silu(g) * u) Wdown
 * Every step is per row (the attention per sequence), so a row's result does not depend on
 * the rows around it, as with the Python path's ops.
 *
 * Threads: each kernel called opens its own OpenMP region (torch's runtime); the elementwise
 * steps run in one when the rows are many. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "linear_call.h"
#include "vec16.h"

typedef void (*rope_write_fn)(float *qkv, int64_t ld, const float *cos, const float *sin,
                              int64_t cs_stride, const int64_t *slots, void *kv, int64_t tokens,
                              int64_t kv_heads, int64_t num_blocks);
typedef int (*decode_fn)(const float *q, int64_t q_stride, const void *kv, const int64_t *tables,
                         const int64_t *lens, float *out, int64_t batch, int64_t kv_heads,
                         int64_t num_blocks, int64_t width, float scale);
typedef int (*prefill_fn)(const float *q, int64_t q_stride, const void *kv, const int64_t *tables,
                          const int64_t *q_starts, const int64_t *q_lens, const int64_t *ctx_lens,
                          float *out, int64_t chunks, int64_t kv_heads, int64_t num_blocks,
                          int64_t width, float scale);

typedef struct {
    const float *norm1, *norm2;        /* input / post-attention RMSNorm weights (hidden) */
    const float *q_norm, *k_norm;      /* per-head RMSNorm weights (head_dim) applied to every
                                        * query / key head before RoPE (Qwen3), or both NULL */
    void *kv;                          /* the layer's cache (2, Hkv, num_blocks, BLOCK, D), float32
                                        * or bfloat16 as the attention kernels read it */
    Linear qkv, o, gate_up, down;
} Layer;

typedef struct {
    int64_t num_layers, hidden, intermediate, heads, kv_heads, head_dim, num_blocks;
    double eps, scale;
    const Layer *layers;
    const float *final_norm;           /* the model's final RMSNorm weight (hidden), or NULL */
    rope_write_fn rope_write;
    decode_fn decode;
    prefill_fn prefill;
} Stack;

/* One step's rows: decodes first (rows [0, decodes)), then prefill chunks (paged_attention.c's
 * arguments); out_rows: the rows that leave the last layer (ascending), or NULL for all. */
typedef struct {
    int64_t tokens;
    const float *cos, *sin;
    int64_t cs_stride;
    const int64_t *slots;
    int64_t decodes, decode_width;
    const int64_t *decode_tables, *decode_lens;
    int64_t prefills, prefill_width;
    const int64_t *prefill_tables, *prefill_starts, *prefill_lens, *prefill_ctx;
    int64_t out_count;
    const int64_t *out_rows;
} Step;

#define PARALLEL_ELEMENTS 65536        /* elementwise steps smaller than this run on one thread */

static inline float dot_self(const float *x, int64_t n) {
    vf acc = {};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) { const vf v = load(x + i); acc += v * v; }
    float s = sum_lanes(acc);
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

/* y = x / sqrt(mean(x^2) + eps) * w for one row of n (float32 throughout, as the references;
 * y may be x). */
static inline void rmsnorm_row(const float *x, const float *w, float *y, int64_t n, float eps) {
    const float inv = 1.0f / sqrtf(dot_self(x, n) / (float)n + eps);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) store(y + i, load(x + i) * inv * load(w + i));
    for (; i < n; i++) y[i] = x[i] * inv * w[i];
}

/* rmsnorm_row over `rows` rows, in a parallel region when they are many. */
static void rmsnorm(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps) {
    #pragma omp parallel for schedule(static) if (rows * n > PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++)
        rmsnorm_row(x + r * n, w, y + r * n, n, eps);
}

/* act = silu(g) * u for gu rows (g | u halves of 2n), act rows of n. */
static void silu_mul(const float *gu, float *act, int64_t rows, int64_t n) {
    #pragma omp parallel for schedule(static) if (rows * n > PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *a = act + r * n;
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            const vf gv = load(g + i);
            store(a + i, gv / (splat(1.0f) + vexp(-gv)) * load(u + i));
        }
        for (; i < n; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* The query heads, then the key heads, of every qkv row (width ld) normalised in place, each
 * head over its head_dim values (Qwen3's q_norm / k_norm). Row by row, not through rmsnorm:
 * its parallel region, entered (and skipped) twice per row, cost more than the norms (a
 * decode of 8 rows, 3 layers: ~40 us a layer). */
static void head_norms(float *qkv, int64_t ld, int64_t rows, int64_t heads, int64_t kv_heads,
                       int64_t d, const float *qw, const float *kw, float eps) {
    #pragma omp parallel for schedule(static) if (rows * ld > PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * ld;
        for (int64_t h = 0; h < heads + kv_heads; h++)
            rmsnorm_row(row + h * d, h < heads ? qw : kw, row + h * d, d, eps);
    }
}

static void add_rows(float *h, const float *a, int64_t count) {
    #pragma omp parallel for schedule(static) if (count > PARALLEL_ELEMENTS)
    for (int64_t i = 0; i < count; i++) h[i] += a[i];
}

/* Rows out_rows[i] of x (row length n) move to row i; out_rows ascending, so a row never
 * moves onto one still to be read. */
static void keep_rows(float *x, int64_t n, const int64_t *out_rows, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        if (out_rows[i] != i) memmove(x + i * n, x + out_rows[i] * n, (size_t)n * sizeof(float));
}

/* Floats of work space decoder_stack_f32 needs for `tokens` rows. */
int64_t decoder_stack_work(const Stack *s, int64_t tokens) {
    const int64_t qkv = (s->heads + 2 * s->kv_heads) * s->head_dim;
    return tokens * (s->hidden + qkv + s->heads * s->head_dim + 3 * s->intermediate);
}

/* h: (tokens, hidden), the layers' input, replaced by their output (after the final norm,
 * when the stack has one): all rows, or the out_count rows of out_rows in rows [0, out_count). work: at least
 * decoder_stack_work floats. Returns 0, or -1 when an attention kernel could not allocate
 * its scratch (h is then undefined). */
int decoder_stack_f32(const Stack *s, const Step *st, float *h, float *work) {
    const int64_t t = st->tokens, hid = s->hidden, inter = s->intermediate;
    const int64_t qkv_width = (s->heads + 2 * s->kv_heads) * s->head_dim;
    const int64_t att_width = s->heads * s->head_dim;
    float *x = work, *qkv = x + t * hid, *att = qkv + t * qkv_width, *gu = att + t * att_width;
    float *act = gu + t * 2 * inter;
    const float eps = (float)s->eps, scale = (float)s->scale;
    int64_t rows = t;
    for (int64_t l = 0; l < s->num_layers; l++) {
        const Layer *L = s->layers + l;
        rmsnorm(h, L->norm1, x, t, hid, eps);
        product(&L->qkv, x, qkv, t);
        if (L->q_norm != NULL)
            head_norms(qkv, qkv_width, t, s->heads, s->kv_heads, s->head_dim, L->q_norm, L->k_norm, eps);
        s->rope_write(qkv, qkv_width, st->cos, st->sin, st->cs_stride, st->slots, L->kv, t,
                      s->kv_heads, s->num_blocks);
        int rc = 0;
        if (st->decodes)
            rc |= s->decode(qkv, qkv_width, L->kv, st->decode_tables, st->decode_lens, att,
                            st->decodes, s->kv_heads, s->num_blocks, st->decode_width, scale);
        if (st->prefills)
            rc |= s->prefill(qkv, qkv_width, L->kv, st->prefill_tables, st->prefill_starts,
                             st->prefill_lens, st->prefill_ctx, att, st->prefills, s->kv_heads,
                             s->num_blocks, st->prefill_width, scale);
        if (rc != 0)
            return -1;
        if (l == s->num_layers - 1 && st->out_rows != NULL) {   /* only these rows go on */
            keep_rows(att, att_width, st->out_rows, st->out_count);
            keep_rows(h, hid, st->out_rows, st->out_count);
            rows = st->out_count;
        }
        product(&L->o, att, x, rows);
        add_rows(h, x, rows * hid);
        rmsnorm(h, L->norm2, x, rows, hid, eps);
        product(&L->gate_up, x, gu, rows);
        silu_mul(gu, act, rows, inter);
        product(&L->down, act, x, rows);
        add_rows(h, x, rows * hid);
    }
    if (s->final_norm != NULL)
        rmsnorm(h, s->final_norm, h, rows, hid, eps);    /* in place: a row is read, then written */
    return 0;
}

/* ---- the norms alone, for models whose layers run op by op (kernels/norms.py) ------------- */

/* y = rmsnorm(x) * w over `rows` rows of n (x and y contiguous; y may be x). */
void rmsnorm_f32(const float *x, const float *w, float *y, int64_t rows, int64_t n, double eps) {
    rmsnorm(x, w, y, rows, n, (float)eps);
}

/* Qwen3's per-head q and k norms of `rows` qkv rows (width ld), in place (head_norms above). */
void head_norms_f32(float *qkv, int64_t ld, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d,
                    const float *qw, const float *kw, double eps) {
    head_norms(qkv, ld, rows, heads, kv_heads, d, qw, kw, (float)eps);
}
