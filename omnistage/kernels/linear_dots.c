/* y = x W^T (+ bias) for int4 and int8 weights against int8-rounded activations: integer dot
 * products (llama.cpp's q4_0 x q8_0 and q8_0 x q8_0 numerics), the `int4k` / `int8k` formats
 * of kernels/weight_pack.py. Entries with linear.c's signature (linear_call.h), so a packed
 * weight in either format is called the same way, from Python or from C (decoder_stack.c,
 * linear_segments).
 *
 * Threads: OpenMP over (panel, rows) work items, torch's runtime (see paged_attention.c). */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "linear_call.h"

#define PANEL 64                    /* output columns per panel (linear.c's layout) */

/* ---- i4k: int4 weights against int8 activations, integer dot products ------------------- *
 * For K and the group both multiples of 32 (every real model's layers), int4 weights are laid
 * out for integer dot products of 4 inputs per column, and each row of x is quantized first:
 * per block of 32 inputs, s = max |x| / 127 and q = rint(x / s) (an int8, as llama.cpp's q8_0
 * activations). Then per column, exactly in integers, isum = sum_k u_k q_k over the block, and
 *   y = sum over groups g of  ws[g] * (sum over blocks b of g of  s_b * (isum_b - 8 sum_b q))
 * in float, in that order (two FMA chains), + bias. Integer sums are exact and the float steps
 * fixed, so every path (AVX-512 VNNI, AVX-512BW, AVX2, plain C) gives the same bits, and a row
 * the same bits in any batch. Against the float path (x . dequantized W) the difference is the
 * activations' rounding: half a step of 1/127 of each block's largest |x|.
 *
 * Layout: panel j holds K/8 chunks of 256 bytes; chunk c covers inputs 8c .. 8c+7 and holds
 * per column (64, in order) 4 bytes, byte i = u(8c + i) | u(8c + 4 + i) << 4. One 64-byte
 * vector is then 16 columns x 4 inputs: a low-nibble vector and a high-nibble vector each feed
 * one 4-way dot product per column (vpdpbusd: unsigned weight bytes x signed activations). */

#define KB 32                       /* inputs per activation scale */

typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v64u __attribute__((vector_size(64)));
typedef float v16f __attribute__((vector_size(64)));

/* acc + (per 32-bit lane: sum of 4 products of u's bytes with x4's bytes (signed)); u's bytes
 * 0..15 on AVX-512BW (pairs within int16), any on VNNI and plain C. */
static inline v16i dot4(v16i acc, v64u u, int32_t x4) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && !defined(OMNISTAGE_NO_AVX512)
    return (v16i)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, _mm512_set1_epi32(x4));
#elif defined(__AVX512BW__) && !defined(OMNISTAGE_NO_AVX512)
    const __m512i pairs = _mm512_maddubs_epi16((__m512i)u, _mm512_set1_epi32(x4));  /* <= 2*15*127 */
    return acc + (v16i)_mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
#else                   /* (AVX2 without AVX-512BW takes i4k_block_avx2 instead) */
    int8_t xb[4];
    memcpy(xb, &x4, 4);
    for (int l = 0; l < 16; l++)
        for (int i = 0; i < 4; i++) acc[l] += (int32_t)u[4 * l + i] * xb[i];
    return acc;
#endif
}

/* One block of 32 inputs -> q, its scale and the sum of q. The vector paths (AVX-512, AVX2)
 * compute the same expressions lane by lane (an IEEE division, round to nearest even, the same
 * clamp; max and integer sums in any order are the same), so the same bytes as the plain loop;
 * they are ~10x faster, which single rows notice (a decode step quantizes every layer's inputs:
 * ~40k values for a 12-layer model of width 512). */
static inline void quantize_block(const float *restrict src, int8_t *restrict q, float *s,
                                  int32_t *sum) {
#if defined(__AVX512F__) && !defined(OMNISTAGE_NO_AVX512)
    const __m512 v0 = _mm512_loadu_ps(src), v1 = _mm512_loadu_ps(src + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float scale = amax / 127.0f;
    if (!(scale > 0.0f)) {
        memset(q, 0, KB);
        *s = scale;
        *sum = 0;
        return;
    }
    const __m512 sc = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512 r0 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_div_ps(v0, sc), rn), lo), hi);
    const __m512 r1 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_div_ps(v1, sc), rn), lo), hi);
    const __m512i i0 = _mm512_cvtps_epi32(r0), i1 = _mm512_cvtps_epi32(r1);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(i1));
    *s = scale;
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#elif defined(__AVX2__)
    __m256 v[4], m = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(src + 8 * j);
        m = _mm256_max_ps(m, _mm256_and_ps(v[j], magnitude));
    }
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, m);
    for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
    const float scale = amax / 127.0f;
    if (!(scale > 0.0f)) {
        memset(q, 0, KB);
        *s = scale;
        *sum = 0;
        return;
    }
    const __m256 sc = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i total = _mm256_setzero_si256();
    int32_t codes[KB];
    for (int j = 0; j < 4; j++) {
        const __m256 r = _mm256_round_ps(_mm256_div_ps(v[j], sc), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i c = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        _mm256_storeu_si256((__m256i *)(codes + 8 * j), c);
        total = _mm256_add_epi32(total, c);
    }
    for (int i = 0; i < KB; i++) q[i] = (int8_t)codes[i];
    int32_t parts[8];
    _mm256_storeu_si256((__m256i *)parts, total);
    *s = scale;
    *sum = parts[0] + parts[1] + parts[2] + parts[3] + parts[4] + parts[5] + parts[6] + parts[7];
#else
    float amax = 0.0f;
    for (int i = 0; i < KB; i++) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
    const float scale = amax / 127.0f;
    int32_t total = 0;
    for (int i = 0; i < KB; i++) {
        float v = scale > 0.0f ? __builtin_rintf(src[i] / scale) : 0.0f;
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[i] = (int8_t)v;
        total += (int32_t)v;
    }
    *s = scale;
    *sum = total;
#endif
}

/* Rows of x (m, k) -> q (m, k) int8, and per block of 32: scale s (m, k/32), sum of q. */
static void quantize_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int8_t *q,
                          float *s, int32_t *sums) {
    const int64_t nb = k / KB;
    #pragma omp parallel for schedule(static) if (m > 16)
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < nb; b++)
            quantize_block(x + r * ldx + b * KB, q + r * k + b * KB, s + r * nb + b, sums + r * nb + b);
}

/* ---- i8k: int8 weights against int8 activations, integer dot products ------------------- *
 * The same numerics for int8 weights (per column, `i8`, as one group of all K inputs; or per
 * group, `i8g`, GGUF's q8_0): each row of x quantized per block of 32 inputs as above, then per
 * column, exactly in integers, isum_b = sum_k w_k q_k over the block, and
 *   y = sum over groups g of  ws[g] * (sum over blocks b of g of  s_b * isum_b)
 * in float, in that order, + bias: llama.cpp's q8_0 x q8_0. For K and the group multiples of 32.
 *
 * Layout: panel j holds K/4 chunks of 256 bytes; chunk c covers inputs 4c .. 4c+3 and holds per
 * column (64, in order) 4 bytes, byte i = w(4c + i) + 128 (unsigned: vpdpbusd multiplies
 * unsigned bytes by signed ones, so it sums (w + 128) q and 128 sum q is taken off; plain C the
 * same). One 64-byte vector is 16 columns x 4 inputs, one vpdpbusd. Without VNNI (AVX-512BW,
 * AVX2) the products are w q straight (|w|, |q| <= 127: a pair of them fits int16): the same
 * integers, so the same bits on every path. */

#if defined(__AVX512BW__) && !defined(__AVX512VNNI__) && !defined(OMNISTAGE_NO_AVX512)
#define I8K_BIAS 0
/* w q per byte as |w| (unsigned) times q with w's sign: maddubs's pairs stay within int16. */
static inline v16i dot4_i8(v16i acc, v64u u, int32_t x4) {
    const __m512i w = _mm512_xor_si512((__m512i)u, _mm512_set1_epi8((char)0x80));
    const __m512i x = _mm512_set1_epi32(x4);
    const __m512i xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    const __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(w), xs);
    return acc + (v16i)_mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
}
#else                               /* VNNI, plain C: dot4 sums (w + 128) q exactly */
#define I8K_BIAS 128
static inline v16i dot4_i8(v16i acc, v64u u, int32_t x4) { return dot4(acc, u, x4); }
#endif

/* ---- panels: the integer sums of a block of 32 inputs, then the float steps ------------- */

/* isum[v] (columns 16v .. 16v+15) = the integer sums of block b of the row q against an i4k
 * panel (u x q per input: biased by 8 sum q) or an i8k panel (biased by I8K_BIAS sum q). */
static inline void i4k_block(const int8_t *restrict q, const uint8_t *restrict p, int64_t b,
                             v16i isum[4]) {
    for (int c = 0; c < KB / 8; c++) {
        const uint8_t *w = p + (b * (KB / 8) + c) * 256;
        int32_t lo4, hi4;
        memcpy(&lo4, q + b * KB + 8 * c, 4);
        memcpy(&hi4, q + b * KB + 8 * c + 4, 4);
        for (int v = 0; v < 4; v++) {
            v64u u;
            memcpy(&u, w + 64 * v, sizeof u);
            isum[v] = dot4(isum[v], u & 15, lo4);
            isum[v] = dot4(isum[v], u >> 4, hi4);
        }
    }
}

static inline void i8k_block(const int8_t *restrict q, const uint8_t *restrict p, int64_t b,
                             v16i isum[4]) {
    for (int c = 0; c < KB / 4; c++) {
        const uint8_t *w = p + (b * (KB / 4) + c) * 256;
        int32_t x4;
        memcpy(&x4, q + b * KB + 4 * c, 4);
        for (int v = 0; v < 4; v++) {
            v64u u;
            memcpy(&u, w + 64 * v, sizeof u);
            isum[v] = dot4_i8(isum[v], u, x4);
        }
    }
}

#define I4K_BLOCK_BYTES (KB / 8 * 256)   /* a block of 32 inputs x 64 columns in a panel */
#define I8K_BLOCK_BYTES (KB / 4 * 256)
/* Bytes per prefetch instruction. With VNNI a block's integer sums take few instructions, and
 * prefetching each of its lines cost a single-row decode step 7% where the weights stay in a
 * large L3 (engine, Intel Xeon); every 4th line (the hardware brings neighbours) costs nothing
 * there. Elsewhere (AVX2, AVX-512BW) every line: 3584x512 int8 past the cache, one row, AVX2
 * 110 -> 73 us against 101 every 4th line. */
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && !defined(OMNISTAGE_NO_AVX512)
#define PF_STEP 256
#else
#define PF_STEP 64
#endif

/* The `bytes` of one block's weights at w, pf bytes further on, into L2 (pf 0: none; the
 * distance of the pass, pass_prefetch in linear_call.h). */
static inline void prefetch_block(const uint8_t *w, int bytes, int64_t pf) {
    if (pf)
        for (int i = 0; i < bytes; i += PF_STEP) __builtin_prefetch(w + pf + i, 0, 2);
}

/* One row (its quantized q, scales s, sums) against one panel: 64 outputs into out, per block
 * acc += s_b * (isum - bias * sum q), per group y += ws * acc. Inlined into each format's
 * panel function with its block function (a constant: no indirect calls remain). */
typedef void (*block_fn)(const int8_t *, const uint8_t *, int64_t, v16i[4]);
static inline __attribute__((always_inline)) void panel_qk(
        block_fn block, int32_t bias, int bb, const int8_t *restrict q, const float *restrict s,
        const int32_t *restrict sums, int64_t k, int64_t group, const uint8_t *restrict p,
        const float *restrict gs, float *restrict out, int64_t pf) {
    const int64_t nb = k / KB, per_group = group / KB;
    v16f y[4] = {};
    for (int64_t b0 = 0, g = 0; b0 < nb; b0 += per_group, g++) {
        v16f acc[4] = {};
        const int64_t b1 = b0 + per_group < nb ? b0 + per_group : nb;
        for (int64_t b = b0; b < b1; b++) {
            v16i isum[4] = {};
            prefetch_block(p + b * bb, bb, pf);
            block(q, p, b, isum);
            const v16f sb = (v16f){} + s[b];
            const int32_t corr = bias * sums[b];
            for (int v = 0; v < 4; v++)
                acc[v] = sb * __builtin_convertvector(isum[v] - corr, v16f) + acc[v];
        }
        for (int v = 0; v < 4; v++) {
            v16f ws;
            memcpy(&ws, gs + g * PANEL + 16 * v, sizeof ws);
            y[v] = ws * acc[v] + y[v];
        }
    }
    memcpy(out, y, sizeof y);
}

#define PANEL_ARGS const int8_t *restrict q, const float *restrict s, \
    const int32_t *restrict sums, int64_t k, int64_t group, const uint8_t *restrict p, \
    const float *restrict gs, float *restrict out, int64_t pf

/* Up to TILE_ROWS rows at once against one panel: row r's q, s and sums at r k, r k/32 and
 * r k/32, its outputs at out + r PANEL. pf: the prefetch distance of the call's first pass
 * over the panel (later passes read it from L2 and prefetch nothing). */
#define TILE_ROWS 4
#define ROWS_ARGS const int8_t *restrict q, const float *restrict s, \
    const int32_t *restrict sums, int rows, int64_t k, int64_t group, const uint8_t *restrict p, \
    const float *restrict gs, float *restrict out, int64_t pf

#if defined(__AVX2__) && (!defined(__AVX512BW__) || defined(OMNISTAGE_NO_AVX512))
/* AVX-VNNI (Intel cores without AVX-512 since Alder Lake): vpdpbusd on 256-bit vectors,
 * unsigned weight bytes x signed activations summed 4 to a lane in one instruction, where
 * plain AVX2 takes three or four (sign, maddubs, madd, add) on the same two ports. The weights
 * then go in as stored (i8k: w + 128, taken off as 128 sum q, I8K_AVX2_BIAS; i4k: the
 * nibbles, as the AVX-512 VNNI path): the same integers, so the same bits on every path. */
#if defined(__AVXVNNI__)
#define AVX2_VNNI 1
#define I8K_AVX2_BIAS 128
#else
#define AVX2_VNNI 0
#define I8K_AVX2_BIAS 0
#endif

/* i4k, one byte vector's low and high nibbles (lo, hi: 0..15) against two 4-byte activation
 * broadcasts: with AVX-VNNI into the int32 sums `acc` directly; without, into int16 pair sums
 * (maddubs: each pair <= 2 * 15 * 127), which nibble_widen adds to the int32 sums once a block
 * (a block's four chunks' pairs <= 30480 < 2^15: exact). */
static inline __m256i nibble_dots(__m256i acc, __m256i lo, __m256i hi, __m256i xl, __m256i xh) {
#if AVX2_VNNI
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, lo, xl), hi, xh);
#else
    return _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
#endif
}
static inline __m256i nibble_widen(__m256i isum, __m256i acc) {
#if AVX2_VNNI
    return _mm256_add_epi32(isum, acc);
#else
    return _mm256_add_epi32(isum, _mm256_madd_epi16(acc, _mm256_set1_epi16(1)));
#endif
}

/* The panels for AVX2 (the path dot4 takes there), in 8-lane registers: the 64-byte vectors
 * above are pairs of registers on AVX2, and their 4 x 3 arrays (96 registers' worth) lived on
 * the stack. Here the eight integer sums of a block (8 columns each) stay in registers; the
 * float sums, touched once a block, live in L1. The same integers (exact) and the same FMAs in
 * the same order as panel_qk, so the same bits. i4k: two nibbles' maddubs per byte vector
 * (each pair <= 2 * 15 * 127: the int16 sum is exact); i8k: w q by the sign trick (|w| times
 * q with w's sign, pairs within int16), unbiased. */
static inline void i4k_block_avx2(const int8_t *restrict q, const uint8_t *restrict p, int64_t b,
                                  __m256i i[8]) {
    const __m256i mask = _mm256_set1_epi8(15);
    __m256i acc[8];                /* int32 sums (AVX-VNNI) or int16 pairs (nibble_dots) */
    for (int h = 0; h < 8; h++) acc[h] = _mm256_setzero_si256();
    for (int c = 0; c < KB / 8; c++) {
        const uint8_t *w = p + (b * (KB / 8) + c) * 256;
        int32_t lo4, hi4;
        memcpy(&lo4, q + b * KB + 8 * c, 4);
        memcpy(&hi4, q + b * KB + 8 * c + 4, 4);
        const __m256i xl = _mm256_set1_epi32(lo4), xh = _mm256_set1_epi32(hi4);
        for (int h = 0; h < 8; h++) {
            const __m256i u = _mm256_loadu_si256((const __m256i *)(w + 32 * h));
            acc[h] = nibble_dots(acc[h], _mm256_and_si256(u, mask),
                                 _mm256_and_si256(_mm256_srli_epi16(u, 4), mask), xl, xh);
        }
    }
    for (int h = 0; h < 8; h++) i[h] = nibble_widen(i[h], acc[h]);
}

static inline void i8k_block_avx2(const int8_t *restrict q, const uint8_t *restrict p, int64_t b,
                                  __m256i i[8]) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int c = 0; c < KB / 4; c++) {
        const uint8_t *wp = p + (b * (KB / 4) + c) * 256;
        int32_t x4;
        memcpy(&x4, q + b * KB + 4 * c, 4);
        const __m256i x = _mm256_set1_epi32(x4);
        for (int h = 0; h < 8; h++) {
            const __m256i stored = _mm256_loadu_si256((const __m256i *)(wp + 32 * h));
#if AVX2_VNNI           /* (w + 128) x q, biased: I8K_AVX2_BIAS */
            (void)flip; (void)ones;
            i[h] = _mm256_dpbusd_avx_epi32(i[h], stored, x);
#else
            const __m256i w = _mm256_xor_si256(stored, flip);
            const __m256i pr = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
            i[h] = _mm256_add_epi32(i[h], _mm256_madd_epi16(pr, ones));
#endif
        }
    }
}

typedef void (*block8_fn)(const int8_t *, const uint8_t *, int64_t, __m256i[8]);
static inline __attribute__((always_inline)) void panel_qk_avx2(block8_fn block, int32_t bias,
                                                                int bb, PANEL_ARGS) {
    const int64_t nb = k / KB, per_group = group / KB;
    float y[PANEL] = {0}, acc[PANEL];
    for (int64_t b0 = 0, g = 0; b0 < nb; b0 += per_group, g++) {
        memset(acc, 0, sizeof acc);
        const int64_t b1 = b0 + per_group < nb ? b0 + per_group : nb;
        for (int64_t b = b0; b < b1; b++) {
            __m256i i[8];
            for (int h = 0; h < 8; h++) i[h] = _mm256_setzero_si256();
            prefetch_block(p + b * bb, bb, pf);
            block(q, p, b, i);
            const __m256 sb = _mm256_set1_ps(s[b]);
            const __m256i corr = _mm256_set1_epi32(bias * sums[b]);
            for (int h = 0; h < 8; h++)
                _mm256_storeu_ps(acc + 8 * h, _mm256_fmadd_ps(sb, _mm256_cvtepi32_ps(
                    _mm256_sub_epi32(i[h], corr)), _mm256_loadu_ps(acc + 8 * h)));
        }
        for (int c = 0; c < PANEL; c += 8)
            _mm256_storeu_ps(y + c, _mm256_fmadd_ps(_mm256_loadu_ps(gs + g * PANEL + c),
                                                    _mm256_loadu_ps(acc + c), _mm256_loadu_ps(y + c)));
    }
    memcpy(out, y, sizeof y);
}

/* Several rows at once (batches, prefill): per block, R rows x 16 columns of integer sums in
 * registers (8 of the 16 ymm), and the weight vector's shared work (its load, and for i8k the
 * flip and |w|; for i4k the nibbles' unpacking) done once for the R rows instead of per row.
 * Per row and weight vector i8k is left with sign, maddubs, madd, add: 5.25 operations per
 * row-vector at R = 4 against 7 for a row alone (an int8 product of 32 rows 1.2x faster; i4k
 * also sums a block's pairs in int16 before widening, as i4k_block_avx2). Each block is
 * walked in four column quarters of 64 of a chunk's 256 bytes. The same integers and the same
 * FMAs in the same order as panel_qk_avx2 for each row, so the same bits as a row alone. */
static inline __attribute__((always_inline)) void i8k_tile_avx2(
        const int R, const int8_t *restrict q, int64_t k, const uint8_t *restrict p, int64_t b,
        int quarter, __m256i isum[TILE_ROWS][2]) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    #pragma GCC unroll 1
    for (int c = 0; c < KB / 4; c++) {
        const uint8_t *wp = p + (b * (KB / 4) + c) * 256 + 64 * quarter;
        for (int v = 0; v < 2; v++) {
            const __m256i stored = _mm256_loadu_si256((const __m256i *)(wp + 32 * v));
#if AVX2_VNNI           /* (w + 128) x q, biased: I8K_AVX2_BIAS */
            (void)flip; (void)ones;
            for (int r = 0; r < R; r++) {
                int32_t x4;
                memcpy(&x4, q + r * k + b * KB + 4 * c, 4);
                isum[r][v] = _mm256_dpbusd_avx_epi32(isum[r][v], stored, _mm256_set1_epi32(x4));
            }
#else
            const __m256i w = _mm256_xor_si256(stored, flip), a = _mm256_abs_epi8(w);
            for (int r = 0; r < R; r++) {
                int32_t x4;
                memcpy(&x4, q + r * k + b * KB + 4 * c, 4);
                const __m256i pr = _mm256_maddubs_epi16(a, _mm256_sign_epi8(_mm256_set1_epi32(x4), w));
                isum[r][v] = _mm256_add_epi32(isum[r][v], _mm256_madd_epi16(pr, ones));
            }
#endif
        }
    }
}

static inline __attribute__((always_inline)) void i4k_tile_avx2(
        const int R, const int8_t *restrict q, int64_t k, const uint8_t *restrict p, int64_t b,
        int quarter, __m256i isum[TILE_ROWS][2]) {
    const __m256i mask = _mm256_set1_epi8(15);
    __m256i acc[TILE_ROWS][2];      /* int32 sums (AVX-VNNI) or int16 pairs (nibble_dots) */
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    #pragma GCC unroll 1
    for (int c = 0; c < KB / 8; c++) {
        const uint8_t *w = p + (b * (KB / 8) + c) * 256 + 64 * quarter;
        for (int v = 0; v < 2; v++) {
            const __m256i u = _mm256_loadu_si256((const __m256i *)(w + 32 * v));
            const __m256i lo = _mm256_and_si256(u, mask), hi = _mm256_and_si256(_mm256_srli_epi16(u, 4), mask);
            for (int r = 0; r < R; r++) {
                int32_t lo4, hi4;
                memcpy(&lo4, q + r * k + b * KB + 8 * c, 4);
                memcpy(&hi4, q + r * k + b * KB + 8 * c + 4, 4);
                acc[r][v] = nibble_dots(acc[r][v], lo, hi, _mm256_set1_epi32(lo4), _mm256_set1_epi32(hi4));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < 2; v++) isum[r][v] = nibble_widen(isum[r][v], acc[r][v]);
}

typedef void (*tile8_fn)(int, const int8_t *, int64_t, const uint8_t *, int64_t, int,
                         __m256i[TILE_ROWS][2]);
static inline __attribute__((always_inline)) void rows_qk_avx2(tile8_fn tile, int32_t bias, int bb,
                                                               const int R, ROWS_ARGS) {
    (void)rows;                       /* one pass over the panel */
    const int64_t nb = k / KB, per_group = group / KB;
    /* The float sums of R rows x 64 columns live in L1 (touched once per block and row-vector);
     * a block's four column quarters run one after another, so the panel is read in order
     * (from memory once, in a decode step's batch: each block's 1-2 KB before the next). */
    float y[TILE_ROWS][PANEL], acc[TILE_ROWS][PANEL];
    memset(y, 0, sizeof y);
    for (int64_t b0 = 0, g = 0; b0 < nb; b0 += per_group, g++) {
        memset(acc, 0, sizeof acc);
        const int64_t b1 = b0 + per_group < nb ? b0 + per_group : nb;
        for (int64_t b = b0; b < b1; b++) {
            prefetch_block(p + b * bb, bb, pf);
            for (int quarter = 0; quarter < PANEL / 16; quarter++) {
                __m256i isum[TILE_ROWS][2];
                for (int r = 0; r < R; r++) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
                tile(R, q, k, p, b, quarter, isum);
                for (int r = 0; r < R; r++) {
                    const __m256 sb = _mm256_set1_ps(s[r * nb + b]);
                    const __m256i corr = _mm256_set1_epi32(bias * sums[r * nb + b]);
                    for (int v = 0; v < 2; v++) {
                        float *a = acc[r] + 16 * quarter + 8 * v;
                        _mm256_storeu_ps(a, _mm256_fmadd_ps(sb, _mm256_cvtepi32_ps(
                            _mm256_sub_epi32(isum[r][v], corr)), _mm256_loadu_ps(a)));
                    }
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < PANEL; c += 8)
                _mm256_storeu_ps(y[r] + c, _mm256_fmadd_ps(_mm256_loadu_ps(gs + g * PANEL + c),
                                                           _mm256_loadu_ps(acc[r] + c), _mm256_loadu_ps(y[r] + c)));
    }
    for (int r = 0; r < R; r++) memcpy(out + r * PANEL, y[r], sizeof y[r]);
}

/* rows_W: `rows` (1 .. TILE_ROWS) rows against one panel; a row alone takes the whole-panel
 * function above (eight sums per broadcast), several the tile of their count. */
#define ROWS_AVX2(name, tile, bias, bb, single)                                               \
    static void name(ROWS_ARGS) {                                                             \
        switch (rows) {                                                                       \
        case 4: rows_qk_avx2(tile, bias, bb, 4, q, s, sums, rows, k, group, p, gs, out, pf); break; \
        case 3: rows_qk_avx2(tile, bias, bb, 3, q, s, sums, rows, k, group, p, gs, out, pf); break; \
        case 2: rows_qk_avx2(tile, bias, bb, 2, q, s, sums, rows, k, group, p, gs, out, pf); break; \
        default: panel_qk_avx2(single, bias, bb, q, s, sums, k, group, p, gs, out, pf);       \
        }                                                                                     \
    }
ROWS_AVX2(rows_i4k, i4k_tile_avx2, 8, I4K_BLOCK_BYTES, i4k_block_avx2)
ROWS_AVX2(rows_i8k, i8k_tile_avx2, I8K_AVX2_BIAS, I8K_BLOCK_BYTES, i8k_block_avx2)
#else
/* rows_W: `rows` rows against one panel, one after another (the 16-lane paths keep a row's 64
 * columns of sums in four registers and read the panel once per row from L1 / L2). */
static inline __attribute__((always_inline)) void rows_qk(block_fn block, int32_t bias, int bb,
                                                          ROWS_ARGS) {
    for (int r = 0; r < rows; r++)      /* a pass per row: the first prefetches */
        panel_qk(block, bias, bb, q + r * k, s + r * (k / KB), sums + r * (k / KB), k, group, p,
                 gs, out + r * PANEL, r == 0 ? pf : 0);
}

static void rows_i4k(ROWS_ARGS) {
    rows_qk(i4k_block, 8, I4K_BLOCK_BYTES, q, s, sums, rows, k, group, p, gs, out, pf);
}
static void rows_i8k(ROWS_ARGS) {
    rows_qk(i8k_block, I8K_BIAS, I8K_BLOCK_BYTES, q, s, sums, rows, k, group, p, gs, out, pf);
}
#endif

/* ---- the entries of i4k and i8k ---------------------------------------------------------- */

typedef void (*rows_k_fn)(const int8_t *, const float *, const int32_t *, int, int64_t, int64_t,
                          const uint8_t *, const float *, float *, int64_t);

#define QK_ROWS 8                    /* rows per work item (one panel stays in cache) */
#define QK_STACK 16384               /* quantized inputs that go on the stack (16 KB) */

/* x (m, k) against panels of `panel_bytes` bytes each (group scales per panel as above): rows
 * quantized once, then per (panel, rows) work item `panel` per row, + bias. Scratch for the
 * quantized rows is malloc'ed per call; if it cannot be had, y is filled with NaN. */
static void linear_qk(rows_k_fn panel, int64_t panel_bytes, const float *x, int64_t ldx,
                      const uint8_t *panels, const float *gscales, int64_t group,
                      const float *bias, float *y, int64_t ldy, int64_t m, int64_t n, int64_t k) {
    const int64_t nb = k / KB, num_panels = (n + PANEL - 1) / PANEL;
    const int64_t groups = (k + group - 1) / group, tiles = (m + QK_ROWS - 1) / QK_ROWS;
    /* A few rows (decode) quantize onto the stack: a malloc per product is a few percent of
     * a single-row step. */
    int8_t q_small[QK_STACK];
    float s_small[QK_STACK / KB];
    int32_t sums_small[QK_STACK / KB];
    const int small = m * k <= QK_STACK;
    int8_t *q = small ? q_small : malloc((size_t)(m * k > 0 ? m * k : 1));
    float *s = small ? s_small : malloc(sizeof(float) * (size_t)(m * nb > 0 ? m * nb : 1));
    int32_t *sums = small ? sums_small : malloc(sizeof(int32_t) * (size_t)(m * nb > 0 ? m * nb : 1));
    if (q == NULL || s == NULL || sums == NULL) {
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < n; c++) y[r * ldy + c] = __builtin_nanf("");
    } else {
        quantize_rows(x, ldx, m, k, q, s, sums);
        #pragma omp parallel for schedule(static)
        for (int64_t item = 0; item < num_panels * tiles; item++) {
            const int64_t j = item / tiles, r0 = item % tiles * QK_ROWS, n0 = j * PANEL;
            const int64_t r1 = r0 + QK_ROWS < m ? r0 + QK_ROWS : m;
            const int64_t cols = n - n0 < PANEL ? n - n0 : PANEL;
            for (int64_t r = r0; r < r1; r += TILE_ROWS) {
                const int rows = (int)(r1 - r < TILE_ROWS ? r1 - r : TILE_ROWS);
                const int64_t pf = pass_prefetch(r == 0);  /* the panel's first rows: its first pass */
                float out[TILE_ROWS * PANEL];
                panel(q + r * k, s + r * nb, sums + r * nb, rows, k, group, panels + j * panel_bytes,
                      gscales + j * groups * PANEL, out, pf);
                for (int i = 0; i < rows; i++)
                    for (int64_t c = 0; c < cols; c++)
                        y[(r + i) * ldy + n0 + c] = bias != NULL ? out[i * PANEL + c] + bias[n0 + c]
                                                                 : out[i * PANEL + c];
            }
        }
    }
    if (!small) {
        free(q);
        free(s);
        free(sums);
    }
}

/* linear_i4k, linear_i8k: the arguments of linear_W (cscales unused: an i8 weight's column
 * scales come as the group scales of one group of K inputs). */
void linear_i4k(const float *x, int64_t ldx, const uint8_t *panels, const float *gscales,
                int64_t group, const float *cscales, const float *bias, float *y, int64_t ldy,
                int64_t m, int64_t n, int64_t k) {
    (void)cscales;
    linear_qk(rows_i4k, k / 2 * PANEL, x, ldx, panels, gscales, group, bias, y, ldy, m, n, k);
}

void linear_i8k(const float *x, int64_t ldx, const uint8_t *panels, const float *gscales,
                int64_t group, const float *cscales, const float *bias, float *y, int64_t ldy,
                int64_t m, int64_t n, int64_t k) {
    (void)cscales;
    linear_qk(rows_i8k, k * PANEL, x, ldx, panels, gscales, group, bias, y, ldy, m, n, k);
}
