/* SnakeBeta in one pass: y = x + inv_mag[c] * sin(freq[c] * x)^2 over x (B, C, L) or, time-major,
 * (B, L, C), float32.
 *
 * torch spends four passes and two temporaries on it (mul, sin, square, addcmul), and at a
 * vocoder's 24 kHz these are its largest tensors. Here each element is read once and written
 * once; sin^2 comes from a short polynomial: a = j * pi/2 + r with |r| <= pi/4 (Cody-Waite
 * reduction in three parts), sin^2(a) = sin^2(r) for even j and cos^2(r) for odd j (no sign to
 * track), sin and cos of r by Cephes' single-precision polynomials (|error| < 1e-7 on
 * [-pi/4, pi/4]). Lanes with |a| > 8192, where the float reduction loses digits, and
 * non-finite lanes take libm's sinf. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"

#define REDUCE_LIMIT 8192.0f

static inline vf vsin_squared(vf a) {
    const vf big = splat(12582912.0f);                       /* 1.5 * 2^23: round to nearest */
    const vf j = (a * splat(0.636619772367581343f) + big) - big;
    vf r = a - j * splat(1.5703125f);
    r = r - j * splat(4.837512969970703125e-4f);
    r = r - j * splat(7.54978995489188216e-8f);
    const vf z = r * r;
    const vf s = r + r * z * (splat(-1.6666654611e-1f) + z * (splat(8.3321608736e-3f)
                                                             + z * splat(-1.9515295891e-4f)));
    const vf c = splat(1.0f) - splat(0.5f) * z
                 + z * z * (splat(4.166664568298827e-2f) + z * (splat(-1.388731625493765e-3f)
                                                               + z * splat(2.443315711809948e-5f)));
    const vi odd = (__builtin_convertvector(j, vi) & 1) != 0;
    const vf v = vselect(odd, c, s);
    return v * v;
}

static inline int any_lane(vi m) {
    int32_t acc = 0;
    for (int k = 0; k < LANES; k++) acc |= m[k];
    return acc != 0;
}

/* sin^2 of a = v * f for one vector, with the rare lanes out of the reduction's range
 * (large, inf or NaN) through libm. */
static inline vf snake_lanes(vf v, vf f, vf m) {
    const vf a = v * f;
    vf s2 = vsin_squared(a);
    const vi in_range = (a <= splat(REDUCE_LIMIT)) & (a >= splat(-REDUCE_LIMIT));
    if (any_lane(~in_range)) {
        for (int k = 0; k < LANES; k++) {
            if (!in_range[k]) {
                const float t = sinf(a[k]);
                s2[k] = t * t;
            }
        }
    }
    return v + m * s2;
}

/* One row of L samples of one channel: in at x, out at y (both unit stride). */
static void snake_row(const float *x, float *y, float freq, float inv_mag, int64_t n) {
    const vf f = splat(freq), m = splat(inv_mag);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) store(y + i, snake_lanes(load(x + i), f, m));
    if (i < n) {                       /* the tail through the same lanes: one formula */
        float buf[LANES] = {0};
        memcpy(buf, x + i, (size_t)(n - i) * sizeof(float));
        snake_row(buf, buf, freq, inv_mag, LANES);
        memcpy(y + i, buf, (size_t)(n - i) * sizeof(float));
    }
}

/* One time step of C channels: in at x, out at y (both unit stride), channel c's freq[c] and
 * inv_mag[c]. */
static void snake_span(const float *x, float *y, const float *freq, const float *inv_mag, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        store(y + i, snake_lanes(load(x + i), load(freq + i), load(inv_mag + i)));
    if (i < n) {
        float bx[LANES] = {0}, bf[LANES] = {0}, bm[LANES] = {0};
        const size_t tail = (size_t)(n - i) * sizeof(float);
        memcpy(bx, x + i, tail);
        memcpy(bf, freq + i, tail);
        memcpy(bm, inv_mag + i, tail);
        store(bx, snake_lanes(load(bx), load(bf), load(bm)));
        memcpy(y + i, bx, tail);
    }
}

/* x: B x C rows of L samples, row (b, c) at x + b * stride_b + c * stride_c (in floats);
 * y: contiguous (B, C, L); freq, inv_mag: (C,). */
void snake_beta(const float *x, float *y, const float *freq, const float *inv_mag,
                int64_t batch, int64_t channels, int64_t length, int64_t stride_b, int64_t stride_c) {
    const int64_t rows = batch * channels;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t b = r / channels, c = r % channels;
        snake_row(x + b * stride_b + c * stride_c, y + r * length, freq[c], inv_mag[c], length);
    }
}

/* The time-major layout: x (B, L, C) with step (b, t) at x + b * stride_b + t * stride_t and
 * its C channels contiguous; y: contiguous (B, L, C). */
void snake_beta_time_major(const float *x, float *y, const float *freq, const float *inv_mag,
                           int64_t batch, int64_t length, int64_t channels, int64_t stride_b,
                           int64_t stride_t) {
    const int64_t steps = batch * length;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < steps; r++) {
        const int64_t b = r / length, t = r % length;
        snake_span(x + b * stride_b + t * stride_t, y + r * channels, freq, inv_mag, channels);
    }
}
