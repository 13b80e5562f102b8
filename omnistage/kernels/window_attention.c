/* Block-window attention (Qwen2.5-Omni's token2wav DiT): the frames of each row are cut into
 * blocks of BLOCK; every query of block j sees the keys of blocks j - back .. j + ahead.
 *
 * The PyTorch path builds each block's key and value windows (a copy of K and V per window
 * slot), reshapes queries and outputs to and from (block, head) order, and calls SDPA with a
 * boolean mask over many tiny (BLOCK x window) problems, where its per-problem overhead is
 * most of the time. Here one call reads q, k and v where the fused q|k|v projection wrote
 * them and writes the output in the layout the output projection takes.
 *
 * Compiled per shape (HEAD_DIM, BLOCK as -D constants, see window_attention.py), and per
 * dtype of qkv and out: float32, or bfloat16 with IO_BF16 defined (the DiT's bf16 GEMMs write
 * qkv and read out in bf16: each value is widened exactly as it is read, every sum is float32
 * as in the float32 build, and out is rounded as torch rounds float32 to bf16, so the result
 * is bit for bit the float32 build's on the widened qkv, rounded; no float32 copy of either).
 *
 * Layouts (io_t: float32 or bf16, contiguous; rope float32):
 *   qkv     (B, T, 3, H, HEAD_DIM)  T = nb * BLOCK frames per row; q, k, v of each frame
 *   lengths (B,) int64              valid frames of each row (the rest is padding)
 *   rope    (B, T, HEAD_DIM/2, 2)   cos, sin of each frame's angles, or NULL: head 0 of q and
 *                                   k is rotated as it is read, pairs (2i, 2i+1) as the complex
 *                                   number x_2i + i x_2i+1 times cos + i sin (the checkpoint's
 *                                   RoPE: head 0 only, interleaved pairs); qkv is not written
 *   out     (B, T, H * HEAD_DIM)
 *
 * Which keys a query sees (the same as token2wav_dit.window_mask with SDPA): a valid query
 * (frame < lengths[b]) sees the valid keys of its window; a padding query sees its whole
 * window, where the blocks outside the row are zero keys and zero values (its output is never
 * used; it must only be finite). Every valid query sees at least itself.
 *
 * Numerics: scores are float32 dot products of the scaled query with each key; softmax
 * subtracts the row's maximum, exponentiates with vexp (about 2 ulp) and divides the weighted
 * sum of V by the sum of the weights at the end. Only the order of additions differs from
 * softmax(q k^T) v.
 *
 * Work: one task per (row, block, head), split with OpenMP (torch's runtime, as the other
 * kernels). Four queries at a time share each load of K (scores) and of V (weighted sums).
 * A task transposes its window's keys 16 x 16 at a time in registers (transpose16) and keeps
 * each query's running maximum in a vector: as scalar stores and a 15-step lane maximum per
 * score vector they were ~a third of a task (small checkpoint, 240 rows, one thread: a layer
 * of 24-key windows 148 -> 109 us, of 48-key ones 223 -> 186 us; the same bits). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if HEAD_DIM % 16 != 0 || BLOCK % 4 != 0
#error "HEAD_DIM must be a multiple of 16 and BLOCK a multiple of 4"
#endif

#include "vec16.h"                    /* vf (16 lanes), load, store, splat, vexp, max / sum */

#define CHUNKS (HEAD_DIM / LANES)

#ifdef IO_BF16
typedef uint16_t io_t;
static inline vf load_io(const io_t *p) { return load_bf16(p); }
static inline float io_float(io_t x) { return bf16_float(x); }
static inline void store_io(io_t *p, vf v) { store_bf16(p, v); }
#else
typedef float io_t;
static inline vf load_io(const io_t *p) { return load(p); }
static inline float io_float(io_t x) { return x; }
static inline void store_io(io_t *p, vf v) { store(p, v); }
#endif
#define MAX_SLOTS 8                   /* blocks per window: back + 1 + ahead <= MAX_SLOTS */
#define MAX_KEYS (MAX_SLOTS * BLOCK)
/* Partial sums per score vector: two chains per query where there are 32 vector registers
 * (8 accumulators in flight), one where 16 (AVX2: two registers per vector). */
#ifdef __AVX512F__
#define SPLIT 2
#else
#define SPLIT 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define NARROW 1                      /* 8-lane registers, written as such (weights4) */
/* The largest lane of v (max is exact: the same value as max_lanes in any order). */
static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
#endif

/* One thread's scratch. Rows of kt, s and allowed are `span` floats apart: the window's keys
 * rounded up to whole vectors (not MAX_KEYS: the transposed keys then stay in L1). */
typedef struct {
    float q[BLOCK][HEAD_DIM];         /* scaled queries */
    const io_t *v[MAX_KEYS];          /* each key's value row, NULL outside the row */
    int64_t span;
    float *kt;                        /* (HEAD_DIM, span) the window's keys, transposed; zeros
                                         outside the row */
    float *s;                         /* (BLOCK, span) scores, then weights */
    float *allowed;                   /* (2, span) 0 / -inf per key: valid queries, padding ones */
} Scratch;

#define KT(w, d) ((w)->kt + (d) * (w)->span)
#define S(w, r) ((w)->s + (r) * (w)->span)
#define ALLOWED(w, pad) ((w)->allowed + (pad) * (w)->span)

typedef struct {
    const io_t *qkv;
    io_t *out;
    const int64_t *lengths;
    const float *rope;
    int64_t frames, heads, back, ahead;
    float scale;
} Problem;

/* Head vector x of frame t of row b into dst[d * stride], rotated where the problem has RoPE
 * and the head is 0, times `mul`. */
static inline void read_head(const Problem *p, const io_t *x, int64_t b, int64_t t, int64_t h,
                             float mul, float *dst, int64_t stride) {
    if (p->rope == NULL || h != 0) {
        for (int d = 0; d < HEAD_DIM; d++) dst[d * stride] = io_float(x[d]) * mul;
        return;
    }
    const float *r = p->rope + (b * p->frames + t) * HEAD_DIM;     /* (HEAD_DIM/2, 2) */
    for (int i = 0; i < HEAD_DIM / 2; i++) {
        const float x0 = io_float(x[2 * i]), x1 = io_float(x[2 * i + 1]), c = r[2 * i], sn = r[2 * i + 1];
        dst[2 * i * stride] = (x0 * c - x1 * sn) * mul;
        dst[(2 * i + 1) * stride] = (x1 * c + x0 * sn) * mul;
    }
}

/* One step b (8, 4, 2 or 1; the indices LOb, HIb) of a 16 x 16 transpose, on rows a and c = a
 * + b: a's lanes whose bit b is set trade places with c's lanes whose bit b is clear. The four
 * steps over 16 rows transpose them (each swaps the off-diagonal b x b blocks of every 2b x 2b
 * block). */
#define SWAP_BLOCKS(a, c, I0, I1)                                                         \
    do {                                                                                      \
        const vf a_ = (a), c_ = (c);                                                          \
        (a) = __builtin_shufflevector(a_, c_, I0);                                            \
        (c) = __builtin_shufflevector(a_, c_, I1);                                            \
    } while (0)
#define LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31

static inline void transpose16(vf m[16]) {
    for (int i = 0; i < 8; i++) SWAP_BLOCKS(m[i], m[i + 8], LO8, HI8);
    for (int i = 0; i < 16; i++) if (!(i & 4)) SWAP_BLOCKS(m[i], m[i + 4], LO4, HI4);
    for (int i = 0; i < 16; i++) if (!(i & 2)) SWAP_BLOCKS(m[i], m[i + 2], LO2, HI2);
    for (int i = 0; i < 16; i++) if (!(i & 1)) SWAP_BLOCKS(m[i], m[i + 1], LO1, HI1);
}

/* Keys rows[0 .. n) (n <= 16, HEAD_DIM floats each) into columns kk0 .. kk0 + n of KT, 16 x 16
 * blocks at a time through transpose16 (the rows past n zero; only n lanes are stored). */
static void keys_to_columns(Scratch *w, const float (*rows)[HEAD_DIM], int n, int64_t kk0) {
    for (int d0 = 0; d0 < HEAD_DIM; d0 += LANES) {
        vf m[16];
        for (int r = 0; r < 16; r++) m[r] = r < n ? load(rows[r] + d0) : (vf){};
        transpose16(m);
        for (int d = 0; d < LANES; d++) {
            if (n == 16) store(KT(w, d0 + d) + kk0, m[d]);
            else __builtin_memcpy(KT(w, d0 + d) + kk0, &m[d], (size_t)n * sizeof(float));
        }
    }
}

/* The window of block j in row b, head h: keys transposed, value rows, masks. Returns the
 * number of keys (slots * BLOCK). */
static int64_t gather_window(Scratch *w, const Problem *p, int64_t b, int64_t j, int64_t h) {
    const int64_t hd = p->heads * HEAD_DIM, frame = 3 * hd, nb = p->frames / BLOCK;
    const int64_t slots = p->back + 1 + p->ahead, keys = slots * BLOCK, len = p->lengths[b];
    const io_t *row = p->qkv + b * p->frames * frame;
    float block[BLOCK][HEAD_DIM];                  /* the slot's keys, row by row */
    for (int64_t i = 0; i < slots; i++) {
        const int64_t jb = j - p->back + i;
        const int inside = jb >= 0 && jb < nb;
        for (int64_t r = 0; r < BLOCK; r++) {
            const int64_t kk = i * BLOCK + r, t = jb * BLOCK + r;
            if (inside) {
                read_head(p, row + t * frame + hd + h * HEAD_DIM, b, t, h, 1.0f, block[r], 1);
                w->v[kk] = row + t * frame + 2 * hd + h * HEAD_DIM;
            } else {
                w->v[kk] = NULL;
            }
            ALLOWED(w, 0)[kk] = inside && t < len ? 0.0f : -INFINITY;
            ALLOWED(w, 1)[kk] = 0.0f;
        }
        if (!inside)
            memset(block, 0, sizeof block);
        for (int r0 = 0; r0 < BLOCK; r0 += 16)
            keys_to_columns(w, (const float (*)[HEAD_DIM])block + r0, BLOCK - r0 < 16 ? BLOCK - r0 : 16,
                            i * BLOCK + r0);
    }
    return keys;
}

/* The lanes past the window (keys .. span): zero keys, never allowed. The same for every task
 * of a call (the window's width is the call's), so set once per thread. */
static void past_window(Scratch *w, int64_t keys) {
    for (int64_t kk = keys; kk < w->span; kk++) {
        for (int d = 0; d < HEAD_DIM; d++) KT(w, d)[kk] = 0.0f;
        ALLOWED(w, 0)[kk] = ALLOWED(w, 1)[kk] = -INFINITY;
    }
}

/* Scores of queries r0..r0+3 against every key, masked, turned into weights; returns their
 * sums in sums[0..3]. */
static void weights4(Scratch *w, int64_t r0, const int pad[4], float sums[4]) {
    const int64_t span = w->span;
    float mx[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#ifndef NARROW
    vf mv[4] = {splat(-INFINITY), splat(-INFINITY), splat(-INFINITY), splat(-INFINITY)};  /* per lane */
#endif
    for (int64_t k0 = 0; k0 < span; k0 += LANES) {
#ifdef NARROW
        /* 8-lane registers: 4 queries x 2 halves of the 16 keys (with 16-lane vector types GCC
         * kept the sums on the stack and moved them through general registers: the kernel ran
         * at 16 GFLOP/s against 97 with AVX-512). The same FMA chain per lane, so the same bits. */
        __m256 a[4][2];
        for (int g = 0; g < 4; g++) a[g][0] = a[g][1] = _mm256_setzero_ps();
        for (int d = 0; d < HEAD_DIM; d++) {
            const __m256 k_lo = _mm256_loadu_ps(KT(w, d) + k0), k_hi = _mm256_loadu_ps(KT(w, d) + k0 + 8);
            for (int g = 0; g < 4; g++) {
                const __m256 qd = _mm256_broadcast_ss(&w->q[r0 + g][d]);
                a[g][0] = _mm256_fmadd_ps(qd, k_lo, a[g][0]);
                a[g][1] = _mm256_fmadd_ps(qd, k_hi, a[g][1]);
            }
        }
        for (int g = 0; g < 4; g++) {
            const float *allowed = ALLOWED(w, pad[g]) + k0;
            const __m256 lo = _mm256_add_ps(_mm256_loadu_ps(allowed), a[g][0]);
            const __m256 hi = _mm256_add_ps(_mm256_loadu_ps(allowed + 8), a[g][1]);
            _mm256_storeu_ps(S(w, r0 + g) + k0, lo);
            _mm256_storeu_ps(S(w, r0 + g) + k0 + 8, hi);
            const float m = max8(_mm256_max_ps(lo, hi));
            mx[g] = m > mx[g] ? m : mx[g];
        }
#else
        vf a[4][SPLIT];
        for (int g = 0; g < 4; g++)
            for (int i = 0; i < SPLIT; i++) a[g][i] = (vf){};
        for (int d = 0; d < HEAD_DIM; d += SPLIT)
            for (int i = 0; i < SPLIT; i++) {
                const vf k = load(KT(w, d + i) + k0);
                for (int g = 0; g < 4; g++) a[g][i] += w->q[r0 + g][d + i] * k;
            }
        for (int g = 0; g < 4; g++) {
            vf sc = load(ALLOWED(w, pad[g]) + k0);
            for (int i = 0; i < SPLIT; i++) sc += a[g][i];
            store(S(w, r0 + g) + k0, sc);
            mv[g] = vmax(mv[g], sc);
        }
#endif
    }
#ifndef NARROW
    for (int g = 0; g < 4; g++) mx[g] = max_tree(mv[g]);
#endif
    for (int g = 0; g < 4; g++) {
        vf total = (vf){};
        for (int64_t k0 = 0; k0 < span; k0 += LANES) {
            const vf e = vexp(load(S(w, r0 + g) + k0) - mx[g]);
            store(S(w, r0 + g) + k0, e);
            total += e;
        }
        sums[g] = sum_lanes(total);
    }
}

static void attend_block(Scratch *w, const Problem *p, int64_t b, int64_t j, int64_t h) {
    const int64_t hd = p->heads * HEAD_DIM, frame = 3 * hd;
    const int64_t keys = gather_window(w, p, b, j, h), first = j * BLOCK;
    const io_t *q = p->qkv + (b * p->frames + first) * frame + h * HEAD_DIM;
    for (int64_t r = 0; r < BLOCK; r++) read_head(p, q + r * frame, b, first + r, h, p->scale, w->q[r], 1);
    io_t *out = p->out + (b * p->frames + first) * hd + h * HEAD_DIM;
    for (int64_t r0 = 0; r0 < BLOCK; r0 += 4) {
        int pad[4];
        float sums[4];
        for (int g = 0; g < 4; g++) pad[g] = first + r0 + g >= p->lengths[b];
        weights4(w, r0, pad, sums);
#ifdef __AVX512F__
        /* All four outputs at once (4 x CHUNKS accumulators of the 32 registers): each key's V
         * row and its four weights loaded once. */
        vf o[4][CHUNKS] = {};
        for (int64_t kk = 0; kk < keys; kk++) {
            const io_t *v = w->v[kk];
            if (v == NULL) continue;                        /* a zero value row */
            vf vr[CHUNKS];
            for (int c = 0; c < CHUNKS; c++) vr[c] = load_io(v + c * LANES);
            for (int g = 0; g < 4; g++) {
                const float e = S(w, r0 + g)[kk];
                for (int c = 0; c < CHUNKS; c++) o[g][c] += e * vr[c];
            }
        }
        for (int g = 0; g < 4; g++)
            for (int c = 0; c < CHUNKS; c++) store_io(out + (r0 + g) * hd + c * LANES, o[g][c] * (1.0f / sums[g]));
#elif defined(NARROW)
        /* One 16-value chunk of the four outputs at a time: 4 accumulators (8 registers where
         * vectors are 256 bits, written as such: see weights4), each V chunk loaded once for
         * the four. The same additions in the same order as above. */
        for (int c = 0; c < CHUNKS; c++) {
            vf_halves o[4];
            for (int g = 0; g < 4; g++) o[g].h[0] = o[g].h[1] = _mm256_setzero_ps();
            for (int64_t kk = 0; kk < keys; kk++) {
                const io_t *v = w->v[kk];
                if (v == NULL) continue;                    /* a zero value row */
                const vf_halves vr = {load_io(v + c * LANES)};
                for (int g = 0; g < 4; g++) {
                    const __m256 e = _mm256_broadcast_ss(S(w, r0 + g) + kk);
                    o[g].h[0] = _mm256_fmadd_ps(e, vr.h[0], o[g].h[0]);
                    o[g].h[1] = _mm256_fmadd_ps(e, vr.h[1], o[g].h[1]);
                }
            }
            for (int g = 0; g < 4; g++) store_io(out + (r0 + g) * hd + c * LANES, o[g].v * (1.0f / sums[g]));
        }
#else
        /* The same, in the generic vector types (CPUs without AVX2). */
        for (int c = 0; c < CHUNKS; c++) {
            vf o[4] = {};
            for (int64_t kk = 0; kk < keys; kk++) {
                const io_t *v = w->v[kk];
                if (v == NULL) continue;                    /* a zero value row */
                const vf vr = load_io(v + c * LANES);
                for (int g = 0; g < 4; g++) o[g] += S(w, r0 + g)[kk] * vr;
            }
            for (int g = 0; g < 4; g++) store_io(out + (r0 + g) * hd + c * LANES, o[g] * (1.0f / sums[g]));
        }
#endif
    }
}

/* Returns 0, -1 when a thread could not allocate its scratch, -2 for a window wider than
 * MAX_SLOTS blocks or frames not a whole number of blocks. */
int window_attention(const io_t *qkv, io_t *out, const int64_t *lengths, const float *rope,
                         int64_t batch, int64_t frames, int64_t heads, int64_t back, int64_t ahead,
                         float scale) {
    if (back < 0 || ahead < 0 || back + 1 + ahead > MAX_SLOTS || frames % BLOCK) return -2;
    const Problem p = {qkv, out, lengths, rope, frames, heads, back, ahead, scale};
    const int64_t nb = frames / BLOCK, tasks = batch * nb * heads;
    const int64_t span = ((back + 1 + ahead) * BLOCK + LANES - 1) / LANES * LANES;
    const size_t head = (sizeof(Scratch) + 63) / 64 * 64;
    const size_t bytes = head + (HEAD_DIM + BLOCK + 2) * span * sizeof(float);
    int failed = 0;
    #pragma omp parallel if (tasks > 1)
    {
        Scratch *w = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (w == NULL) {
            #pragma omp atomic write
            failed = 1;
        } else {
            w->span = span;
            w->kt = (float *)((char *)w + head);
            w->s = w->kt + HEAD_DIM * span;
            w->allowed = w->s + BLOCK * span;
            past_window(w, (back + 1 + ahead) * BLOCK);
        }
        #pragma omp for schedule(static)
        for (int64_t k = 0; k < tasks; k++) {
            if (w == NULL) continue;
            attend_block(w, &p, k / (nb * heads), k / heads % nb, k % heads);
        }
        free(w);
    }
    return failed ? -1 : 0;
}
