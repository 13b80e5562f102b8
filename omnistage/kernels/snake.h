/* SnakeBeta's arithmetic on 16-lane vectors, shared by the kernels that apply it (snake.c,
 * code2wav_unit.c): v + m * sin^2(v * f), sin^2 from a short polynomial: a = j * pi/2 + r with
 * |r| <= pi/4 (Cody-Waite reduction in three parts), sin^2(a) = sin^2(r) for even j and
 * cos^2(r) = 1 - sin^2(r) for odd j (no sign to track), sin of r by Cephes' single-precision
 * polynomial (|error| < 1e-7 on [-pi/4, pi/4]). Lanes with |a| > 8192, where the float
 * reduction loses digits, and non-finite lanes are flagged for libm's sinf (snake_exact). */
#ifndef OMNISTAGE_SNAKE_H
#define OMNISTAGE_SNAKE_H

#include <math.h>

#include "vec16.h"

#define REDUCE_LIMIT 8192.0f


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

/* Lanes the polynomial cannot take: |a| > REDUCE_LIMIT (the float reduction loses digits),
 * inf or NaN (every comparison with NaN is false). */
static inline vi out_of_range(vf a) {
    return ~(vle(a, splat(REDUCE_LIMIT)) & vge(a, splat(-REDUCE_LIMIT)));
}

/* Whether any lane met so far was out of the polynomial's range: a callers' loop carries it
 * (start it at {0}; any_flagged at the end). Where 16 lanes are two 256-bit registers, a mask
 * carried through a loop lived on the stack (a store and a reload a vector; BigVGAN's
 * anti-aliased activations ~1.6x slower on a Zen 3): there each vector's lanes are tested
 * where they are made and an int carried; with AVX-512 the mask is one register. */
#if defined(__AVX__) && !defined(__AVX512F__)
typedef int lane_flags;
static inline void flag_lanes(lane_flags *flags, vi m) { *flags |= any_lane(m); }
static inline int any_flagged(lane_flags flags) { return flags; }
#else
typedef vi lane_flags;
static inline void flag_lanes(lane_flags *flags, vi m) { *flags |= m; }
static inline int any_flagged(lane_flags flags) { return any_lane(flags); }
#endif

/* v + m * sin^2(v * f) by the polynomial; lanes out of its range are flagged in *bad (their
 * values here are wrong, and the caller redoes them). */
static inline __attribute__((always_inline)) vf snake_fast(vf v, vf f, vf m, lane_flags *bad) {
    const vf a = v * f;
    flag_lanes(bad, out_of_range(a));
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

#endif
