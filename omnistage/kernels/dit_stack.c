/* The token2wav DiT's transformer blocks, all of them, in one native call per evaluation, for
 * the int8 DiT (every frame-row product W8A8) with the native block-window attention.
 *
 * Why: a first chunk's ODE solve is 40 evaluations of 6 blocks over ~240 rows. With the int8
 * products the arithmetic of an evaluation is ~1 ms on two cores, and the Python around the
 * ~30 kernel calls it makes (their wrappers, the modulations, the fused terms' checks) cost
 * ~2.4 ms more, while the second thread waited: measured on the small Qwen2.5-Omni checkpoint
 * (2 threads, Intel Xeon with AMX), a solve of 48 frames 137 ms, of 120 frames 194 ms: 2.5 ms
 * an evaluation that did not grow with the frames. Here the block loop runs in C, calling the
 * same kernels the per-op path calls (linear_w8a8.c, window_attention.c; reached by function
 * pointer) with the same arguments, so the output is the same bits.
 *
 * Per block, for the evaluation's rows (h: (B * T, D), the residual stream):
 *   qkv = W8A8(LayerNorm(h) * (1 + scale_a) + shift_a)      (the norm fused into the product)
 *   o   = window_attention(qkv)                              (RoPE on head 0 as it reads)
 *   h2  = h + gate_a * W8A8(o)                               (the residual fused)
 *   f   = gelu_tanh(W8A8(LayerNorm(h2) * (1 + scale_f) + shift_f))
 *   h   = h2 + gate_f * W8A8(f)
 * The fused residual writes the product where its output goes, then adds the residual read
 * from res: it cannot run in place, so h2 lives in the work space and h is rewritten. */

#include <stdint.h>
#include <string.h>

typedef struct {                      /* linear_w8a8.c's W8A8Fuse */
    const float *norm_w, *norm_b;
    float eps;
    const float *res;
    int64_t ldr;
    const float *gate;
} W8A8Fuse;

typedef void (*w8a8_fn)(const float *x, int64_t ldx, const int8_t *panels, const float *sw,
                        const int32_t *comp, const float *bias, int32_t act, float *y, int64_t ldy,
                        int64_t m, int64_t n, int64_t k, int32_t amx, const W8A8Fuse *fuse);
typedef int (*window_fn)(const float *qkv, float *out, const int64_t *lengths, const float *rope,
                         int64_t batch, int64_t frames, int64_t heads, int64_t back, int64_t ahead,
                         float scale);

typedef struct {                      /* a weight as linear_w8a8 takes it */
    const int8_t *panels;
    const float *sw;
    const int32_t *comp;
    const float *bias;                /* (n,) or NULL */
    int64_t n, k;                     /* out_features, in_features */
} W8;

typedef struct {
    W8 qkv, out, up, down;
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
    w8a8_fn product;
    window_fn attend;
} DiTStack;

static void w8a8(const DiTStack *s, const W8 *w, const float *x, float *y, int64_t rows, int32_t act,
                 const W8A8Fuse *fuse) {
    s->product(x, w->k, w->panels, w->sw, w->comp, w->bias, act, y, w->n, rows, w->n, w->k, s->amx, fuse);
}

/* Floats of work space dit_stack_f32 needs for `rows` rows. */
int64_t dit_stack_work(const DiTStack *s, int64_t rows) {
    int64_t widest = 0;
    for (int64_t l = 0; l < s->num_layers; l++) {
        const DiTLayer *L = s->layers + l;
        widest = L->qkv.n > widest ? L->qkv.n : widest;
        widest = L->up.n > widest ? L->up.n : widest;
    }
    return rows * (s->hidden + s->heads * s->head_dim + widest);
}

/* h: (batch * frames, hidden) float32, the first block's input, replaced by the last block's
 * output; mods: two per layer (attention, feed-forward); lengths (batch,) valid frames per
 * row and rope (batch, frames, head_dim / 2, 2) as window_attention takes them; work: at
 * least dit_stack_work floats. Returns 0, or the attention kernel's error (h undefined). */
int dit_stack_f32(const DiTStack *s, const Mod *mods, float *h, int64_t batch, int64_t frames,
                  const int64_t *lengths, const float *rope, float *work) {
    const int64_t rows = batch * frames, d = s->hidden;
    float *other = work, *o = other + rows * d, *wide = o + rows * s->heads * s->head_dim;
    for (int64_t l = 0; l < s->num_layers; l++) {
        const DiTLayer *L = s->layers + l;
        const Mod *a = mods + 2 * l, *f = a + 1;
        const W8A8Fuse norm_a = {a->norm_w, a->norm_b, s->eps, NULL, 0, NULL};
        w8a8(s, &L->qkv, h, wide, rows, 0, &norm_a);
        const int rc = s->attend(wide, o, lengths, rope, batch, frames, s->heads, L->back, L->ahead,
                                 s->scale);
        if (rc != 0)
            return rc;
        const W8A8Fuse res_a = {NULL, NULL, 0.0f, h, d, a->gate};
        w8a8(s, &L->out, o, other, rows, 0, &res_a);             /* other = h + gate_a * ... */
        const W8A8Fuse norm_f = {f->norm_w, f->norm_b, s->eps, NULL, 0, NULL};
        w8a8(s, &L->up, other, wide, rows, 1, &norm_f);
        const W8A8Fuse res_f = {NULL, NULL, 0.0f, other, d, f->gate};
        w8a8(s, &L->down, wide, h, rows, 0, &res_f);             /* h = other + gate_f * ... */
    }
    return 0;
}
