/* 16-lane float32 vectors and the helpers the kernels share (GCC/Clang vector extensions:
 * -march=native lowers them to whatever vector registers the CPU has). */
#ifndef OMNISTAGE_VEC16_H
#define OMNISTAGE_VEC16_H

#include <stdint.h>

#define LANES 16

/* 16 float lanes; GCC/Clang lower it to whatever vector registers -march=native gives. */
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vf load(const float *p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }

/* Where 16 lanes are two 256-bit registers (AVX/AVX2 without AVX-512), GCC (12) lowers a
 * 16-lane comparison to 16 scalar compares, and a 64-byte store through the stack (the
 * register pair spilled, then copied in 16-byte pieces): a kernel's exp, max or range check
 * then cost several times its arithmetic (SnakeBeta ran slower than torch's four passes).
 * There the comparisons and the store take each half with the 256-bit instruction (the same
 * lanes, so the same bits; comparisons ordered, false for NaN, as C's operators). */
#if defined(__AVX__) && !defined(__AVX512F__)
#include <immintrin.h>
typedef union { vf v; __m256 h[2]; } vf_halves;
typedef union { vi v; __m256 h[2]; } vi_halves;
static inline void store(float *p, vf v) {
    const vf_halves u = {v};
    _mm256_storeu_ps(p, u.h[0]);
    _mm256_storeu_ps(p + 8, u.h[1]);
}
#define VEC16_COMPARE(name, op, predicate)                                                  \
    static inline vi name(vf a, vf b) {                                                     \
        const vf_halves x = {a}, y = {b};                                                   \
        vi_halves r;                                                                        \
        r.h[0] = _mm256_cmp_ps(x.h[0], y.h[0], predicate);                                  \
        r.h[1] = _mm256_cmp_ps(x.h[1], y.h[1], predicate);                                  \
        return r.v;                                                                         \
    }
#else
static inline void store(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
#define VEC16_COMPARE(name, op, predicate) \
    static inline vi name(vf a, vf b) { return a op b; }
#endif
/* Lane masks (all ones where true): a < b, a <= b, a > b, a >= b. */
VEC16_COMPARE(vlt, <, _CMP_LT_OQ)
VEC16_COMPARE(vle, <=, _CMP_LE_OQ)
VEC16_COMPARE(vgt, >, _CMP_GT_OQ)
VEC16_COMPARE(vge, >=, _CMP_GE_OQ)
#undef VEC16_COMPARE

/* bfloat16 is float32's upper half: widening is a shift (exact); narrowing rounds to nearest,
 * ties to even, as torch rounds (bit for bit), and any NaN to a quiet NaN. */
typedef uint16_t vh16 __attribute__((vector_size(LANES * sizeof(uint16_t))));
static inline vf load_bf16(const uint16_t *p) {
    vh16 h; __builtin_memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vi) << 16);
}
static inline float bf16_float(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16; float f; __builtin_memcpy(&f, &u, sizeof f); return f;
}
static inline uint16_t float_bf16(float f) {
    uint32_t u; __builtin_memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));
static inline void store_bf16(uint16_t *p, vf v) {         /* float_bf16 on every lane */
    vu u; __builtin_memcpy(&u, &v, sizeof u);
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
    const vu r = (((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & ~nan) | (0x7fc0u & nan);
    const vh16 h = __builtin_convertvector(r, vh16);
    __builtin_memcpy(p, &h, sizeof h);
}
static inline vf splat(float x) { return (vf){} + x; }
static inline vf vselect(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vf vmax(vf a, vf b) { return vselect(vgt(a, b), a, b); }

/* exp on 16 lanes: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2 (Cephes' expf polynomial).
 * Lanes below -87 (including -inf) give exactly 0. Always inlined: where 16 lanes are two
 * 256-bit registers, GCC (12) left it a call in decoder_stack.c's silu_mul, its 64-byte
 * argument and result passed through memory (the -Wpsabi note), 2.7% of a 32-prompt int8
 * run under AVX2, more than silu_mul itself. */
static inline __attribute__((always_inline)) vf vexp(vf x) {
    const vi keep = vge(x, splat(-87.0f));
    x = (vf)((vi)x & keep);                            /* dropped lanes: 0, kept finite */
    x = vselect(vlt(x, splat(88.0f)), x, splat(88.0f));
    const vf big = splat(12582912.0f);                 /* 1.5 * 2^23: round to nearest */
    const vf n = (x * splat(1.44269504088896341f) + big) - big;
    vf r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)e) & keep);
}


/* Whether any lane of a mask is set (with 256-bit registers one test a half, where the loop
 * over lanes extracts each lane from its register). */
#if defined(__AVX__) && !defined(__AVX512F__)
static inline int any_lane(vi m) {
    const vi_halves u = {m};
    const __m256i a = _mm256_castps_si256(u.h[0]), b = _mm256_castps_si256(u.h[1]);
    return !_mm256_testz_si256(a, a) || !_mm256_testz_si256(b, b);
}
#else
static inline int any_lane(vi m) {
    int32_t acc = 0;
    for (int k = 0; k < LANES; k++) acc |= m[k];
    return acc != 0;
}
#endif

static inline float max_lanes(vf v) {
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* The largest lane, by halves: where no lane is NaN the same value as max_lanes (max is exact
 * in any order), in 4 dependent steps instead of 15. */
static inline float max_tree(vf v) {
    v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

static inline float sum_lanes(vf v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

#endif
