/* Qwen3-Omni code2wav's residual unit in one native pass over time-major activations x (B, L, C):
 *
 *   y[t] = x[t] + b2 + W2 snake2(b1 + sum_k W1[k] snake1(x[t - (K - 1 - k) d]))     (K = 7)
 *
 * snake1's output taken as zero before t = 0 (the causal convolution's left padding).
 *
 * Why: as torch ops (channels-last oneDNN convolutions around the snake kernel) the unit makes
 * five passes over (B, L, C) and allocates four such tensors; at code2wav's 24 kHz with 16-32
 * channels those passes and their page faults cost more than the convolutions' arithmetic
 * (measured on 2 Zen 3 cores, 8 x 57045 x 16: 42 ms a unit, of which the convolutions 15).
 *
 * Here a task takes TILE steps of one batch row: snake1 of them and of the (K - 1) d steps
 * before into scratch s, the dilated convolution + b1 into scratch h in register tiles
 * (AVX-512: 12 steps x 32 or 16 channels in 16-lane vectors; otherwise 6 steps x 16 channels
 * in 8-lane ones, the same sums in the same order: 1.7x faster where the CPU has 512-bit
 * FMAs), snake2 of h into s, the pointwise convolution + b2 into h, and
 * y = x + h. Each output element is the same operations in the same order
 * wherever its step falls (tile, batch, length): a step's result does not depend on the steps
 * around it beyond what it reads. Channels: a multiple of 16 (the Python side checks). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "snake.h"
#if defined(__AVX__)
#include <immintrin.h>
#endif

#define TILE 240                       /* steps per task (a multiple of ROWS) */
#define COLS 16                        /* output channels per narrow tile: two 8-lane vectors */
#if defined(__AVX512F__) && !defined(OMNISTAGE_NO_AVX512)
#define WIDE 1                         /* 16-lane tiles (wide_tile): twice the FMA width */
#define ROWS 12                        /* steps per register tile */
#else
#define WIDE 0
#define ROWS 6
#endif

#if !WIDE
#include "v8.h"

/* out[r] = bias + sum_k sum_ci in[r + k * tap][ci] * w[k][ci][:] for 6 rows r (row length c
 * in both), columns [cb, cb + COLS). in: row r at in + r * c; tap: the rows between taps. The
 * named accumulators stay in registers (12 of AVX2's 16, with two weight vectors and a
 * broadcast). */
static void tile6(const float *in, int64_t tap, int taps, const float *w, const float *bias,
                  float *out, int64_t c, int64_t cb) {
    v8 a00 = {}, a01 = {}, a10 = {}, a11 = {}, a20 = {}, a21 = {};
    v8 a30 = {}, a31 = {}, a40 = {}, a41 = {}, a50 = {}, a51 = {};
    for (int k = 0; k < taps; k++) {
        const float *x = in + k * tap * c;
        const float *wk = w + (int64_t)k * c * c + cb;
        for (int64_t ci = 0; ci < c; ci++) {
            const v8 w0 = load8(wk + ci * c), w1 = load8(wk + ci * c + 8);
            v8 b;
            b = bcast8(x + ci);         a00 += b * w0; a01 += b * w1;
            b = bcast8(x + c + ci);     a10 += b * w0; a11 += b * w1;
            b = bcast8(x + 2 * c + ci); a20 += b * w0; a21 += b * w1;
            b = bcast8(x + 3 * c + ci); a30 += b * w0; a31 += b * w1;
            b = bcast8(x + 4 * c + ci); a40 += b * w0; a41 += b * w1;
            b = bcast8(x + 5 * c + ci); a50 += b * w0; a51 += b * w1;
        }
    }
    const v8 b0 = bias != NULL ? load8(bias + cb) : (v8){}, b1 = bias != NULL ? load8(bias + cb + 8) : (v8){};
    float *o = out + cb;
    store8(o, a00 + b0);         store8(o + 8, a01 + b1);
    store8(o + c, a10 + b0);     store8(o + c + 8, a11 + b1);
    store8(o + 2 * c, a20 + b0); store8(o + 2 * c + 8, a21 + b1);
    store8(o + 3 * c, a30 + b0); store8(o + 3 * c + 8, a31 + b1);
    store8(o + 4 * c, a40 + b0); store8(o + 4 * c + 8, a41 + b1);
    store8(o + 5 * c, a50 + b0); store8(o + 5 * c + 8, a51 + b1);
}
#endif

#if WIDE
/* tile6's sums for 12 rows and V 16-lane vectors of columns from cb (V = 1 or 2): the same
 * products added in the same order per output, so the same bits as tile6 gives. 12 x 2
 * accumulators, two weight vectors and the broadcast operand fit AVX-512's 32 registers; each
 * weight vector serves 12 FMAs and each broadcast V. */
static inline __attribute__((always_inline)) void wide_tile(const float *in, int64_t tap, int taps,
                                                            const float *w, const float *bias,
                                                            float *out, int64_t c, int64_t cb, int V) {
    vf acc[ROWS][2];
    for (int r = 0; r < ROWS; r++)
        acc[r][0] = acc[r][1] = (vf){};
    for (int k = 0; k < taps; k++) {
        const float *x = in + k * tap * c;
        const float *wk = w + (int64_t)k * c * c + cb;
        for (int64_t ci = 0; ci < c; ci++) {
            const vf w0 = load(wk + ci * c), w1 = V == 2 ? load(wk + ci * c + LANES) : (vf){};
            for (int r = 0; r < ROWS; r++) {
                const vf b = (vf)_mm512_set1_ps(x[r * c + ci]);   /* a broadcast operand */
                acc[r][0] += b * w0;
                if (V == 2)
                    acc[r][1] += b * w1;
            }
        }
    }
    for (int v = 0; v < V; v++) {
        const vf bv = bias != NULL ? load(bias + cb + v * LANES) : (vf){};
        for (int r = 0; r < ROWS; r++)
            store(out + r * c + cb + v * LANES, acc[r][v] + bv);
    }
}
#endif

/* rows x c outputs (rows a multiple of ROWS) of the taps' convolution over in (see tile6, wide_tile). */
static void conv(const float *in, int64_t tap, int taps, const float *w, const float *bias,
                 float *out, int64_t rows, int64_t c) {
    for (int64_t r = 0; r < rows; r += ROWS) {
#if WIDE
        int64_t cb = 0;
        for (; cb + 2 * LANES <= c; cb += 2 * LANES)
            wide_tile(in + r * c, tap, taps, w, bias, out + r * c, c, cb, 2);
        if (cb < c)                    /* c % 32 == 16 */
            wide_tile(in + r * c, tap, taps, w, bias, out + r * c, c, cb, 1);
#else
        for (int64_t cb = 0; cb < c; cb += COLS)
            tile6(in + r * c, tap, taps, w, bias, out + r * c, c, cb);
#endif
    }
}

/* One step's c channels: dst = SnakeBeta(src) (not overlapping); exact: lanes out of the
 * polynomial's range through libm, else they are ORed into *bad (and must be redone). */
static inline __attribute__((always_inline)) void snake_step(const float *src, float *dst, int64_t c,
                                                            const float *f, const float *m,
                                                            lane_flags *bad, int exact) {
    for (int64_t i = 0; i < c; i += LANES) {       /* if, not one ternary: see aa_snake.c */
        if (exact)
            store(dst + i, snake_exact(load(src + i), load(f + i), load(m + i)));
        else
            store(dst + i, snake_fast(load(src + i), load(f + i), load(m + i), bad));
    }
}

/* dst rows [0, rows) = SnakeBeta of the steps t0 - lead + r of batch row xb (zeros outside
 * [0, length): a causal convolution's padding; snake(0) = 0 anyway). */
static void snake_steps(const float *xb, int64_t stride_t, int64_t t0, int64_t lead, int64_t rows,
                        int64_t length, float *dst, int64_t c, const float *f, const float *m) {
    lane_flags bad = {0};
    for (int pass = 0; pass < 2; pass++) {        /* pass 1 only when pass 0 met such a lane */
        for (int64_t r = 0; r < rows; r++) {
            const int64_t t = t0 - lead + r;
            if (t < 0 || t >= length)
                memset(dst + r * c, 0, (size_t)c * sizeof(float));
            else
                snake_step(xb + t * stride_t, dst + r * c, c, f, m, &bad, pass);
        }
        if (!any_flagged(bad))
            return;
    }
}

/* x (B, L, C) with step (b, t) at x + b * stride_b + t * stride_t, channels unit stride;
 * y: contiguous (B, L, C), not overlapping x. w1: (K, C, C) as [k][in][out]; w2: (C, C) as
 * [in][out]; b1, b2: (C,) or NULL; f1, m1, f2, m2: the two SnakeBetas' exp(alpha) and
 * 1 / (exp(beta) + 1e-9), (C,). Returns 0, or -1 when scratch could not be allocated. */
int code2wav_unit(const float *x, float *y, int64_t batch, int64_t length, int64_t c,
                  int64_t stride_b, int64_t stride_t, const float *w1, const float *b1, int64_t taps,
                  int64_t dilation, const float *w2, const float *b2, const float *f1,
                  const float *m1, const float *f2, const float *m2) {
    const int64_t halo = (taps - 1) * dilation, per_row = (length + TILE - 1) / TILE;
    const int64_t tasks = batch * per_row;
    int failed = 0;
    #pragma omp parallel reduction(|: failed)
    {
        /* s: snake1 of the tile and its halo, then snake2 of h; h: the dilated convolution's
         * output, then the pointwise convolution's. */
        float *s = malloc((size_t)((halo + TILE) * c) * sizeof(float));
        float *h = malloc((size_t)(TILE * c) * sizeof(float));
        failed = s == NULL || h == NULL;
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (failed)
                continue;
            const int64_t b = task / per_row, t0 = (task % per_row) * TILE;
            const int64_t n = length - t0 < TILE ? length - t0 : TILE;
            const int64_t rows = (n + ROWS - 1) / ROWS * ROWS;    /* computed; rows >= n dropped */
            const float *xb = x + b * stride_b;
            snake_steps(xb, stride_t, t0, halo, halo + rows, length, s, c, f1, m1);
            conv(s, dilation, (int)taps, w1, b1, h, rows, c);
            snake_steps(h, c, 0, 0, rows, rows, s, c, f2, m2);
            conv(s, 0, 1, w2, b2, h, rows, c);
            for (int64_t r = 0; r < n; r++) {
                const float *xr = xb + (t0 + r) * stride_t;
                float *yr = y + (b * length + t0 + r) * c;
                for (int64_t i = 0; i < c; i += LANES)
                    store(yr + i, load(xr + i) + load(h + r * c + i));
            }
        }
        free(s);
        free(h);
    }
    return failed ? -1 : 0;
}
