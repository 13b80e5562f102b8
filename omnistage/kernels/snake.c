/* SnakeBeta in one pass: y = x + inv_mag[c] * sin(freq[c] * x)^2 over x (B, C, L) or, time-major,
 * (B, L, C), float32.
 *
 * torch spends four passes and two temporaries on it (mul, sin, square, addcmul), and at a
 * vocoder's 24 kHz these are its largest tensors. Here each element is read once and written
 * once; sin^2 comes from a short polynomial: a = j * pi/2 + r with |r| <= pi/4 (Cody-Waite
 * reduction in three parts), sin^2(a) = sin^2(r) for even j and cos^2(r) = 1 - sin^2(r) for odd
 * j (no sign to track), sin of r by Cephes' single-precision polynomial (|error| < 1e-7 on
 * [-pi/4, pi/4]). Lanes with |a| > 8192, where the float reduction loses digits, and
 * non-finite lanes take libm's sinf. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"

#define REDUCE_LIMIT 8192.0f

/* Time steps (or samples of a channel-major row) per parallel task: a task's index is split
 * into (batch, step) once, not per step (a 64-bit division per 16 values cost more than the
 * polynomial), and its out-of-range check is reduced once per task. */
#define BLOCK 512

/* sin^2(a) for |a| <= REDUCE_LIMIT: sin^2(r) for even j, cos^2(r) = 1 - sin^2(r) for odd j
 * (one polynomial; cos^2 = 1 - sin^2 is within an ulp of 1 as |r| <= pi/4 keeps sin^2 <= 1/2). */
static inline __attribute__((always_inline)) vf vsin_squared(vf a) {
    const vf big = splat(12582912.0f);                       /* 1.5 * 2^23: round to nearest */
    const vf j = (a * splat(0.636619772367581343f) + big) - big;
    vf r = a - j * splat(1.5703125f);
    r = r - j * splat(4.837512969970703125e-4f);
    r = r - j * splat(7.54978995489188216e-8f);
    const vf z = r * r;
    const vf s = r + r * z * (splat(-1.6666654611e-1f) + z * (splat(8.3321608736e-3f)
                                                             + z * splat(-1.9515295891e-4f)));
    const vf s2 = s * s;
    const vi odd = (__builtin_convertvector(j, vi) << 31) >> 31;   /* all ones for odd j */
    return vselect(odd, splat(1.0f) - s2, s2);
}

static inline int any_lane(vi m) {
    int32_t acc = 0;
    for (int k = 0; k < LANES; k++) acc |= m[k];
    return acc != 0;
}

/* Lanes the polynomial cannot take: |a| > REDUCE_LIMIT (the float reduction loses digits),
 * inf or NaN (every comparison with NaN is false). */
static inline vi out_of_range(vf a) {
    return ~(vle(a, splat(REDUCE_LIMIT)) & vge(a, splat(-REDUCE_LIMIT)));
}

/* v + m * sin^2(v * f) by the polynomial; lanes out of its range are ORed into *bad (their
 * values here are wrong, and the caller redoes them). */
static inline __attribute__((always_inline)) vf snake_fast(vf v, vf f, vf m, vi *bad) {
    const vf a = v * f;
    *bad |= out_of_range(a);
    return v + m * vsin_squared(a);
}

/* The same with the out-of-range lanes through libm: the slow path, for a task that had one. */
static inline vf snake_exact(vf v, vf f, vf m) {
    const vf a = v * f;
    vf s2 = vsin_squared(a);
    const vi bad = out_of_range(a);
    if (any_lane(bad)) {
        for (int k = 0; k < LANES; k++) {
            if (bad[k]) {
                const float t = sinf(a[k]);
                s2[k] = t * t;
            }
        }
    }
    return v + m * s2;
}

/* n values at x -> y (both unit stride) with per-value parameters f[i], m[i] (f_step 1) or one
 * pair for all (f_step 0); exact: out-of-range lanes through libm. -> whether the fast path
 * met such a lane (then nothing it wrote may be kept). */
static inline __attribute__((always_inline)) int snake_span(const float *x, float *y, const float *f, const float *m, int64_t n,
                      int64_t f_step, int exact) {
    vi bad = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vf vf_ = f_step ? load(f + i) : splat(*f), vm = f_step ? load(m + i) : splat(*m);
        store(y + i, exact ? snake_exact(load(x + i), vf_, vm) : snake_fast(load(x + i), vf_, vm, &bad));
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
    return any_lane(bad);
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
