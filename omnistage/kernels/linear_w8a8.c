/* y = x W^T + bias with the product in 8-bit integers (W8A8): the weight quantized once per
 * output column (symmetric, q in -127..127, scale sw), each row of x when the call comes
 * (symmetric over the whole row, scale sx = max |x| / 127). Then, per output,
 *   isum = sum_k qx_k qw_k                      exactly, in int32
 *   y    = fma((float)isum, sx * sw, bias)      two roundings, the same on every path
 * so a row's outputs are bit-identical alone or in any batch, on any thread count, and equal
 * between the VNNI and the plain C path (integer sums are exact).
 *
 * Why: compute-bound stages whose GEMMs already run at the CPU's bf16 peak (the Qwen2.5
 * token2wav DiT on AVX-512-BF16 without AMX: ~1 TFLOP/s on two Zen 5 cores) get twice the
 * multiply-accumulates per instruction from VNNI's 4-way int8 dot products (vpdpbusd).
 *
 * vpdpbusd multiplies unsigned bytes by signed bytes, so the activations go in as
 * u = qx + 128 (0..255) and the weight as qw; sum_k u_k qw_k = isum + 128 sum_k qw_k, and the
 * column's 128 sum_k qw_k (comp) is subtracted before the float step. |isum| <= 127*127*K and
 * the biased sum <= 255*127*K: int32 holds them for K <= 66000.
 *
 * Layout: the (N, K) weight in ceil(N/64) panels of 64 columns; K padded to K4 = ceil(K/4)
 * groups of 4 (zeros). Panel j holds K4 chunks of 256 bytes: chunk g holds, for each of its
 * 64 columns in order, the 4 bytes qw[64j + c][4g .. 4g+3]. One 64-byte vector is then 16
 * columns x 4 inputs, what one vpdpbusd takes against 4 broadcast activation bytes.
 * sw and comp are per panel too (num_panels, 64), zero past N.
 *
 * An optional activation follows in the same pass (act 1: GELU's tanh form, see gelu_tanh).
 * Optional fusions (W8A8Fuse): a LayerNorm with per-input weight and bias applied to each row
 * of x as it is quantized (the DiT's modulated norm before q|k|v and the feed-forward), and a
 * gated residual after (y = res + gate * y: the DiT's x + gate * attention / feed-forward):
 * each saves a pass of torch over the rows in and out of the product, which at DiT sizes
 * (K = 256-1024) cost as much as the quantization itself.
 *
 * AVX-VNNI (AVX2 cores with vpdpbusd, no AVX-512): the same dot products 8 lanes wide, the
 * panel a quarter at a time (tile_sums); the same integer sums again.
 *
 * AMX (Intel Xeon since Sapphire Rapids; the build has it where -march=native does, the caller
 * asks for it per call once linear_w8a8_amx() got the OS's permission): the same integer sums
 * from tile products, 32 rows x 32 columns x 64 inputs per four TDPBUSD, the panel layout read
 * as it is (a tile row of B is one 4-input group's 16 columns: 64 bytes at a stride of 256).
 * Inputs past the last whole 64 go through VNNI, added to the same int32 sums: integer sums
 * in any order are the same sums, so the AMX, VNNI and plain C paths give the same bits.
 *
 * Threads: OpenMP over (row block, panel) work items (torch's runtime, see paged_attention.c);
 * linear_w8a8_ffn over row blocks. */

#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "linear_w8a8.h"      /* W8A8Fuse, W8A8Matrix */

#define PANEL 64
#define MR 6             /* rows of a register tile: 6 x 4 accumulators + 4 weight vectors */
#define ROW_BLOCK 48     /* rows of a work item (a multiple of MR) */
#define AMX_ROWS 32      /* rows of an AMX pass: two 16-row A tiles */
#define AMX_BLOCK 64     /* rows of an AMX work item (a multiple of AMX_ROWS) */
#define AMX_GROUPS 16    /* 4-input groups per tile product: 64 bytes, one tile row */

#if defined(__AVX512VNNI__) && defined(__AVX512F__) && !defined(OMNISTAGE_NO_AVX512)
#define W8A8_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define W8A8_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(__AVXVNNI__)
#define W8A8_AVX_VNNI 1     /* vpdpbusd on 256-bit vectors (Intel cores without AVX-512 since Alder Lake) */
#endif


typedef float v16f __attribute__((vector_size(16 * sizeof(float))));

/* Sums over a row in one fixed order on every build (so every path gives the same bits): four
 * 16-lane running sums over whole 64s (independent chains: a single one would wait on each
 * addition's latency, ~4x slower at K = 256), the 16s left into the first, then the four
 * added, the 16 lanes in a fixed tree, and the last few inputs one by one.
 * row_sum(v, k, mean, 0): sum of v; (.., 1): sum of (v - mean)^2. */
static inline float tree16(v16f a) {
    a += __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
    a += __builtin_shufflevector(a, a, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
    a += __builtin_shufflevector(a, a, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    a += __builtin_shufflevector(a, a, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
    return a[0];
}

static inline v16f term16(const float *p, float mean, int sq) {
    v16f a;
    memcpy(&a, p, sizeof a);
    if (!sq) return a;
    a -= mean;
    return a * a;
}

static inline float row_sum(const float *v, int64_t k, float mean, int sq) {
    v16f a0 = {}, a1 = {}, a2 = {}, a3 = {};
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        a0 += term16(v + i, mean, sq);
        a1 += term16(v + i + 16, mean, sq);
        a2 += term16(v + i + 32, mean, sq);
        a3 += term16(v + i + 48, mean, sq);
    }
    for (; i + 16 <= k; i += 16) a0 += term16(v + i, mean, sq);
    float total = tree16((a0 + a1) + (a2 + a3));
    for (; i < k; i++) total += sq ? (v[i] - mean) * (v[i] - mean) : v[i];
    return total;
}

/* dst (k) = LayerNorm(src) * w + b: the mean, then the mean of squared deviations (two passes,
 * as torch's CPU layer_norm), rstd = 1 / sqrt(var + eps). */
static void norm_row(const float *restrict src, int64_t k, const float *restrict w,
                     const float *restrict b, float eps, float *restrict dst) {
    const float mean = row_sum(src, k, 0.0f, 0) / (float)k;
    const float rstd = 1.0f / sqrtf(row_sum(src, k, mean, 1) / (float)k + eps);
    for (int64_t i = 0; i < k; i++) dst[i] = (src[i] - mean) * rstd * w[i] + b[i];
}

/* Row r of x (m, k) -> u (m, kp): qx + 128, padded with 128 (qx = 0) to kp; s[r] = sx.
 * qx = rint(x * (127 / max |x|)) (round half to even: rintf and vcvtps2dq under the default
 * rounding mode agree), so both paths give the same bytes. */
static void quantize_row(const float *restrict src, int64_t k, int64_t kp, uint8_t *restrict dst,
                         float *s) {
    int64_t i = 0;
    float amax = 0.0f;
#ifdef W8A8_VNNI
    __m512 mx = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(src + i)));
    amax = _mm512_reduce_max_ps(mx);
#elif defined(__AVX2__)
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps();
    for (; i + 8 <= k; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(src + i), magnitude));
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    for (int l = 0; l < 8; l++) amax = fmaxf(amax, lanes[l]);
#endif
    for (; i < k; i++) amax = fmaxf(amax, fabsf(src[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    i = 0;
#ifdef W8A8_VNNI
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), bias = _mm512_set1_epi32(128);
    for (; i + 16 <= k; i += 16) {
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + i), vinv));
        q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), bias);
        _mm_storeu_si128((__m128i *)(dst + i), _mm512_cvtepi32_epi8(q));
    }
#elif defined(__AVX2__)
    /* 32 codes at a time: int32 -> bytes by two saturating packs (1..255 pass unchanged),
     * which interleave 128-bit lanes; one permute puts them back in order. */
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127), bias = _mm256_set1_epi32(128);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; i + 32 <= k; i += 32) {
        __m256i q[4];
        for (int j = 0; j < 4; j++) {
            q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i + 8 * j), vinv));
            q[j] = _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(q[j], lo), hi), bias);
        }
        const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]), _mm256_packus_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_permutevar8x32_epi32(bytes, order));
    }
#endif
    for (; i < k; i++) {
        float v = __builtin_rintf(src[i] * inv);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        dst[i] = (uint8_t)((int32_t)v + 128);
    }
    for (; i < kp; i++) dst[i] = 128;
    *s = amax / 127.0f;
}

/* GELU, tanh form: 0.5 y (1 + tanh(u)) with u = sqrt(2/pi) (y + 0.044715 y^3), computed as
 * y / (1 + exp(-2u)) (the same function: 0.5 (1 + tanh(u)) = sigmoid(2u)). exp by range
 * reduction, z = n ln2 + r with |r| <= ln2/2 (ln2 in two parts), and a degree-6 Taylor
 * polynomial of e^r (truncation <= 1.3e-7 relative); 2^n built in the exponent bits. z is
 * clamped to +-87, where 1 + e^z saturates in float anyway. Plain loops over a row of a tile,
 * vectorized by the compiler on either path (the same operations, so the same bits).
 * Against torch's F.gelu(approximate="tanh"): within a few float ulps. */
static void gelu_tanh(float *v, int64_t count) {
    for (int64_t c = 0; c < count; c++) {
        const float y = v[c];
        float z = -1.5957691216057308f * (y + 0.044715f * y * y * y);     /* -2u */
        z = z < -87.0f ? -87.0f : (z > 87.0f ? 87.0f : z);
        const float n = __builtin_rintf(z * 1.4426950408889634f);
        const float r = (z - n * 0.693145751953125f) - n * 1.4286068203094172e-06f;
        float p = 1.0f / 720.0f;
        p = p * r + 1.0f / 120.0f;
        p = p * r + 1.0f / 24.0f;
        p = p * r + 1.0f / 6.0f;
        p = p * r + 0.5f;
        p = p * r + 1.0f;
        p = p * r + 1.0f;
        const int32_t bits = ((int32_t)n + 127) << 23;
        float scale;
        memcpy(&scale, &bits, sizeof scale);
        v[c] = y / (1.0f + p * scale);
    }
}

/* The integer sums of rows[0 .. MR) (pointers into u; a short tile repeats its last row)
 * against one panel: isum[i][c] = sum_k u_ik qw_kc (biased by comp, see the top). */
static void tile_sums(const uint8_t *const rows[MR], const int8_t *restrict p, int64_t k4,
                      int32_t isum[MR][PANEL]) {
#ifdef W8A8_VNNI
    __m512i acc[MR][4];
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_si512();
    for (int64_t g = 0; g < k4; g++) {
        const int8_t *w = p + g * 256;
        const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64),
                      w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
        for (int i = 0; i < MR; i++) {
            int32_t a4;
            memcpy(&a4, rows[i] + 4 * g, 4);
            const __m512i a = _mm512_set1_epi32(a4);
            acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], a, w0);
            acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], a, w1);
            acc[i][2] = _mm512_dpbusd_epi32(acc[i][2], a, w2);
            acc[i][3] = _mm512_dpbusd_epi32(acc[i][3], a, w3);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < 4; v++) _mm512_storeu_si512(isum[i] + 16 * v, acc[i][v]);
#elif defined(W8A8_AVX_VNNI)
    /* 16 registers of 8 lanes: the panel in quarters of 16 columns (a chunk's 64 bytes of
     * them, two vectors), MR rows x 2 accumulators each; the same integer sums. */
    for (int q = 0; q < PANEL / 16; q++) {
        __m256i acc[MR][2];
        for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
        for (int64_t g = 0; g < k4; g++) {
            const int8_t *w = p + g * 256 + 64 * q;
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)w),
                          w1 = _mm256_loadu_si256((const __m256i *)(w + 32));
            for (int i = 0; i < MR; i++) {
                int32_t a4;
                memcpy(&a4, rows[i] + 4 * g, 4);
                const __m256i a = _mm256_set1_epi32(a4);
                acc[i][0] = _mm256_dpbusd_avx_epi32(acc[i][0], a, w0);
                acc[i][1] = _mm256_dpbusd_avx_epi32(acc[i][1], a, w1);
            }
        }
        for (int i = 0; i < MR; i++) {
            _mm256_storeu_si256((__m256i *)(isum[i] + 16 * q), acc[i][0]);
            _mm256_storeu_si256((__m256i *)(isum[i] + 16 * q + 8), acc[i][1]);
        }
    }
#else
    for (int i = 0; i < MR; i++)
        for (int c = 0; c < PANEL; c++) isum[i][c] = 0;
    for (int64_t g = 0; g < k4; g++) {
        const int8_t *w = p + g * 256;
        for (int i = 0; i < MR; i++) {
            const uint8_t *a = rows[i] + 4 * g;
            for (int c = 0; c < PANEL; c++)
                isum[i][c] += a[0] * w[4 * c] + a[1] * w[4 * c + 1] + a[2] * w[4 * c + 2]
                              + a[3] * w[4 * c + 3];
        }
    }
#endif
}

#ifdef W8A8_AMX
/* The tile shapes: every tile 16 rows of 64 bytes (C: 16 x 16 int32; A: 16 rows x 64 inputs;
 * B: 16 groups x 16 columns x 4 inputs). Tiles 0-3 C, 4-5 A, 6-7 B. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
}

/* isum (AMX_ROWS x PANEL) = the integer sums of the AMX_ROWS rows of u from `u` (row stride
 * kp) against one panel over its first `groups` 4-input groups (a multiple of AMX_GROUPS). */
static void amx_sums(const uint8_t *u, int64_t kp, const int8_t *p, int64_t groups,
                     int32_t isum[][PANEL]) {
    for (int half = 0; half < 2; half++) {                  /* columns 32 half .. + 31 */
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t g = 0; g < groups; g += AMX_GROUPS) {
            const int8_t *w = p + g * 256 + half * 128;
            _tile_loadd(4, u + 4 * g, kp);                  /* rows 0-15 */
            _tile_loadd(5, u + 16 * kp + 4 * g, kp);        /* rows 16-31 */
            _tile_loadd(6, w, 256);                         /* columns +0 .. +15 */
            _tile_loadd(7, w + 64, 256);                    /* columns +16 .. +31 */
            _tile_dpbusd(0, 4, 6);
            _tile_dpbusd(1, 4, 7);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
        }
        int32_t *c = isum[0] + 32 * half;
        _tile_stored(0, c, PANEL * 4);
        _tile_stored(1, c + 16, PANEL * 4);
        _tile_stored(2, c + 16 * PANEL, PANEL * 4);
        _tile_stored(3, c + 16 * PANEL + 16, PANEL * 4);
    }
}

/* isum[i] += the sums of row i of u over groups [g0, k4) (the inputs past the tiles' 64s). */
static void vnni_add(const uint8_t *u, int64_t kp, const int8_t *p, int64_t g0, int64_t k4,
                     int rows, int32_t isum[][PANEL]) {
    for (int i = 0; i < rows && g0 < k4; i++) {
        __m512i acc[4];
        for (int v = 0; v < 4; v++) acc[v] = _mm512_loadu_si512(isum[i] + 16 * v);
        for (int64_t g = g0; g < k4; g++) {
            int32_t a4;
            memcpy(&a4, u + i * kp + 4 * g, 4);
            const __m512i a = _mm512_set1_epi32(a4);
            for (int v = 0; v < 4; v++)
                acc[v] = _mm512_dpbusd_epi32(acc[v], a, _mm512_loadu_si512(p + g * 256 + 64 * v));
        }
        for (int v = 0; v < 4; v++) _mm512_storeu_si512(isum[i] + 16 * v, acc[v]);
    }
}
#endif

/* y = act(isum - comp) * (sx * sw) + bias for `rows` rows of one panel's `cols` columns, then
 * y = res + gate * y where fuse has a residual. y points at row r0, column n0 of the output. */
static void finish_rows(int32_t isum[][PANEL], int rows, const float *sx, const float *ws,
                        const int32_t *wc, const float *bias, int32_t act, const W8A8Fuse *fuse,
                        int64_t r0, int64_t n0, float *y, int64_t ldy, int64_t cols) {
    const int residual = fuse != NULL && fuse->res != NULL;
    for (int i = 0; i < rows; i++) {
        float *dst = y + i * ldy;
        for (int64_t c = 0; c < cols; c++)
            dst[c] = fmaf((float)(isum[i][c] - wc[c]), sx[i] * ws[c], bias != NULL ? bias[c] : 0.0f);
        if (act == 1) gelu_tanh(dst, cols);
        if (residual) {
            const float *res = fuse->res + (r0 + i) * fuse->ldr + n0, *gate = fuse->gate + n0;
            for (int64_t c = 0; c < cols; c++) dst[c] = fmaf(gate[c], dst[c], res[c]);
        }
    }
}

/* Rows [r0, r1) of y for panel j: tiles of MR rows (VNNI or plain C) or AMX_ROWS (AMX). */
static void rows_of_panel(const uint8_t *u, int64_t kp, const float *sx, const int8_t *p,
                          int64_t k4, const float *ws, const int32_t *wc, const float *bias,
                          int32_t act, const W8A8Fuse *fuse, int64_t n0, float *y, int64_t ldy,
                          int64_t r0, int64_t r1, int64_t cols, int amx) {
    int32_t isum[AMX_ROWS][PANEL] __attribute__((aligned(64)));
    const int step = amx ? AMX_ROWS : MR;
    for (int64_t r = r0; r < r1; r += step) {
        const int rows = r1 - r < step ? (int)(r1 - r) : step;
#ifdef W8A8_AMX
        if (amx) {                            /* u holds whole 32-row tiles (padding rows) */
            const int64_t tiled = k4 - k4 % AMX_GROUPS;
            amx_sums(u + r * kp, kp, p, tiled, isum);
            vnni_add(u + r * kp, kp, p, tiled, k4, rows, isum);
        } else
#endif
        {
            const uint8_t *tile_rows[MR];
            for (int i = 0; i < MR; i++) tile_rows[i] = u + (r + i < r1 ? r + i : r1 - 1) * kp;
            tile_sums(tile_rows, p, k4, isum);
        }
        finish_rows(isum, rows, sx + r, ws, wc, bias, act, fuse, r, n0, y + r * ldy, ldy, cols);
    }
}

/* One input row src (k) into u (kp bytes) and its scale *sx, LayerNorm'ed first (fuse's norm,
 * through `row`, k floats) where row is not NULL. */
static void quantize_input(const float *src, int64_t k, int64_t kp, const W8A8Fuse *fuse, float *row,
                           uint8_t *u, float *sx) {
    if (row != NULL) {
        norm_row(src, k, fuse->norm_w, fuse->norm_b, fuse->eps, row);
        src = row;
    }
    quantize_row(src, k, kp, u, sx);
}

/* y (m, n; row stride ldy) all NaN: what a call whose scratch could not be had returns. */
static void fill_nan(float *y, int64_t ldy, int64_t m, int64_t n) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < n; c++) y[r * ldy + c] = __builtin_nanf("");
}

/* y (m, n; row stride ldy) = act(x (m, k; row stride ldx) W^T + bias (may be NULL)), W packed
 * as at the top (panels, sw, comp); act 0: none, 1: gelu_tanh; fuse: see W8A8Fuse (NULL:
 * none); amx: the AMX path (only once linear_w8a8_amx() returned 1). Scratch for the quantized
 * rows is malloc'ed per call; if it cannot be had, y is filled with NaN.
 *
 * One OpenMP region per call: the rows are quantized (after fuse's norm, through a per-thread
 * row of scratch), then, past the loop's barrier, the products. At DiT sizes (240 rows, K =
 * 256) a second region's start and end were a visible share of a ~50 us call. */
void linear_w8a8(const float *x, int64_t ldx, const int8_t *panels, const float *sw,
                 const int32_t *comp, const float *bias, int32_t act, float *y, int64_t ldy,
                 int64_t m, int64_t n, int64_t k, int32_t amx, const W8A8Fuse *fuse) {
#ifndef W8A8_AMX
    amx = 0;
#endif
    const int64_t k4 = (k + 3) / 4, kp = 4 * k4, num_panels = (n + PANEL - 1) / PANEL;
    const int64_t row_block = amx ? AMX_BLOCK : ROW_BLOCK, blocks = (m + row_block - 1) / row_block;
    const int64_t rows_held = amx ? (m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : m;
    const int norm = fuse != NULL && fuse->norm_w != NULL;
    /* 64-byte aligned: AMX loads its tiles' rows from here */
    uint8_t *u = aligned_alloc(64, (size_t)((rows_held * kp + 63) / 64 * 64 + 64));
    float *sx = malloc(sizeof(float) * (size_t)(m > 0 ? m : 1));
    const int have = u != NULL && sx != NULL;
    int ok = have;                        /* 0 once a thread misses its row of scratch */
    if (have) memset(u + m * kp, 128, (size_t)((rows_held - m) * kp));   /* padding rows: qx = 0 */
    #pragma omp parallel if (have && m * n > 4096)
    {
        float *row = have && norm ? malloc(sizeof(float) * (size_t)(k > 0 ? k : 1)) : NULL;
        if (have && norm && row == NULL) {
            #pragma omp atomic write
            ok = 0;
        }
        /* Without its row a thread quantizes rows un-normed: y is all NaN then anyway. */
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < (have ? m : 0); r++) {
            quantize_input(x + r * ldx, k, kp, fuse, row, u + r * kp, sx + r);
        }                                 /* the loop's barrier: every row quantized */
        free(row);
        if (ok) {
#ifdef W8A8_AMX
            if (amx) amx_configure();
#endif
            #pragma omp for schedule(static)
            for (int64_t item = 0; item < blocks * num_panels; item++) {
                const int64_t b = item / num_panels, j = item % num_panels, n0 = j * PANEL;
                const int64_t r1 = (b + 1) * row_block < m ? (b + 1) * row_block : m;
                rows_of_panel(u, kp, sx, panels + j * k4 * 256, k4, sw + j * PANEL, comp + j * PANEL,
                              bias != NULL ? bias + n0 : NULL, act, fuse, n0, y + n0, ldy, b * row_block, r1,
                              n - n0 < PANEL ? n - n0 : PANEL, amx);
            }
#ifdef W8A8_AMX
            if (amx) _tile_release();
#endif
        }
    }
    if (!ok) fill_nan(y, ldy, m, n);
    free(u);
    free(sx);
}

/* One thread's scratch for linear_w8a8_ffn: a row block's quantized inputs of both products,
 * their scales, a normed row, and the up product's output. NULL members: not allocated. */
typedef struct {
    uint8_t *u1, *u2;
    float *sx1, *sx2, *row, *wide;
} FfnScratch;

static int ffn_scratch(FfnScratch *t, int64_t rows, const W8A8Matrix *up, const W8A8Matrix *down, int norm) {
    const int64_t kp1 = 4 * ((up->k + 3) / 4), kp2 = 4 * ((down->k + 3) / 4);
    t->u1 = aligned_alloc(64, (size_t)((rows * kp1 + 63) / 64 * 64));
    t->u2 = aligned_alloc(64, (size_t)((rows * kp2 + 63) / 64 * 64));
    t->sx1 = malloc(sizeof(float) * (size_t)rows);
    t->sx2 = malloc(sizeof(float) * (size_t)rows);
    t->row = norm ? malloc(sizeof(float) * (size_t)up->k) : NULL;
    t->wide = malloc(sizeof(float) * (size_t)(rows * up->n));
    return t->u1 && t->u2 && t->sx1 && t->sx2 && (t->row || !norm) && t->wide;
}

static void ffn_free(FfnScratch *t) {
    free(t->u1); free(t->u2); free(t->sx1); free(t->sx2); free(t->row); free(t->wide);
}

/* Rows [0, rows) of u (quantized, kp bytes a row; for AMX followed by qx = 0 rows up to whole
 * 32-row tiles) times every panel of w -> y (row stride ldy), act and fuse as linear_w8a8's. */
static void block_product(const uint8_t *u, int64_t kp, const float *sx, int64_t rows,
                          const W8A8Matrix *w, int32_t act, const W8A8Fuse *fuse, float *y, int64_t ldy,
                          int amx) {
    const int64_t k4 = kp / 4;
    for (int64_t n0 = 0; n0 < w->n; n0 += PANEL)
        rows_of_panel(u, kp, sx, w->panels + n0 / PANEL * k4 * 256, k4, w->sw + n0, w->comp + n0,
                      w->bias != NULL ? w->bias + n0 : NULL, act, fuse, n0, y + n0, ldy, 0, rows,
                      w->n - n0 < PANEL ? w->n - n0 : PANEL, amx);
}

/* The DiT's feed-forward, y = down(gelu_tanh(up(x))) with up_fuse's norm before and down_fuse's
 * gated residual after (up_fuse's residual and down_fuse's norm are not taken), row block by
 * row block: a thread quantizes its block's rows, runs the up product with its GELU into its
 * own scratch, quantizes those rows and runs the down product into y, so the (m, up->n)
 * intermediate never leaves the core's cache (960 rows of the small checkpoint's DiT: 1.9 MB
 * written and read back between two linear_w8a8 calls, and a call's fixed costs twice). Each
 * output is what the two calls give: the same rows quantized by the same function, the same
 * integer sums and finishing (the same bits). down->k must equal up->n. With fewer blocks than
 * two a thread: the two calls (a block a thread would leave the other threads idle). */
void linear_w8a8_ffn(const float *x, int64_t ldx, const W8A8Matrix *up, const W8A8Matrix *down,
                     float *y, int64_t ldy, int64_t m, int32_t amx, const W8A8Fuse *up_fuse,
                     const W8A8Fuse *down_fuse) {
#ifndef W8A8_AMX
    amx = 0;
#endif
    const int64_t row_block = amx ? AMX_BLOCK : ROW_BLOCK, blocks = (m + row_block - 1) / row_block;
    if (blocks < 2 * omp_get_max_threads()) {
        float *wide = malloc(sizeof(float) * (size_t)(m * up->n > 0 ? m * up->n : 1));
        if (wide != NULL) {
            linear_w8a8(x, ldx, up->panels, up->sw, up->comp, up->bias, 1, wide, up->n, m, up->n, up->k, amx, up_fuse);
            linear_w8a8(wide, up->n, down->panels, down->sw, down->comp, down->bias, 0, y, ldy, m, down->n,
                        down->k, amx, down_fuse);
        } else {
            fill_nan(y, ldy, m, down->n);
        }
        free(wide);
        return;
    }
    const int norm = up_fuse != NULL && up_fuse->norm_w != NULL;
    const int64_t kp1 = 4 * ((up->k + 3) / 4), kp2 = 4 * ((down->k + 3) / 4);
    int ok = 1;
    #pragma omp parallel
    {
        FfnScratch t;
        if (!ffn_scratch(&t, row_block, up, down, norm)) {
            #pragma omp atomic write
            ok = 0;
        }
#ifdef W8A8_AMX
        if (amx) amx_configure();
#endif
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            int okay;
            #pragma omp atomic read
            okay = ok;
            if (!okay) continue;
            const int64_t r0 = b * row_block, rows = m - r0 < row_block ? m - r0 : row_block;
            for (int64_t i = 0; i < rows; i++)
                quantize_input(x + (r0 + i) * ldx, up->k, kp1, up_fuse, t.row, t.u1 + i * kp1, t.sx1 + i);
            memset(t.u1 + rows * kp1, 128, (size_t)((row_block - rows) * kp1));   /* qx = 0 */
            block_product(t.u1, kp1, t.sx1, rows, up, 1, NULL, t.wide, up->n, amx);
            for (int64_t i = 0; i < rows; i++)
                quantize_row(t.wide + i * up->n, down->k, kp2, t.u2 + i * kp2, t.sx2 + i);
            memset(t.u2 + rows * kp2, 128, (size_t)((row_block - rows) * kp2));
            W8A8Fuse after = {NULL, NULL, 0.0f, NULL, 0, NULL};
            if (down_fuse != NULL && down_fuse->res != NULL) {
                after = *down_fuse;
                after.res += r0 * after.ldr;          /* rows_of_panel counts rows from the block */
            }
            block_product(t.u2, kp2, t.sx2, rows, down, 0, after.res != NULL ? &after : NULL,
                          y + r0 * ldy, ldy, amx);
        }
#ifdef W8A8_AMX
        if (amx) _tile_release();
#endif
        ffn_free(&t);
    }
    if (!ok) fill_nan(y, ldy, m, down->n);
}

/* The entries have the signatures their callers by pointer declare (linear_w8a8.h). */
_Static_assert(__builtin_types_compatible_p(__typeof__(&linear_w8a8), w8a8_fn), "linear_w8a8 signature");
_Static_assert(__builtin_types_compatible_p(__typeof__(&linear_w8a8_ffn), w8a8_ffn_fn), "linear_w8a8_ffn signature");

/* 1 where this build multiplies with VNNI (AVX-512 or AVX-VNNI: the fast paths), 0 on the
 * plain C path. */
int linear_w8a8_vnni(void) {
#if defined(W8A8_VNNI) || defined(W8A8_AVX_VNNI)
    return 1;
#else
    return 0;
#endif
}

/* 1 where this build has the AMX path and the OS lets this process use the tiles (Linux asks
 * each process to request them: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA), else 0. */
int linear_w8a8_amx(void) {
#ifdef W8A8_AMX
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    return 0;
#endif
}
