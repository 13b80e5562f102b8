/* y = x W^T (+ bias) with float32 activations over weights packed in 64-column panels: the
 * linear layers of our stages on CPU, for one row (a single-stream decode) as for thousands
 * (prefill). Four weight formats share one layout and one tile:
 *   f32   float32
 *   bf16  bfloat16, widened to float32 in registers (a shift or a mask: exact; columns in
 *         pairs, see w_bf16)
 *   i8    int8 with one float32 scale per output column (symmetric, weight-only)
 *   i8g   int8 with one float32 scale per (group of `group` inputs, output column)
 *         (GGUF's q8_0 at group 32: w = q * scale)
 *   i4    4-bit with one float32 scale per (group of `group` inputs, output column)
 *         (symmetric like GGUF's q4_0: w = (u - 8) * scale, u in 0..15)
 *
 * Layout: the (N, K) weight is cut into ceil(N/64) panels of 64 output columns; panel j holds
 * K rows of 64 weights (P[j][k][c] = W[64j + c][k], zero past N). An i4 panel row is 32 bytes:
 * byte c holds column c in its low nibble and column c + 32 in its high one. Scales are per
 * panel too (zero past N): i8 (num_panels, 64), i4 and i8g (num_panels, ceil(K / group), 64).
 * One layout serves both regimes:
 * - one row reads every panel front to back, one sequential stream per thread: a
 *   matrix-vector product at memory speed; narrower weights are fewer bytes to stream;
 * - many rows run a 6 x 64 register tile (24 accumulators) over a panel kept in L2; the
 *   widening / dequantizing of a panel row is paid once for the 6 rows.
 * With 8-lane vectors (AVX2) a 64-column tile of 3 rows does not fit the 16 registers: there
 * many rows run 3-row tiles over half a panel at a time, and 1-2 rows (up to WIDE_MAX_M for
 * weights that stream from memory: decode batches) run 1-2 row tiles over whole panel rows.
 *
 * Batch invariance: every output element is one chain of fused multiply-adds over k = 0..K-1
 * in order (with the weight as dequantized in registers: exact for f32 and bf16, (u - 8) * s
 * rounded once for i4, q * s rounded once for i8g), then * column scale (i8) and + bias in one FMA, whatever the number
 * of rows, the tile it falls in or the threads. A row's result is therefore bit-identical alone
 * or inside any batch, so a request's tokens do not depend on what it is batched with (the build
 * passes -ffp-contract=fast, so `acc += a*b` is one FMA everywhere).
 *
 * Threads: OpenMP over (panel, tile) work items, torch's runtime (see paged_attention.c).
 *
 * int4 and int8 weights against int8-rounded activations (int4k, int8k: integer dot products)
 * live in linear_dots.c, a library of their own with the same entry signature. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear_call.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define PANEL 64                   /* output columns per panel */
/* A tile computes 4 vectors of columns (4 * LANES) for MR rows at most: 4 * MR accumulators
 * plus 4 panel vectors should fit the vector registers. AVX-512: 16 lanes, one tile covers a
 * panel, 6 rows (24 + 4 of 32 registers). Without it (AVX2: 16 registers of 8 lanes): a panel
 * is two column blocks, 3 rows a tile (12 + 4 + the broadcast; measured on 2 Zen cores: 93
 * GFLOP/s, 83 at 2 rows, 85-100% of torch's GEMM; one row 20-40% faster than torch). 16-lane
 * vectors there were split in pairs and spilled: one row at 9 GB/s against torch's 27.
 * OMNISTAGE_NO_AVX512 (defined by the build when asked) takes the narrow path on any CPU, so
 * it is built and tested on machines that have AVX-512 too. */
#if defined(__AVX512F__) && !defined(OMNISTAGE_NO_AVX512)
#define LANES 16
#define MR 6
#else
#define LANES 8
#define MR 3
#endif
#define BLOCK (4 * LANES)          /* columns a tile computes */
#define BLOCKS (PANEL / BLOCK)     /* column blocks per panel: 1 (AVX-512) or 2 */
#define PREFETCH_NEAR 2048         /* bytes the streaming 1-row tile prefetches ahead (L1) */

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef int8_t vb __attribute__((vector_size(LANES)));
typedef uint8_t vub __attribute__((vector_size(LANES)));

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
/* *p in every lane. Not `(vf){} + *p`: adding +0.0 is not a no-op to the compiler (it would
 * turn -0.0 into +0.0), so that form keeps an add and a zero register; in the 3-row AVX2 tile
 * that register was the 17th of 16 and an accumulator spilled to the stack, a store and a
 * load on its FMA chain every k (half the GEMM speed). The sign of a zero x never shows in
 * the results: accumulators start at +0.0 and round-to-nearest never makes -0.0 from +0.0. */
static inline vf bcast(const float *p) {
#if LANES == 16 && defined(__AVX512F__)
    return (vf)_mm512_set1_ps(*p);
#elif LANES == 8 && defined(__AVX__)
    return (vf)_mm256_broadcast_ss(p);
#else
    return (vf){} + *p;
#endif
}
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* The LANES weights of columns c..c+LANES of one panel row, as float32. `s`, `o`: the
 * columns' group scale and -8 * scale (i4 only). */
typedef float f32_t;
typedef uint16_t bf16_t;
typedef int8_t i8_t;
typedef uint8_t i4_t;
typedef int8_t i8g_t;
#define f32_HALVES 0               /* TILE runs half a tile at a time (FMA01) */
#define bf16_HALVES 1
#define i8_HALVES 0
#define i8g_HALVES 0
#define i4_HALVES 0
#define f32_ROW PANEL              /* elements per panel row */
#define bf16_ROW PANEL
#define i8_ROW PANEL
#define i8g_ROW PANEL
#define i4_ROW (PANEL / 2)
static inline vf w_f32(const f32_t *row, int c, vf s, vf o) {
    (void)s; (void)o; return load(row + c);
}
/* bf16 panel rows pair their columns (weight_pack.py): the 32-bit word i of each group of 16
 * columns holds column i in its low half and column 8 + i in its high half. bf16 is float32's
 * upper half, so one 32-byte load widens exactly to both 8-column vectors with one shift and
 * one mask; in column order, a row took a widening load and a shift per 8 weights, and the
 * single-row tile ran 1.5x slower on float32's cached weights than float32 itself (dispatch
 * bound: 33 instructions per 64 weights against float32's 9). c: a multiple of LANES. */
typedef uint32_t vu8 __attribute__((vector_size(8 * sizeof(uint32_t))));
static inline vf w_bf16(const bf16_t *row, int c, vf s, vf o) {
    (void)s; (void)o;
    vu8 u; memcpy(&u, row + (c & ~15), sizeof u);
    const vu8 lo = u << 16, hi = u & 0xffff0000u;     /* columns +0..7, +8..15 of the group */
#if LANES == 8
    vf f; memcpy(&f, (c & 8) ? &hi : &lo, sizeof f); return f;
#else
    const vu w = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    vf f; memcpy(&f, &w, sizeof f); return f;
#endif
}
/* 8-bit lanes widened to int32: GCC 12 converts byte vectors lane by lane (int8 at 16 lanes,
 * uint8 at 8; 4x slower than the weights stream), so x86 says the one instruction it means. */
static inline vi widen_i8(const i8_t *p) {
#if LANES == 16 && defined(__AVX512F__)
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif LANES == 8 && defined(__AVX2__)
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vb q; memcpy(&q, p, sizeof q); return __builtin_convertvector(q, vi);
#endif
}
static inline vf w_i8(const i8_t *row, int c, vf s, vf o) {
    (void)s; (void)o; return __builtin_convertvector(widen_i8(row + c), vf);
}
static inline vf w_i8g(const i8g_t *row, int c, vf s, vf o) {
    (void)o; return __builtin_convertvector(widen_i8(row + c), vf) * s;
}
static inline vi widen_u8(const i4_t *p) {
#if LANES == 16 && defined(__AVX512F__)
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif LANES == 8 && defined(__AVX2__)
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vub q; memcpy(&q, p, sizeof q); return __builtin_convertvector(q, vi);
#endif
}
static inline vf w_i4(const i4_t *row, int c, vf s, vf o) {
    vi q = widen_u8(row + c % 32);
    q = c >= 32 ? q >> 4 : q & 15;
    return __builtin_convertvector(q, vf) * s + o;    /* one FMA: (u - 8) * s rounded once */
}

#define REP1(X) X(0)
#define REP2(X) REP1(X) X(1)
#define REP3(X) REP2(X) X(2)
#define REP4(X) REP3(X) X(3)
#define REP5(X) REP4(X) X(4)
#define REP6(X) REP5(X) X(5)
/* Named accumulators, not an array: compilers keep these in registers (an array of vectors
 * is spilled to the stack, 2.5x slower). */
#define DECL(m) vf c##m##0 = {}, c##m##1 = {}, c##m##2 = {}, c##m##3 = {};
#define FMA(m) { const vf a = bcast(x + (m) * ldx + k); \
    c##m##0 += a * b0; c##m##1 += a * b1; c##m##2 += a * b2; c##m##3 += a * b3; }
/* The same FMAs a half tile at a time (two column vectors, x broadcast again for the other
 * half): for bf16, whose mask constant would be the 17th vector register of the 3-row AVX2
 * tile (an accumulator spilled, its FMA chain through the stack: 0.7x float32's speed). Each
 * accumulator still takes one FMA per k, in order: the same bits. */
#define FMA01(m) { const vf a = bcast(x + (m) * ldx + k); c##m##0 += a * b0; c##m##1 += a * b1; }
#define FMA23(m) { const vf a = bcast(x + (m) * ldx + k); c##m##2 += a * b2; c##m##3 += a * b3; }
#define PUT(m) store(y + (m) * ldy, c##m##0 * e0 + d0); \
    store(y + (m) * ldy + LANES, c##m##1 * e1 + d1); \
    store(y + (m) * ldy + 2 * LANES, c##m##2 * e2 + d2); \
    store(y + (m) * ldy + 3 * LANES, c##m##3 * e3 + d3);
#define LOAD4(v, src, c) v##0 = load((src) + (c)); v##1 = load((src) + (c) + LANES); \
    v##2 = load((src) + (c) + 2 * LANES); v##3 = load((src) + (c) + 3 * LANES);

/* Rows [0..R) x columns [cb..cb+BLOCK) of one panel: y = x . panel, * column scale (cs, or
 * NULL), + bias (or NULL); R rows of x at stride ldx; group scales gs (i4, i8g) or NULL, with
 * groups of G inputs (G = K when there are none). y points at column cb of row 0. PF (a
 * constant): 0 no prefetch; 1 each panel row read also prefetches two lines of the row
 * PREFETCH_NEAR bytes on (into L1); 2 every line of the row pf bytes on (into L2). */
#define TILE(W, R, PF, NAME) \
static void NAME(const float *restrict x, int64_t ldx, const W##_t *restrict p, \
                        int64_t K, int64_t G, const float *restrict gs, const float *restrict cs, \
                        const float *restrict bias, float *restrict y, int64_t ldy, int cb, \
                        int64_t pf) { \
    if (cb % 16 != 0) __builtin_unreachable();  /* w_bf16 picks its half at compile time */ \
    REP##R(DECL) \
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, g++) { \
        vf s0 = {}, s1 = {}, s2 = {}, s3 = {}, o0 = {}, o1 = {}, o2 = {}, o3 = {}; \
        if (gs != NULL) { LOAD4(s, gs + g * PANEL, cb) \
                          o0 = -8.0f * s0; o1 = -8.0f * s1; o2 = -8.0f * s2; o3 = -8.0f * s3; } \
        const int64_t k1 = k0 + G < K ? k0 + G : K; \
        for (int64_t k = k0; k < k1; k++) { \
            const W##_t *row = p + k * W##_ROW; \
            if (PF == 1) { \
                __builtin_prefetch((const char *)row + PREFETCH_NEAR); \
                if (W##_ROW * sizeof(W##_t) > 128) \
                    __builtin_prefetch((const char *)row + PREFETCH_NEAR + 128); \
            } \
            if (PF == 2) for (int b_ = 0; b_ < (int)(W##_ROW * sizeof(W##_t)); b_ += 64) \
                __builtin_prefetch((const char *)row + pf + b_, 0, 2); \
            if (W##_HALVES) { \
                const vf b0 = w_##W(row, cb, s0, o0), b1 = w_##W(row, cb + LANES, s1, o1); \
                REP##R(FMA01) \
                __asm__ volatile("" ::: "memory");  /* x loaded again, not kept in registers */ \
                const vf b2 = w_##W(row, cb + 2 * LANES, s2, o2), \
                         b3 = w_##W(row, cb + 3 * LANES, s3, o3); \
                REP##R(FMA23) \
            } else { \
                const vf b0 = w_##W(row, cb, s0, o0), b1 = w_##W(row, cb + LANES, s1, o1), \
                         b2 = w_##W(row, cb + 2 * LANES, s2, o2), \
                         b3 = w_##W(row, cb + 3 * LANES, s3, o3); \
                REP##R(FMA) \
            } \
        } \
    } \
    vf d0 = {}, d1 = {}, d2 = {}, d3 = {}, e0 = {}, e1 = {}, e2 = {}, e3 = {}; \
    e0 += 1.0f; e1 += 1.0f; e2 += 1.0f; e3 += 1.0f; \
    if (cs != NULL) { LOAD4(e, cs, cb) } \
    if (bias != NULL) { LOAD4(d, bias, cb) } \
    REP##R(PUT) \
}
/* 8-lane builds only: one or two rows over the whole 64-column panel in one pass, 8
 * accumulators a row. The 4-vector tiles above read a panel in two passes of half rows (128
 * of every 256 bytes, then the other 128), a pattern that left 1-2 rows (decode) at 9-12 GB/s
 * on 2 Zen 3 cores whose plain stream gives ~25; one pass over contiguous rows reads at 17-19
 * (measured in C, 3584x512 weights rotated beyond the cache). Per element the same FMA chain
 * over k as the 4-vector tiles, so the same bits. */
#define WCOL(W, v) { const vf b = w_##W(row, (v) * LANES, s##v, o##v); \
    c0##v += a0 * b; if (two) c1##v += a1 * b; }
#define WPUT(m, v) store(y + (m) * ldy + (v) * LANES, c##m##v * e##v + d##v);
#define REP8(X, ...) X(__VA_ARGS__, 0) X(__VA_ARGS__, 1) X(__VA_ARGS__, 2) X(__VA_ARGS__, 3) \
    X(__VA_ARGS__, 4) X(__VA_ARGS__, 5) X(__VA_ARGS__, 6) X(__VA_ARGS__, 7)
#define WDECL(m, v) vf c##m##v = {};
#define WSCALE(src, v) s##v = load((src) + (v) * LANES); o##v = -8.0f * s##v;
#define WLOAD(v, src, c) v = load((src) + (c) * LANES);
#define TILE_WIDE(W, R, PF, NAME) \
static void NAME(const float *restrict x, int64_t ldx, const W##_t *restrict p, \
                        int64_t K, int64_t G, const float *restrict gs, const float *restrict cs, \
                        const float *restrict bias, float *restrict y, int64_t ldy, int64_t pf) { \
    enum { two = R == 2 }; \
    REP8(WDECL, 0) REP8(WDECL, 1) \
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, g++) { \
        vf s0 = {}, s1 = {}, s2 = {}, s3 = {}, s4 = {}, s5 = {}, s6 = {}, s7 = {}; \
        vf o0 = {}, o1 = {}, o2 = {}, o3 = {}, o4 = {}, o5 = {}, o6 = {}, o7 = {}; \
        if (gs != NULL) { REP8(WSCALE, gs + g * PANEL) } \
        const int64_t k1 = k0 + G < K ? k0 + G : K; \
        for (int64_t k = k0; k < k1; k++) { \
            const W##_t *row = p + k * W##_ROW; \
            if (PF) for (int b_ = 0; b_ < (int)(W##_ROW * sizeof(W##_t)); b_ += 64) \
                __builtin_prefetch((const char *)row + pf + b_, 0, 2); \
            const vf a0 = bcast(x + k), a1 = two ? bcast(x + ldx + k) : (vf){}; \
            REP8(WCOL, W) \
        } \
    } \
    vf d0 = {}, d1 = {}, d2 = {}, d3 = {}, d4 = {}, d5 = {}, d6 = {}, d7 = {}; \
    vf e0 = {}, e1 = {}, e2 = {}, e3 = {}, e4 = {}, e5 = {}, e6 = {}, e7 = {}; \
    e0 += 1.0f; e1 += 1.0f; e2 += 1.0f; e3 += 1.0f; e4 += 1.0f; e5 += 1.0f; e6 += 1.0f; e7 += 1.0f; \
    if (cs != NULL) { WLOAD(e0, cs, 0) WLOAD(e1, cs, 1) WLOAD(e2, cs, 2) WLOAD(e3, cs, 3) \
                      WLOAD(e4, cs, 4) WLOAD(e5, cs, 5) WLOAD(e6, cs, 6) WLOAD(e7, cs, 7) } \
    if (bias != NULL) { WLOAD(d0, bias, 0) WLOAD(d1, bias, 1) WLOAD(d2, bias, 2) WLOAD(d3, bias, 3) \
                        WLOAD(d4, bias, 4) WLOAD(d5, bias, 5) WLOAD(d6, bias, 6) WLOAD(d7, bias, 7) } \
    REP8(WPUT, 0) \
    if (two) { REP8(WPUT, 1) } \
}
/* 8-lane builds: one or two rows always run the wide tiles; up to WIDE_MAX_M rows do too (in
 * tiles of 2) when the weights take WIDE_MIN_BYTES or more, taken to stream from memory: the
 * first tile reads the panel once, contiguous, the others from L2. Smaller weights stay in
 * cache, where the 3-row tiles are faster (the 2-row wide tile needs 18 registers: two
 * accumulators live on the stack). Measured on 2 Zen 3 cores (benchmarks.linear_kernel,
 * 4-16 rows): 32000x512 (64 MB) 1.3-1.9x faster wide; 3584x512 (7 MB) 1.1-1.35x; 2048x384
 * and 1536x512 (3 MB) 0.6-0.9x. In a real model every matrix streams from memory. */
#define WIDE_MAX_M 16
#define WIDE_MIN_BYTES (4 << 20)
#if BLOCKS == 2
#define WIDE_TILES(W) TILE_WIDE(W, 1, 0, wide_##W##1) TILE_WIDE(W, 2, 0, wide_##W##2) \
    TILE_WIDE(W, 1, 2, wide_pf_##W##1) TILE_WIDE(W, 2, 2, wide_pf_##W##2)
/* `WIDE(...) statement`: the wide tile for 1-2 rows, else the statement. */
#define WIDE(W, rows, pf, ...) if (rows <= 2) (pf ? (rows == 1 ? wide_pf_##W##1 : wide_pf_##W##2) \
                                                   : (rows == 1 ? wide_##W##1 : wide_##W##2))(__VA_ARGS__, pf); else
#else
#define WIDE_TILES(W)
#define WIDE(W, rows, pf, ...)
#endif

/* The tiles without prefetch (compute-bound batches: an `if (pf)` in the loop of the 8-lane
 * 3-row tile cost its register allocation 27% of a 512-row product), with the far one (every
 * line into L2: TILES_FAR) and, for a decode row alone, the near one it had before (TILES_NEAR;
 * the far kind gave it nothing, past the cache or in the engine). Two rows take the far kind:
 * a mixture-of-experts decode step gives each active expert ~2 rows (float32 past the cache,
 * 2 rows: 1024 x 512 83 -> 69 us, 512 x 512 45 -> 36, 32000 x 512 1.42 -> 1.31 ms). */
#if MR == 6
#define TILE_SET(W, PF, N) TILE(W, 1, PF, N##1) TILE(W, 2, PF, N##2) TILE(W, 3, PF, N##3) \
    TILE(W, 4, PF, N##4) TILE(W, 5, PF, N##5) TILE(W, 6, PF, N##6)
#else
#define TILE_SET(W, PF, N) TILE(W, 1, PF, N##1) TILE(W, 2, PF, N##2) TILE(W, 3, PF, N##3)
#endif
#define TILES_NEAR(W) TILE(W, 1, 1, tile_near_##W##1) \
    static const tile_##W##_fn TILES_NEAR_##W[2] = {NULL, tile_near_##W##1};
#define TILE_FN(W) typedef void (*tile_##W##_fn)(const float *, int64_t, const W##_t *, int64_t, \
    int64_t, const float *, const float *, const float *, float *, int64_t, int, int64_t);
#if MR == 6
#define TILES(W) TILE_FN(W) TILE_SET(W, 0, tile_##W) TILES_NEAR(W) TILE_SET(W, 2, tile_far_##W) \
    static const tile_##W##_fn TILES_FAR_##W[MR + 1] = {NULL, tile_far_##W##1, tile_far_##W##2, \
        tile_far_##W##3, tile_far_##W##4, tile_far_##W##5, tile_far_##W##6}; \
    static const tile_##W##_fn TILES_##W[MR + 1] = {NULL, tile_##W##1, tile_##W##2, tile_##W##3, \
                                                    tile_##W##4, tile_##W##5, tile_##W##6};
#else
#define TILES(W) TILE_FN(W) TILE_SET(W, 0, tile_##W) TILES_NEAR(W) TILE_SET(W, 2, tile_far_##W) \
    WIDE_TILES(W) \
    static const tile_##W##_fn TILES_FAR_##W[MR + 1] = {NULL, tile_far_##W##1, tile_far_##W##2, \
        tile_far_##W##3}; \
    static const tile_##W##_fn TILES_##W[MR + 1] = {NULL, tile_##W##1, tile_##W##2, tile_##W##3};
#endif

/* The GEMM regime of the quantized formats: with DEQUANT_MIN_M rows or more, a thread
 * dequantizes (i8, i8g, i4) a panel once into a float32 copy in its scratch and runs
 * the float32 tiles over it, instead of converting the panel again in every tile of rows (at 32
 * rows and 3-row tiles, 11 times), where the copy fits in L2 (DEQUANT_MAX_BYTES: a copy from
 * L3 ran slower than converting the narrow panel from L2 again). The copy holds each weight exactly as a tile makes it in
 * registers (w_W: the same expression, so the same rounding), the column scales (i8) stay
 * applied after the sum: the same FMA chain per element, so the same bits as the register path
 * that fewer rows take. bf16 takes no copy: widening its paired columns (a shift or a mask per
 * 8 weights) costs less than writing and reading the copy (2 threads, AVX2, K <= 1024: 8-100
 * rows 1.13-1.63x faster without it, as fast as float32 or faster). */
#define f32_DEQUANT 0
#define bf16_DEQUANT 0
#define i8_DEQUANT 1
#define i8g_DEQUANT 1
#define i4_DEQUANT 1
#define DEQUANT_MIN_M 8
#define DEQUANT_MAX_BYTES (256 << 10)   /* the copy stays in L2 beside the rows (K <= 1024) */
#define DEQUANT(W) \
static void dequant_##W(const W##_t *p, int64_t K, int64_t G, const float *gs, float *out) { \
    for (int64_t k0 = 0, g = 0; k0 < K; k0 += G, g++) { \
        vf s[PANEL / LANES], o[PANEL / LANES]; \
        for (int v = 0; v < PANEL / LANES; v++) { \
            s[v] = gs != NULL ? load(gs + g * PANEL + v * LANES) : (vf){}; \
            o[v] = -8.0f * s[v]; \
        } \
        const int64_t k1 = k0 + G < K ? k0 + G : K; \
        for (int64_t k = k0; k < k1; k++) \
            for (int v = 0; v < PANEL / LANES; v++) \
                store(out + k * PANEL + v * LANES, w_##W(p + k * W##_ROW, v * LANES, s[v], o[v])); \
    } \
}

/* x (M, K) rows at stride ldx; panels, group scales (i4, i8g: groups of `group` inputs) and column
 * scales (i8) as above, NULL where the format has none; bias (N) or NULL; y (M, N) rows at
 * stride ldy. Work items panel-major: a thread's consecutive items share a panel, which stays
 * in L2 while the tiles of x stream past it (or its float32 copy, see DEQUANT).
 * Prefetch: each tile of rows is a pass over its panel (pass_prefetch, linear_call.h; a
 * decode row alone keeps its near kind). Without it, a tile of 3-6 rows computed
 * while it waited on memory, the hardware prefetcher alone keeping few lines in flight: 2
 * threads of an Intel Xeon (KVM), float32 weights past the cache, 32000x512 at 4 / 8 rows
 * 3.4 / 4.2 -> 2.0 / 2.9 ms, 1024x512 at 4 / 8 rows 110 / 133 -> 64 / 93 us. The last,
 * partial panel is computed whole into scratch (its padding columns are zeros, its bias
 * padded), then its real columns are kept: the same arithmetic per element as a full panel. */
#define LINEAR(W) TILES(W) DEQUANT(W) \
void linear_##W(const float *x, int64_t ldx, const W##_t *panels, const float *gscales, \
                int64_t group, const float *cscales, const float *bias, float *y, int64_t ldy, \
                int64_t m, int64_t n, int64_t k) { \
    const double bytes = (double)n * (double)k * (double)(W##_ROW * sizeof(W##_t)) / PANEL; \
    const int deq = W##_DEQUANT && m >= DEQUANT_MIN_M && k > 0 \
                    && k * PANEL * (int64_t)sizeof(float) <= DEQUANT_MAX_BYTES; \
    const int mr = !deq && BLOCKS == 2 && (m <= 2 || (m <= WIDE_MAX_M && bytes >= WIDE_MIN_BYTES)) \
                   ? 2 : MR; \
    const int64_t num_panels = (n + PANEL - 1) / PANEL, tiles = (m + mr - 1) / mr; \
    const int64_t G = gscales != NULL ? group : (k > 0 ? k : 1), groups = (k + G - 1) / G; \
    _Pragma("omp parallel") \
    { \
    float *f = deq ? malloc((size_t)k * PANEL * sizeof(float)) : NULL;  /* NULL: registers */ \
    int64_t have = -1;                                                   /* f's panel */ \
    _Pragma("omp for schedule(static)") \
    for (int64_t item = 0; item < num_panels * tiles; item++) { \
        const int64_t j = item / tiles, m0 = item % tiles * mr, n0 = j * PANEL; \
        const int rows = m - m0 < mr ? (int)(m - m0) : mr, t = (int)(item % tiles); \
        const int near = t == 0 && rows == 1;   /* the 4-vector tiles' decode row (wide: far) */ \
        const int64_t far = pass_prefetch(t == 0); \
        const int64_t pf = near ? PREFETCH_NEAR : far; \
        const W##_t *p = panels + j * k * W##_ROW; \
        const float *gs = gscales != NULL ? gscales + j * groups * PANEL : NULL; \
        const float *cs = cscales != NULL ? cscales + n0 : NULL, *xs = x + m0 * ldx; \
        const int full = n0 + PANEL <= n; \
        float scratch[MR * PANEL], padded_bias[PANEL]; \
        const float *b = bias != NULL ? bias + n0 : NULL; \
        if (!full && bias != NULL) { \
            memset(padded_bias, 0, sizeof padded_bias); \
            memcpy(padded_bias, bias + n0, (size_t)(n - n0) * sizeof(float)); \
            b = padded_bias; \
        } \
        float *out = full ? y + m0 * ldy + n0 : scratch; \
        const int64_t ldo = full ? ldy : PANEL; \
        if (f != NULL) { \
            if (j != have) { dequant_##W(p, k, G, gs, f); have = j; } \
            WIDE(f32, rows, 0, xs, ldx, f, k, k, NULL, cs, b, out, ldo) \
            for (int cb = 0; cb < PANEL; cb += BLOCK) \
                TILES_f32[rows](xs, ldx, f, k, k, NULL, cs, b, out + cb, ldo, cb, 0); \
        } else { \
            WIDE(W, rows, far, xs, ldx, p, k, G, gs, cs, b, out, ldo) \
            for (int cb = 0; cb < PANEL; cb += BLOCK) \
                (cb != 0 || !pf ? TILES_##W : near ? TILES_NEAR_##W : TILES_FAR_##W)[rows]( \
                    xs, ldx, p, k, G, gs, cs, b, out + cb, ldo, cb, pf); \
        } \
        if (!full) \
            for (int r = 0; r < rows; r++) \
                memcpy(y + (m0 + r) * ldy + n0, scratch + r * PANEL, \
                       (size_t)(n - n0) * sizeof(float)); \
    } \
    free(f); \
    } \
}

LINEAR(f32)
LINEAR(bf16)
LINEAR(i8)
LINEAR(i4)
LINEAR(i8g)

/* ---- segments: rows grouped by weight (a mixture of experts) in one call --------------- */
/* For e in [0, count): rows [off[e], off[e + 1]) of x (rows of k floats) times weight e into
 * the same rows of y (rows of n floats); every weight has the same n and k. Why: a
 * mixture-of-experts layer's products over rows grouped by expert, one call instead of one per
 * expert from Python. Each segment is computed by its format's entry as a call of its own
 * would, so the same bits. */
void linear_segments(const Linear *w, const int64_t *off, int64_t count, const float *x, float *y) {
    for (int64_t e = 0; e < count; e++)
        if (off[e + 1] > off[e])
            product(&w[e], x + off[e] * w[e].k, y + off[e] * w[e].n, off[e + 1] - off[e]);
}
