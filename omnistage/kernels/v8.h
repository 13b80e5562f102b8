/* 8-lane float32 vectors (one AVX2 register) for the register tiles of CPUs without AVX-512:
 * accumulators named one by one stay in registers, where an array of 16-lane vectors indexed
 * in loops was lowered through the stack (see conv1d_tm.c's tile6). */
#ifndef OMNISTAGE_V8_H
#define OMNISTAGE_V8_H

#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(8 * sizeof(float))));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
/* *p in every lane, by the broadcast instruction: `(v8){} + *p` keeps an add and a zero
 * register (adding +0.0 is not a no-op to the compiler), one register too many for a tile of
 * 12 accumulators, two weight vectors and a broadcast. */
static inline v8 bcast8(const float *p) {
#if defined(__AVX__)
    return (v8)_mm256_broadcast_ss(p);
#else
    return (v8){} + *p;
#endif
}

#endif
