/* The token2wav DiT's transformer blocks, all of them, in one native call per evaluation:
 * every frame-row product int8 (linear_w8a8.c) or float32 (linear.c), the block-window
 * attention native (window_attention.c), all reached by function pointer.
 *
 * Why: a first chunk's ODE solve is 40 evaluations of 6 blocks over ~240 rows. Per block the
 * per-op path makes ~5 kernel calls and a dozen torch ops from Python, ~2.4 ms an evaluation
 * on the small Qwen2.5-Omni checkpoint that did not grow with the rows (2 threads, Intel Xeon
 * with AMX: the int8 DiT's solve of 48 frames 137 ms, of 120 frames 194 ms), while the second
 * thread waited. Here the block loop runs in C.
 *
 * Per block, for the evaluation's rows (h: (B * T, D), the residual stream):
 *   qkv = P(LayerNorm(h) * (1 + scale_a) + shift_a)
 *   o   = window_attention(qkv)                              (RoPE on head 0 as it reads)
 *   h2  = h + gate_a * P(o)
 *   f   = gelu_tanh(P(LayerNorm(h2) * (1 + scale_f) + shift_f))
 *   h   = h2 + gate_f * P(f)
 * An int8 product P takes the norm, the GELU and the gated residual in its own passes
 * (W8A8Fuse), with the arguments the per-op path gives it: the same bits. Two int8 products
 * of the feed-forward run as one call (linear_w8a8_ffn: row blocks through both, the same
 * bits as the two calls). Around a float32
 * product they run here (norm_rows, gelu_rows, gate_rows), each row on its own as torch's
 * ops (the same functions; rounding may differ in the last bits). The gated residual writes
 * the product where its output goes, then adds the residual read from res: it cannot run in
 * place, so h2 lives in the work space and h is rewritten. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "linear_call.h"
#include "linear_w8a8.h"
#include "vec16.h"

typedef int (*window_fn)(const float *qkv, float *out, const int64_t *lengths, const float *rope,
                         int64_t batch, int64_t frames, int64_t heads, int64_t back, int64_t ahead,
                         float scale);

typedef struct {                      /* a weight as linear_w8a8 takes it */
    const int8_t *panels;
    const float *sw;
    const int32_t *comp;
    const float *bias;                /* (n,) or NULL */
} W8;

typedef struct {
    int32_t int8;                     /* 1: w8 through linear_w8a8; 0: lin (float32, linear.c) */
    W8 w8;
    Linear lin;                       /* n, k: out_features, in_features (of either kind) */
} DiTProduct;

typedef struct {
    DiTProduct qkv, out, up, down;
    int64_t back, ahead;              /* the attention's window, in blocks */
} DiTLayer;

typedef struct {                      /* half a block's modulation at one time t */
    const float *norm_w, *norm_b;     /* (D,) 1 + scale, shift */
    const float *gate;                /* (D,) */
} Mod;

typedef struct {
    int64_t num_layers, hidden, heads, head_dim;
    float eps, scale;                 /* the norms' epsilon; the attention's 1 / sqrt(head_dim) */
    int32_t amx;                      /* linear_w8a8's amx argument */
    const DiTLayer *layers;
    w8a8_fn w8a8;                     /* NULL where no product is int8 */
    w8a8_ffn_fn w8a8_ffn;             /* linear_w8a8_ffn (with w8a8) */
    window_fn attend;
} DiTStack;

#define PARALLEL_ELEMENTS 16384       /* elementwise passes smaller than this run on one thread */

/* dst (rows, k) = LayerNorm(src) * w + b, row by row: the mean, then the mean of squared
 * deviations (two passes, as torch's CPU layer_norm), rstd = 1 / sqrt(var + eps). */
static void norm_rows(const float *src, int64_t rows, int64_t k, const float *w, const float *b,
                      float eps, float *dst) {
    #pragma omp parallel for schedule(static) if (rows * k > PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = src + r * k;
        float *y = dst + r * k;
        vf acc = {};
        int64_t i = 0;
        for (; i + LANES <= k; i += LANES) acc += load(x + i);
        float sum = sum_lanes(acc);
        for (; i < k; i++) sum += x[i];
        const float mean = sum / (float)k;
        acc = (vf){};
        for (i = 0; i + LANES <= k; i += LANES) { const vf v = load(x + i) - mean; acc += v * v; }
        float sq = sum_lanes(acc);
        for (; i < k; i++) sq += (x[i] - mean) * (x[i] - mean);
        const float rstd = 1.0f / sqrtf(sq / (float)k + eps);
        for (i = 0; i + LANES <= k; i += LANES)
            store(y + i, (load(x + i) - mean) * rstd * load(w + i) + load(b + i));
        for (; i < k; i++) y[i] = (x[i] - mean) * rstd * w[i] + b[i];
    }
}

/* In place: v = GELU(v), tanh form: 0.5 v (1 + tanh(u)) = v / (1 + exp(-2u)),
 * u = sqrt(2/pi) (v + 0.044715 v^3). */
static void gelu_rows(float *v, int64_t count) {
    const int64_t whole = count / LANES * LANES;
    #pragma omp parallel for schedule(static) if (count > PARALLEL_ELEMENTS)
    for (int64_t i = 0; i < whole; i += LANES) {
        const vf y = load(v + i);
        const vf minus_2u = splat(-1.5957691216057308f) * (y + splat(0.044715f) * y * y * y);
        store(v + i, y / (splat(1.0f) + vexp(minus_2u)));
    }
    for (int64_t i = whole; i < count; i++)
        v[i] = v[i] / (1.0f + expf(-1.5957691216057308f * (v[i] + 0.044715f * v[i] * v[i] * v[i])));
}

/* In place: y (rows, n) = res + gate * y, gate (n,) over every row. */
static void gate_rows(float *y, const float *res, const float *gate, int64_t rows, int64_t n) {
    #pragma omp parallel for schedule(static) if (rows * n > PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < n; c++) y[r * n + c] = fmaf(gate[c], y[r * n + c], res[r * n + c]);
}

/* y (rows, p.n) = [res + gate *] act(p(x, after the norm if norm_w)); scratch: rows * p.k
 * floats for a float32 product's normed input. */
static void run_product(const DiTStack *s, const DiTProduct *p, const float *x, float *y, int64_t rows,
                        int32_t act, const float *norm_w, const float *norm_b, const float *res,
                        const float *gate, float *scratch) {
    const int64_t n = p->lin.n, k = p->lin.k;
    if (p->int8) {
        const W8A8Fuse fuse = {norm_w, norm_b, s->eps, res, n, gate};
        s->w8a8(x, k, p->w8.panels, p->w8.sw, p->w8.comp, p->w8.bias, act, y, n, rows, n, k, s->amx, &fuse);
        return;
    }
    if (norm_w != NULL) {
        norm_rows(x, rows, k, norm_w, norm_b, s->eps, scratch);
        x = scratch;
    }
    product(&p->lin, x, y, rows);
    if (act == 1) gelu_rows(y, rows * n);
    if (res != NULL) gate_rows(y, res, gate, rows, n);
}

/* Floats of work space dit_stack_f32 needs for `rows` rows. */
int64_t dit_stack_work(const DiTStack *s, int64_t rows) {
    int64_t widest = 0;
    for (int64_t l = 0; l < s->num_layers; l++) {
        const DiTLayer *L = s->layers + l;
        widest = L->qkv.lin.n > widest ? L->qkv.lin.n : widest;
        widest = L->up.lin.n > widest ? L->up.lin.n : widest;
    }
    return rows * (2 * s->hidden + s->heads * s->head_dim + widest);
}

/* h: (batch * frames, hidden) float32, the first block's input, replaced by the last block's
 * output; mods: two per layer (attention, feed-forward); lengths (batch,) valid frames per
 * row and rope (batch, frames, head_dim / 2, 2) as window_attention takes them; work: at
 * least dit_stack_work floats. Returns 0, or the attention kernel's error (h undefined). */
int dit_stack_f32(const DiTStack *s, const Mod *mods, float *h, int64_t batch, int64_t frames,
                  const int64_t *lengths, const float *rope, float *work) {
    const int64_t rows = batch * frames, d = s->hidden;
    float *other = work, *normed = other + rows * d, *o = normed + rows * d;
    float *wide = o + rows * s->heads * s->head_dim;
    for (int64_t l = 0; l < s->num_layers; l++) {
        const DiTLayer *L = s->layers + l;
        const Mod *a = mods + 2 * l, *f = a + 1;
        run_product(s, &L->qkv, h, wide, rows, 0, a->norm_w, a->norm_b, NULL, NULL, normed);
        const int rc = s->attend(wide, o, lengths, rope, batch, frames, s->heads, L->back, L->ahead,
                                 s->scale);
        if (rc != 0)
            return rc;
        run_product(s, &L->out, o, other, rows, 0, NULL, NULL, h, a->gate, normed);     /* h2 */
        if (L->up.int8 && L->down.int8 && s->w8a8_ffn != NULL) {    /* both in one call */
            const W8A8Matrix up = {L->up.w8.panels, L->up.w8.sw, L->up.w8.comp, L->up.w8.bias, L->up.lin.n,
                                   L->up.lin.k};
            const W8A8Matrix down = {L->down.w8.panels, L->down.w8.sw, L->down.w8.comp, L->down.w8.bias,
                                     L->down.lin.n, L->down.lin.k};
            const W8A8Fuse before = {f->norm_w, f->norm_b, s->eps, NULL, 0, NULL};
            const W8A8Fuse after = {NULL, NULL, s->eps, other, d, f->gate};
            s->w8a8_ffn(other, d, &up, &down, h, d, rows, s->amx, &before, &after);
        } else {
            run_product(s, &L->up, other, wide, rows, 1, f->norm_w, f->norm_b, NULL, NULL, normed);
            run_product(s, &L->down, wide, h, rows, 0, NULL, NULL, other, f->gate, normed);
        }
    }
    return 0;
}
