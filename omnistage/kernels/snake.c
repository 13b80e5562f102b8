/* SnakeBeta in one pass: y = x + inv_mag[c] * sin(freq[c] * x)^2 over x (B, C, L) or, time-major,
 * (B, L, C), float32.
 *
 * torch spends four passes and two temporaries on it (mul, sin, square, addcmul), and at a
 * vocoder's 24 kHz these are its largest tensors. Here each element is read once and written
 * once, by the polynomial of snake.h. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "snake.h"

/* Time steps (or samples of a channel-major row) per parallel task: a task's index is split
 * into (batch, step) once, not per step (a 64-bit division per 16 values cost more than the
 * polynomial), and its out-of-range check is reduced once per task. */
#define BLOCK 512

/* n values at x -> y (both unit stride) with per-value parameters f[i], m[i] (f_step 1) or one
 * pair for all (f_step 0); exact: out-of-range lanes through libm. -> whether the fast path
 * met such a lane (then nothing it wrote may be kept). */
static inline __attribute__((always_inline)) int snake_span(const float *x, float *y, const float *f,
                                                           const float *m, int64_t n, int64_t f_step,
                                                           int exact) {
    lane_flags bad = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vf vf_ = f_step ? load(f + i) : splat(*f), vm = f_step ? load(m + i) : splat(*m);
        if (exact)                     /* if, not one ternary: see aa_snake.c */
            store(y + i, snake_exact(load(x + i), vf_, vm));
        else
            store(y + i, snake_fast(load(x + i), vf_, vm, &bad));
    }
    if (i < n) {                       /* the tail through the same lanes: one formula */
        float bx[LANES] = {0}, bf[LANES] = {0}, bm[LANES] = {0};
        const int64_t tail = n - i;
        memcpy(bx, x + i, (size_t)tail * sizeof(float));
        for (int64_t k = 0; k < tail; k++) {
            bf[k] = f[f_step * (i + k)];
            bm[k] = m[f_step * (i + k)];
        }
        store(bx, exact ? snake_exact(load(bx), load(bf), load(bm))
                        : snake_fast(load(bx), load(bf), load(bm), &bad));
        memcpy(y + i, bx, (size_t)tail * sizeof(float));
    }
    return any_flagged(bad);
}

/* x: B x C rows of L samples, row (b, c) at x + b * stride_b + c * stride_c (in floats);
 * y: contiguous (B, C, L); freq, inv_mag: (C,). Tasks: BLOCK samples of one row. */
void snake_beta(const float *x, float *y, const float *freq, const float *inv_mag,
                int64_t batch, int64_t channels, int64_t length, int64_t stride_b, int64_t stride_c) {
    const int64_t per_row = (length + BLOCK - 1) / BLOCK, tasks = batch * channels * per_row;
    #pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t r = task / per_row, t0 = (task % per_row) * BLOCK;
        const int64_t b = r / channels, c = r % channels;
        const int64_t n = length - t0 < BLOCK ? length - t0 : BLOCK;
        const float *xr = x + b * stride_b + c * stride_c + t0;
        float *yr = y + r * length + t0;
        if (snake_span(xr, yr, freq + c, inv_mag + c, n, 0, 0))
            snake_span(xr, yr, freq + c, inv_mag + c, n, 0, 1);
    }
}

/* The time-major layout: x (B, L, C) with step (b, t) at x + b * stride_b + t * stride_t and
 * its C channels contiguous; y: contiguous (B, L, C). Tasks: BLOCK steps of one batch row. */
void snake_beta_time_major(const float *x, float *y, const float *freq, const float *inv_mag,
                           int64_t batch, int64_t length, int64_t channels, int64_t stride_b,
                           int64_t stride_t) {
    const int64_t per_row = (length + BLOCK - 1) / BLOCK, tasks = batch * per_row;
    #pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t b = task / per_row, t0 = (task % per_row) * BLOCK;
        const int64_t t1 = length - t0 < BLOCK ? length : t0 + BLOCK;
        int bad = 0;
        for (int64_t t = t0; t < t1; t++)
            bad |= snake_span(x + b * stride_b + t * stride_t, y + (b * length + t) * channels,
                              freq, inv_mag, channels, 1, 0);
        for (int64_t t = t0; bad && t < t1; t++)
            snake_span(x + b * stride_b + t * stride_t, y + (b * length + t) * channels,
                       freq, inv_mag, channels, 1, 1);
    }
}
