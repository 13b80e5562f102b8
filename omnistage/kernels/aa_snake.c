/* BigVGAN's anti-aliased SnakeBeta in one pass over time-major activations (B, L, C), float32:
 * upsample x2 (replicate-padded polyphase transposed FIR, gain 2), SnakeBeta, low-pass FIR and
 * downsample x2 (replicate-padded), with the same `taps`-tap filter both ways (taps even, >= 4).
 *
 * torch runs it as two concatenations (the paddings), a depthwise transposed convolution (a slow
 * generic path), a multiply, the activation and a depthwise convolution, each over the 2x
 * upsampled signal: on the small Qwen2.5-Omni checkpoint ~60% of the vocoder's time. Here a task
 * takes T output steps of one batch row: it copies the input rows it reads (edges replicated),
 * computes the two phases of the upsampled, activated signal (se = s[2i], so = s[2i + 1]) into
 * scratch that stays in cache, and filters them into the output.
 *
 * The index algebra (K taps, h the filter; u the upsampled signal, s = snake(u)):
 *   u[i] = 2 sum_{j : i + cu - j even} h[j] x[clamp((i + cu - j) / 2 - pu)]    cu = 3K/2 - 3, pu = K/2 - 1
 *   y[t] = sum_j h[j] s[clamp(2t + j - pd)]                                      pd = K/2 - 1
 * so each phase of u is a FIR over rows of x at fixed row offsets, and y a FIR over rows of se
 * and so: in the contiguous (rows, C) layout, a row offset is a constant shift of the flat
 * index, and every product runs on 16 consecutive floats whatever C is (C = 3 wastes no lane).
 * Clamping s (not u) at the ends: rows of se/so before the signal hold s[0], after it s[2L-1]. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "snake.h"
#include "v8.h"

#define MAX_TAPS 64

typedef struct {
    int n;
    float w[MAX_TAPS];
    int off[MAX_TAPS];          /* row offset */
} taps_t;

static void add_tap(taps_t *t, float w, int off) {
    t->w[t->n] = w;
    t->off[t->n++] = off;
}

static int min_off(const taps_t *a, const taps_t *b) {
    int m = a->off[0];
    for (int i = 0; i < a->n; i++) m = a->off[i] < m ? a->off[i] : m;
    for (int i = 0; i < b->n; i++) m = b->off[i] < m ? b->off[i] : m;
    return m;
}

static int max_off(const taps_t *a, const taps_t *b) {
    int m = a->off[0];
    for (int i = 0; i < a->n; i++) m = a->off[i] > m ? a->off[i] : m;
    for (int i = 0; i < b->n; i++) m = b->off[i] > m ? b->off[i] : m;
    return m;
}

/* sum_k w[k] src[shift[k] + i] for lanes i = 0..15, taps in order from zero. */
static inline __attribute__((always_inline)) vf fir16(const float *src, const taps_t *t, const int64_t *shift) {
#if defined(__AVX__) && !defined(__AVX512F__)
    /* Two named 8-lane accumulators: a 16-lane one carried through the taps' loop lived on the
     * stack (a store and a reload in every tap's chain: the kernel ran ~10x slower on a Zen 3
     * than its arithmetic allows). The same products in the same order: the same bits. */
    v8 lo = {0}, hi = {0};
    for (int k = 0; k < t->n; k++) {
        const v8 w = bcast8(&t->w[k]);
        lo += w * load8(src + shift[k]);
        hi += w * load8(src + shift[k] + 8);
    }
    vf_halves u;
    u.h[0] = (__m256)lo;
    u.h[1] = (__m256)hi;
    return u.v;
#else
    vf acc = splat(0.0f);
    for (int k = 0; k < t->n; k++)
        acc += splat(t->w[k]) * load(src + shift[k]);
    return acc;
#endif
}

/* dst[f] = snake(sum_k w[k] src[f + shift[k]]) for f in [0, n) (rounded up to 16: buffers have
 * slack), channel of f = (c0 + f) % C through the repeated parameter rows fe, me (C + 16).
 * -> whether a lane left the polynomial's range (exact: through libm instead). */
static int up_phase(const float *src, float *dst, const taps_t *t, const int64_t *shift, int64_t n,
                    const float *fe, const float *me, int64_t channels, int exact) {
    lane_flags bad = {0};
    int64_t c = 0;
    for (int64_t f = 0; f < n; f += LANES) {
        const vf acc = fir16(src + f, t, shift);
        const vf fv = load(fe + c), mv = load(me + c);
        /* not one ternary store: with both formulas in one expression the loop ran 2x slower
         * under AVX2 (the exact path's libm calls kept its vectors on the stack) */
        if (exact)
            store(dst + f, snake_exact(acc, fv, mv));
        else
            store(dst + f, snake_fast(acc, fv, mv, &bad));
        c += LANES;
        while (c >= channels) c -= channels;
    }
    return any_flagged(bad);
}

typedef struct {
    const float *x;
    float *y;
    int64_t length, channels, stride_b, stride_t;
    taps_t ue, uo, de, dq;       /* up even/odd phase (x rows), down from se / so (rows) */
    int s_lo, s_hi, x_lo, x_hi;  /* row offsets: se/so rows [t0 + s_lo, t1 + s_hi), x likewise */
    const float *fe, *me;
} plan_t;

/* Output rows [t0, t1) of batch row b; scratch: xt, se, so sized by the caller. */
static void tile(const plan_t *p, int64_t b, int64_t t0, int64_t t1, float *xt, float *se, float *so) {
    const int64_t C = p->channels, L = p->length;
    const int64_t s0 = t0 + p->s_lo, s1 = t1 + p->s_hi, x0 = s0 + p->x_lo, x1 = s1 - 1 + p->x_hi + 1;
    for (int64_t r = x0; r < x1; r++) {            /* replicate padding of x */
        const int64_t src = r < 0 ? 0 : (r >= L ? L - 1 : r);
        memcpy(xt + (r - x0) * C, p->x + b * p->stride_b + src * p->stride_t, (size_t)C * sizeof(float));
    }
    int64_t she[MAX_TAPS], sho[MAX_TAPS], sde[MAX_TAPS], sdo[MAX_TAPS];
    for (int k = 0; k < p->ue.n; k++) she[k] = (p->ue.off[k] - p->x_lo) * C;
    for (int k = 0; k < p->uo.n; k++) sho[k] = (p->uo.off[k] - p->x_lo) * C;
    const int64_t n = (s1 - s0) * C;
    if (up_phase(xt, se, &p->ue, she, n, p->fe, p->me, C, 0)
        | up_phase(xt, so, &p->uo, sho, n, p->fe, p->me, C, 0)) {
        up_phase(xt, se, &p->ue, she, n, p->fe, p->me, C, 1);
        up_phase(xt, so, &p->uo, sho, n, p->fe, p->me, C, 1);
    }
    /* replicate padding of s: before the signal s[0] (= se row 0), after it s[2L-1] (= so row L-1) */
    for (int64_t r = s0; r < s1; r++) {
        if (r < 0) {
            memcpy(se + (r - s0) * C, se + (0 - s0) * C, (size_t)C * sizeof(float));
            memcpy(so + (r - s0) * C, se + (0 - s0) * C, (size_t)C * sizeof(float));
        } else if (r >= L) {
            memcpy(se + (r - s0) * C, so + (L - 1 - s0) * C, (size_t)C * sizeof(float));
            memcpy(so + (r - s0) * C, so + (L - 1 - s0) * C, (size_t)C * sizeof(float));
        }
    }
    for (int k = 0; k < p->de.n; k++) sde[k] = (p->de.off[k] - p->s_lo) * C;
    for (int k = 0; k < p->dq.n; k++) sdo[k] = (p->dq.off[k] - p->s_lo) * C;
    float *out = p->y + (b * L + t0) * C;
    const int64_t m = (t1 - t0) * C;
    for (int64_t f = 0; f < m; f += LANES) {
        const vf acc = fir16(se + f, &p->de, sde) + fir16(so + f, &p->dq, sdo);
        if (f + LANES <= m) {
            store(out + f, acc);
        } else {
            float tail[LANES];
            store(tail, acc);
            memcpy(out + f, tail, (size_t)(m - f) * sizeof(float));
        }
    }
}

static void make_taps(plan_t *p, const float *fir, int64_t taps) {
    const int cu = (int)(3 * taps / 2 - 3), pu = (int)(taps / 2 - 1), pd = (int)(taps / 2 - 1);
    p->ue.n = p->uo.n = p->de.n = p->dq.n = 0;
    for (int j = 0; j < taps; j++) {
        if ((cu - j) % 2 == 0)
            add_tap(&p->ue, 2.0f * fir[j], (cu - j) / 2 - pu);
        else
            add_tap(&p->uo, 2.0f * fir[j], (cu + 1 - j) / 2 - pu);
        if ((j - pd) % 2 == 0)
            add_tap(&p->de, fir[j], (j - pd) / 2);
        else
            add_tap(&p->dq, fir[j], (j - pd - 1) / 2);
    }
    p->s_lo = min_off(&p->de, &p->dq);
    p->s_hi = max_off(&p->de, &p->dq);
    p->x_lo = min_off(&p->ue, &p->uo);
    p->x_hi = max_off(&p->ue, &p->uo);
}

/* x (B, L, C): step (b, t) at x + b * stride_b + t * stride_t, its C channels contiguous;
 * y: contiguous (B, L, C); fir (taps,), taps even in [4, MAX_TAPS]; freq, inv_mag (C,).
 * -> 0, or -1 when scratch could not be allocated (y then unwritten). */
int aa_snake_time_major(const float *x, float *y, const float *fir, int64_t taps, const float *freq,
                        const float *inv_mag, int64_t batch, int64_t length, int64_t channels,
                        int64_t stride_b, int64_t stride_t, int64_t rows_per_task) {
    plan_t p = {x, y, length, channels, stride_b, stride_t};
    make_taps(&p, fir, taps);
    float *fe = malloc((size_t)(2 * (channels + LANES)) * sizeof(float));
    if (!fe) return -1;
    float *me = fe + channels + LANES;
    for (int64_t i = 0; i < channels + LANES; i++) {
        fe[i] = freq[i % channels];
        me[i] = inv_mag[i % channels];
    }
    p.fe = fe;
    p.me = me;
    const int64_t T = rows_per_task, per_row = (length + T - 1) / T, tasks = batch * per_row;
    const int64_t s_rows = T + p.s_hi - p.s_lo, x_rows = s_rows + p.x_hi - p.x_lo;
    int failed = 0;
    #pragma omp parallel
    {
        float *xt = calloc((size_t)((x_rows + 1) * channels + 2 * LANES), sizeof(float));
        float *se = calloc((size_t)(2 * (s_rows * channels + 2 * LANES)), sizeof(float));
        if (!xt || !se) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (!xt || !se) continue;
            const int64_t b = task / per_row, t0 = (task % per_row) * T;
            const int64_t t1 = t0 + T < length ? t0 + T : length;
            tile(&p, b, t0, t1, xt, se, se + s_rows * channels + 2 * LANES);
        }
        free(xt);
        free(se);
    }
    free(fe);
    return failed ? -1 : 0;
}
