/* Attention over a paged KV cache, for CPUs, reading K and V straight from the cache blocks.
 *
 * The PyTorch path gathers contexts into contiguous buffers first (a copy of all of K and V
 * per layer and step) and then runs batched matmuls or SDPA over them; these kernels read
 * each K and V row where it lies. They are compiled on first use for one model's shape
 * (HEAD_DIM, GROUP, BLOCK as -D constants, see omnistage/kernels/paged_attention.py), so
 * every inner loop has a fixed trip count and the compiler keeps accumulators in registers.
 *
 * - paged_decode_f32: one query token per sequence (G query heads per KV head) against its
 *   whole context. Scores for 16 keys at a time: 16 dot products, then one transpose-add
 *   tree turns them into a 16-lane vector (with 256-bit vectors: two trees of 8, SCORES_8).
 * - paged_prefill_f32: chunks of query tokens, each token seeing the keys up to its own
 *   position (a prefix already cached plus the chunk itself, causally). Tiles of 16 query
 *   tokens x G heads; per 16-key span, K is transposed once into a small buffer so each
 *   query's 16 scores are broadcast FMAs; online softmax; spans past a row's position are
 *   never computed (the causal half of the work is skipped, not masked).
 *
 * The cache holds float32, or bfloat16 when built with KV_BF16 (kv_cache_dtype=bfloat16): K
 * and V rows are widened to float32 as they are loaded (exact), and rope_write rounds the new
 * rows to nearest-even as it stores them (as torch's .to(torch.bfloat16) does); every other
 * value stays float32.
 *
 * Layouts (float32 unless said; contiguous except where said):
 *   q      (T, Hkv * GROUP, HEAD_DIM)   query heads h*GROUP .. h*GROUP+GROUP-1 share KV head h;
 *                                        row t starts at q + t * q_stride (rows may be views
 *                                        into a wider projection output)
 *   kv     (2, Hkv, num_blocks, BLOCK, HEAD_DIM)   K planes, then V planes (kv_t)
 *   tables (N, width) int64              block ids of each context, padded past its end
 *   out    (T, Hkv * GROUP, HEAD_DIM)   contiguous
 *
 * Numerics: scores are float32 dot products; softmax subtracts the row max (a running max
 * for prefill), exponentiates with a polynomial exp (about 2 ulp) and divides the weighted
 * sum of V by the sum of the weights at the end. Only the order of additions differs from
 * softmax(q k^T) v.
 *
 * Work is split with OpenMP: torch's own OpenMP runtime (the library links libgomp by
 * soname, which torch has loaded already), so torch.set_num_threads governs it too. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if HEAD_DIM % 16 != 0 || BLOCK % 16 != 0
#error "HEAD_DIM and BLOCK must be multiples of 16"
#endif

#include "vec16.h"                    /* vf, vi (16 lanes), load, store, splat, vexp */

#define CHUNKS (HEAD_DIM / LANES)

#ifdef KV_BF16
typedef uint16_t kv_t;
static inline vf load_kv(const kv_t *p) { return load_bf16(p); }
static inline float kv_float(kv_t x) { return bf16_float(x); }
static inline kv_t kv_store(float x) { return float_bf16(x); }
#else
typedef float kv_t;
static inline vf load_kv(const kv_t *p) { return load(p); }
static inline float kv_float(kv_t x) { return x; }
static inline kv_t kv_store(float x) { return x; }
#endif

/* Lane t of the result is the sum of the lanes of a[t]. */
static inline vf sum_lanes16(const vf a[16]) {
    vf b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = __builtin_shufflevector(a[2*i], a[2*i+1], 0,1,2,3,4,5,6,7, 16,17,18,19,20,21,22,23)
             + __builtin_shufflevector(a[2*i], a[2*i+1], 8,9,10,11,12,13,14,15, 24,25,26,27,28,29,30,31);
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shufflevector(b[2*i], b[2*i+1], 0,1,2,3, 8,9,10,11, 16,17,18,19, 24,25,26,27)
             + __builtin_shufflevector(b[2*i], b[2*i+1], 4,5,6,7, 12,13,14,15, 20,21,22,23, 28,29,30,31);
    for (int i = 0; i < 2; i++)
        d[i] = __builtin_shufflevector(c[2*i], c[2*i+1], 0,1, 4,5, 8,9, 12,13, 16,17, 20,21, 24,25, 28,29)
             + __builtin_shufflevector(c[2*i], c[2*i+1], 2,3, 6,7, 10,11, 14,15, 18,19, 22,23, 26,27, 30,31);
    return __builtin_shufflevector(d[0], d[1], 0,2,4,6,8,10,12,14,16,18,20,22,24,26,28,30)
         + __builtin_shufflevector(d[0], d[1], 1,3,5,7,9,11,13,15,17,19,21,23,25,27,29,31);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* Where vectors are 256 bits, the 16-key scores as two halves of 8 keys: 16 accumulators of
 * 16 lanes (and the 16-lane queries) are 64 of AVX2's 16 registers, and half of the decode's
 * instructions were spills (measured: 80 us for one sequence of 150 keys, 8 heads). Here 8
 * accumulators of 8 lanes, the query read from L1, and an hadd tree: the same products, summed
 * in another order than the 16-lane tree. */
#define SCORES_8 1
/* Output values per pass over the keys in the P V sums: GROUP x PV_WIDTH / 8 accumulators of
 * 8 lanes, at most 12 of the 16 registers. */
#define PV_WIDTH (GROUP <= 6 ? 16 : 8)
#include <immintrin.h>
static inline __m256 load8_kv(const kv_t *p) {
#ifdef KV_BF16
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
    return _mm256_loadu_ps(p);
#endif
}

/* Lane t: the dot product of q (HEAD_DIM) with the key at k + t * HEAD_DIM, t < 8. */
static inline __m256 dots8(const float *restrict q, const kv_t *restrict k) {
    __m256 a[8];
    for (int t = 0; t < 8; t++) a[t] = _mm256_loadu_ps(q) * load8_kv(k + t * HEAD_DIM);
    for (int c = 8; c < HEAD_DIM; c += 8) {
        const __m256 qc = _mm256_loadu_ps(q + c);
        for (int t = 0; t < 8; t++) a[t] += qc * load8_kv(k + t * HEAD_DIM + c);
    }
    /* u: sums of quarters 0-3 of a[0..3] (low half) and of 4-7 (high half); v: a[4..7] */
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 v = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_permute2f128_ps(u, v, 0x20) + _mm256_permute2f128_ps(u, v, 0x31);
}

/* o[g] += p[g * stride] * (PV_WIDTH values of one key's V row at vt), for the G heads: the
 * P V step of the decode and of the prefill (each output a chain of FMAs over the keys). */
static inline void add_pv8(__m256 o[GROUP][PV_WIDTH / 8], const kv_t *restrict vt,
                           const float *restrict p, int64_t stride) {
    __m256 v[PV_WIDTH / 8];
    for (int h = 0; h < PV_WIDTH / 8; h++) v[h] = load8_kv(vt + 8 * h);
    for (int g = 0; g < GROUP; g++) {
        const __m256 pg = _mm256_broadcast_ss(p + g * stride);
        for (int h = 0; h < PV_WIDTH / 8; h++) o[g][h] = _mm256_fmadd_ps(pg, v[h], o[g][h]);
    }
}
#endif

/* Software prefetch while the scores of keys key0 .. key0 + 15 are computed: the next span's
 * K rows (into L1: the next iteration reads them) and this span's V rows (into L2: the P V
 * passes read them after all scores). A span is 4 KB or less of each plane; its block lies
 * anywhere in the cache (the blocks of a context are not adjacent, and the hardware prefetcher
 * stops at every 4 KB page), so without this each span began with cold misses: decode
 * attention of 64 sequences x 130-255 keys, 12 layers, cache past L2, 13.6 -> 9.3 ms (AVX2
 * build; AVX-512 9.6 -> 7.8). Prefetching changes no arithmetic. always_inline: GCC judged a
 * helper that only prefetches free of side effects and deleted its calls (no prefetch was left
 * in the library) unless it was inlined first. */
static inline __attribute__((always_inline)) void prefetch_span(const kv_t *restrict k_plane, const kv_t *restrict v_plane,
                                 const int64_t *restrict table, int64_t key0, int64_t len) {
    const int64_t next = key0 + LANES < len ? key0 + LANES : key0;
    const char *k = (const char *)(k_plane + (table[next / BLOCK] * BLOCK + next % BLOCK) * HEAD_DIM);
    const char *v = (const char *)(v_plane + (table[key0 / BLOCK] * BLOCK + key0 % BLOCK) * HEAD_DIM);
    for (int b = 0; b < (int)(LANES * HEAD_DIM * sizeof(kv_t)); b += 64) {
        __builtin_prefetch(k + b, 0, 3);
        __builtin_prefetch(v + b, 0, 2);
    }
}

/* One (sequence, KV head): GROUP queries over `len` keys. `s` holds GROUP * padded scores. */
static void attend(const float *restrict q, const kv_t *restrict k_plane,
                   const kv_t *restrict v_plane, const int64_t *restrict table, int64_t len,
                   float scale, float *restrict s, float *restrict out) {
    const int64_t padded = (len + LANES - 1) / LANES * LANES;
    const int64_t spans = padded / LANES;             /* 16-key spans of the context */
    vf qv[GROUP][CHUNKS], row_max[GROUP];
    for (int g = 0; g < GROUP; g++) {
        for (int c = 0; c < CHUNKS; c++) qv[g][c] = load(q + g * HEAD_DIM + c * LANES) * scale;
        row_max[g] = splat(-INFINITY);
    }
#ifdef SCORES_8
    float qs[GROUP][HEAD_DIM];                        /* the scaled queries, read from L1 */
    for (int g = 0; g < GROUP; g++)
        for (int c = 0; c < CHUNKS; c++) store(qs[g] + c * LANES, qv[g][c]);
#endif
    /* Scores: span i covers keys 16i .. 16i+15 of block table[16i / BLOCK]. */
    for (int64_t i = 0; i < spans; i++) {
        const int64_t key0 = i * LANES;
        const kv_t *kb = k_plane + (table[key0 / BLOCK] * BLOCK + key0 % BLOCK) * HEAD_DIM;
        prefetch_span(k_plane, v_plane, table, key0, len);
        for (int g = 0; g < GROUP; g++) {
#ifdef SCORES_8
            vf_halves halves;
            halves.h[0] = dots8(qs[g], kb);
            halves.h[1] = dots8(qs[g], kb + 8 * HEAD_DIM);
            vf sc = halves.v;
#else
            vf acc[LANES];
            for (int t = 0; t < LANES; t++) {
                vf a = qv[g][0] * load_kv(kb + t * HEAD_DIM);
                for (int c = 1; c < CHUNKS; c++) a += qv[g][c] * load_kv(kb + t * HEAD_DIM + c * LANES);
                acc[t] = a;
            }
            vf sc = sum_lanes16(acc);
#endif
            if (key0 + LANES > len)                   /* keys past the context: weight 0 */
                for (int t = (int)(len - key0); t < LANES; t++) sc[t] = -INFINITY;
            row_max[g] = vmax(row_max[g], sc);
            store(s + g * padded + key0, sc);
        }
    }
    float inv_sum[GROUP];
    for (int g = 0; g < GROUP; g++) {
        const vf m = splat(max_lanes(row_max[g]));
        float *sg = s + g * padded;
        vf total = {};
        for (int64_t t = 0; t < padded; t += LANES) {
            const vf e = vexp(load(sg + t) - m);
            total += e;
            store(sg + t, e);
        }
        inv_sum[g] = 1.0f / sum_lanes(total);
    }
#ifdef SCORES_8
    /* PV_WIDTH values of the heads' outputs at a time, in 8-lane registers (GROUP x PV_WIDTH / 8
     * accumulators, at most 12 of the 16): the keys walked HEAD_DIM / PV_WIDTH times, each
     * output summed over them in the same order as the 16-lane path, so the same bits. Written
     * with 16-lane vector types, GCC kept these accumulators on the stack and moved them
     * through general registers at every key (~100 instructions a key and chunk, where 14 do:
     * decode attention at 21 GFLOP/s, against 62-92 with AVX-512). */
    for (int c = 0; c < HEAD_DIM; c += PV_WIDTH) {
        __m256 o[GROUP][PV_WIDTH / 8];
        for (int g = 0; g < GROUP; g++)
            for (int h = 0; h < PV_WIDTH / 8; h++) o[g][h] = _mm256_setzero_ps();
        for (int64_t t = 0; t < len; t++)
            add_pv8(o, v_plane + (table[t / BLOCK] * BLOCK + t % BLOCK) * HEAD_DIM + c, s + t, padded);
        for (int g = 0; g < GROUP; g++)
            for (int h = 0; h < PV_WIDTH / 8; h++)
                _mm256_storeu_ps(out + g * HEAD_DIM + c + 8 * h, o[g][h] * _mm256_set1_ps(inv_sum[g]));
    }
#else
    vf o[GROUP][CHUNKS];
    for (int g = 0; g < GROUP; g++)
        for (int c = 0; c < CHUNKS; c++) o[g][c] = (vf){};
    for (int64_t t = 0; t < len; t++) {
        const kv_t *vt = v_plane + (table[t / BLOCK] * BLOCK + t % BLOCK) * HEAD_DIM;
        vf v[CHUNKS];
        for (int c = 0; c < CHUNKS; c++) v[c] = load_kv(vt + c * LANES);
        for (int g = 0; g < GROUP; g++) {
            const vf p = splat(s[g * padded + t]);
            for (int c = 0; c < CHUNKS; c++) o[g][c] += p * v[c];
        }
    }
    for (int g = 0; g < GROUP; g++)
        for (int c = 0; c < CHUNKS; c++) store(out + g * HEAD_DIM + c * LANES, o[g][c] * inv_sum[g]);
#endif
}

/* Decodes: sequence b's query is row b of q, its context lens[b] keys (>= 1) in the blocks of
 * tables row b. Returns 0, or -1 when a thread could not allocate its score buffer (out is
 * then undefined). */
int paged_decode_f32(const float *restrict q, int64_t q_stride, const void *kv_cache,
                     const int64_t *restrict tables, const int64_t *restrict lens,
                     float *restrict out, int64_t batch, int64_t kv_heads, int64_t num_blocks,
                     int64_t width, float scale) {
    const kv_t *kv = kv_cache;
    const int64_t plane = num_blocks * BLOCK * HEAD_DIM;
    const int64_t tasks = batch * kv_heads;
    int failed = 0;
    #pragma omp parallel
    {
        float *s = malloc(sizeof(float) * GROUP * (width * BLOCK + LANES));
        if (s == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        /* Longest contexts first (callers sort by length, shortest first): the last tasks
         * handed out are the short ones, so threads finish together. */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = tasks - 1; task >= 0; task--) {
            if (s == NULL) continue;
            const int64_t b = task / kv_heads, h = task % kv_heads;
            const int64_t head0 = (b * kv_heads + h) * GROUP;
            attend(q + b * q_stride + h * GROUP * HEAD_DIM, kv + h * plane, kv + (kv_heads + h) * plane,
                   tables + b * width, lens[b], scale, s, out + head0 * HEAD_DIM);
        }
        free(s);
    }
    return failed ? -1 : 0;
}

/* ---- prefill ----------------------------------------------------------------------------- */

#define ROWS 16                       /* query tokens per tile */
#define QV (ROWS * GROUP)             /* query vectors per tile */

typedef struct {
    int64_t span, head, row0;         /* chunk, KV head, first query token of the chunk */
    int64_t rows, pos0, cost;         /* tokens, position of the first, keys x tokens */
} Tile;

static int by_cost_desc(const void *a, const void *b) {
    const int64_t x = ((const Tile *)a)->cost, y = ((const Tile *)b)->cost;
    return (x < y) - (x > y);
}

typedef struct {                      /* one thread's scratch */
    float q[QV][HEAD_DIM];            /* scaled queries of the tile */
    float o[QV][HEAD_DIM];            /* running sums of weighted V rows */
    float kt[HEAD_DIM][LANES];        /* the current 16-key span of K, transposed */
    vf l[QV];                         /* running sums of weights, per lane */
    float m[QV];                      /* running maxima */
} Scratch;

#ifdef SCORES_8
/* The prefill's two steps of one query row in 8-lane registers (with 16-lane vector types
 * GCC kept their accumulators on the stack: prefill attention ran at 30 GFLOP/s against 150
 * with AVX-512). The same FMAs in the same order as the 16-lane code below, so the same bits.
 * Scores of keys 8 half .. 8 half + 7 of the span for the row's G heads, lanes `half` of sc. */
static inline void scores_row8(const Scratch *w, int64_t j0, int half, vf_halves sc[GROUP], int lane) {
    __m256 a[GROUP][2];
    for (int g = 0; g < GROUP; g++) a[g][0] = a[g][1] = _mm256_setzero_ps();
    for (int d = 0; d < HEAD_DIM; d += 2) {
        const __m256 k_even = _mm256_loadu_ps(w->kt[d] + 8 * half);
        const __m256 k_odd = _mm256_loadu_ps(w->kt[d + 1] + 8 * half);
        for (int g = 0; g < GROUP; g++) {
            a[g][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(&w->q[j0 + g][d]), k_even, a[g][0]);
            a[g][1] = _mm256_fmadd_ps(_mm256_broadcast_ss(&w->q[j0 + g][d + 1]), k_odd, a[g][1]);
        }
    }
    for (int g = 0; g < GROUP; g++) sc[g].h[lane] = _mm256_add_ps(a[g][0], a[g][1]);
}

/* o (the row's G heads) = o * corr + sum over the span's first `valid` keys of p V, PV_WIDTH
 * values at a time. */
static inline void pv_row8(Scratch *w, int64_t j0, const vf p[GROUP], const float corr[GROUP],
                           const kv_t *restrict vb, int valid) {
    float pw[GROUP][LANES];
    for (int g = 0; g < GROUP; g++) store(pw[g], p[g]);
    for (int c = 0; c < HEAD_DIM; c += PV_WIDTH) {
        __m256 o[GROUP][PV_WIDTH / 8];
        for (int g = 0; g < GROUP; g++)
            for (int h = 0; h < PV_WIDTH / 8; h++) {
                o[g][h] = _mm256_loadu_ps(w->o[j0 + g] + c + 8 * h);
                if (corr[g] != 1.0f) o[g][h] = _mm256_mul_ps(o[g][h], _mm256_set1_ps(corr[g]));
            }
        for (int t = 0; t < valid; t++) add_pv8(o, vb + t * HEAD_DIM + c, &pw[0][t], LANES);
        for (int g = 0; g < GROUP; g++)
            for (int h = 0; h < PV_WIDTH / 8; h++) _mm256_storeu_ps(w->o[j0 + g] + c + 8 * h, o[g][h]);
    }
}
#endif

/* One tile: `rows` query tokens (the first at position pos0; q and out point at its first
 * row and KV head h's first query head, rows `row_stride` / `out_stride` apart) against keys
 * 0 .. pos0 + rows - 1 in the blocks of `table`. */
static void prefill_tile(Scratch *w, const float *restrict q, int64_t row_stride, int64_t rows,
                         int64_t pos0, const kv_t *restrict k_plane,
                         const kv_t *restrict v_plane, const int64_t *restrict table,
                         float scale, float *restrict out, int64_t out_stride) {
    for (int64_t r = 0; r < rows; r++)
        for (int g = 0; g < GROUP; g++) {
            const int64_t j = r * GROUP + g;
            const float *src = q + r * row_stride + g * HEAD_DIM;
            for (int d = 0; d < HEAD_DIM; d++) w->q[j][d] = src[d] * scale;
            memset(w->o[j], 0, sizeof w->o[j]);
            w->l[j] = (vf){};
            w->m[j] = -INFINITY;
        }
    const int64_t last = pos0 + rows - 1;
    for (int64_t k0 = 0; k0 <= last; k0 += LANES) {
        const int64_t at = (table[k0 / BLOCK] * BLOCK + k0 % BLOCK) * HEAD_DIM;
        const kv_t *kb = k_plane + at, *vb = v_plane + at;
        prefetch_span(k_plane, v_plane, table, k0, last + 1);
        for (int t = 0; t < LANES; t++)
            for (int d = 0; d < HEAD_DIM; d++) w->kt[d][t] = kv_float(kb[t * HEAD_DIM + d]);
        /* Rows before position k0 see none of this span. */
        for (int64_t r = k0 > pos0 ? k0 - pos0 : 0; r < rows; r++) {
            const int64_t seen = pos0 + r - k0 + 1;     /* keys of the span row r sees */
            const int valid = seen < LANES ? (int)seen : LANES;
            const int64_t j0 = r * GROUP;
            /* The row's G heads together: each K row (and below each V row) is loaded once
             * for all of them; two partial sums per head keep 2G FMA chains in flight. */
            vf p[GROUP];
            float corr[GROUP];
#ifdef SCORES_8
            vf_halves sc[GROUP];
            scores_row8(w, j0, 0, sc, 0);
            scores_row8(w, j0, 1, sc, 1);
#define SCORE(g) sc[g].v
#else
            vf a[GROUP][2];
            for (int g = 0; g < GROUP; g++) a[g][0] = a[g][1] = (vf){};
            for (int d = 0; d < HEAD_DIM; d += 2) {
                const vf k_even = load(w->kt[d]), k_odd = load(w->kt[d + 1]);
                for (int g = 0; g < GROUP; g++) {
                    a[g][0] += w->q[j0 + g][d] * k_even;
                    a[g][1] += w->q[j0 + g][d + 1] * k_odd;
                }
            }
#define SCORE(g) (a[g][0] + a[g][1])
#endif
            for (int g = 0; g < GROUP; g++) {
                const int64_t j = j0 + g;
                vf score = SCORE(g);
                for (int t = valid; t < LANES; t++) score[t] = -INFINITY;
                const float mx = max_lanes(score);
                corr[g] = 1.0f;
                if (mx > w->m[j]) {                     /* a new maximum: rescale the past */
                    corr[g] = expf(w->m[j] - mx);
                    w->l[j] *= corr[g];
                    w->m[j] = mx;
                }
                p[g] = vexp(score - w->m[j]);
                w->l[j] += p[g];
            }
#undef SCORE
#ifdef SCORES_8
            pv_row8(w, j0, p, corr, vb, valid);
#else
            vf o[GROUP][CHUNKS];
            for (int g = 0; g < GROUP; g++)
                for (int c = 0; c < CHUNKS; c++) {
                    o[g][c] = load(w->o[j0 + g] + c * LANES);
                    if (corr[g] != 1.0f) o[g][c] *= corr[g];
                }
            for (int t = 0; t < valid; t++) {
                vf v[CHUNKS];
                for (int c = 0; c < CHUNKS; c++) v[c] = load_kv(vb + t * HEAD_DIM + c * LANES);
                for (int g = 0; g < GROUP; g++)
                    for (int c = 0; c < CHUNKS; c++) o[g][c] += p[g][t] * v[c];
            }
            for (int g = 0; g < GROUP; g++)
                for (int c = 0; c < CHUNKS; c++) store(w->o[j0 + g] + c * LANES, o[g][c]);
#endif
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int g = 0; g < GROUP; g++) {
            const int64_t j = r * GROUP + g;
            const float inv = 1.0f / sum_lanes(w->l[j]);
            float *dst = out + r * out_stride + g * HEAD_DIM;
            for (int c = 0; c < CHUNKS; c++) store(dst + c * LANES, load(w->o[j] + c * LANES) * inv);
        }
}

/* Prefill chunks: chunk i has q_lens[i] query tokens at rows q_starts[i].. of q; its last one
 * sees ctx_lens[i] keys, so token r sits at position ctx_lens[i] - q_lens[i] + r and sees keys
 * 0 .. that position, in the blocks of tables row i (the chunk's own K and V already written
 * there). Returns 0, or -1 when memory for the work list or scratch could not be had. */
int paged_prefill_f32(const float *restrict q, int64_t q_stride, const void *kv_cache,
                      const int64_t *restrict tables, const int64_t *restrict q_starts,
                      const int64_t *restrict q_lens, const int64_t *restrict ctx_lens,
                      float *restrict out, int64_t chunks, int64_t kv_heads,
                      int64_t num_blocks, int64_t width, float scale) {
    const kv_t *kv = kv_cache;
    const int64_t plane = num_blocks * BLOCK * HEAD_DIM;
    const int64_t out_stride = kv_heads * GROUP * HEAD_DIM;
    int64_t n = 0;
    for (int64_t i = 0; i < chunks; i++) n += kv_heads * ((q_lens[i] + ROWS - 1) / ROWS);
    Tile *tiles = malloc(sizeof(Tile) * (n > 0 ? n : 1));
    if (tiles == NULL) return -1;
    n = 0;
    for (int64_t i = 0; i < chunks; i++)
        for (int64_t r0 = 0; r0 < q_lens[i]; r0 += ROWS)
            for (int64_t h = 0; h < kv_heads; h++) {
                const int64_t rows = q_lens[i] - r0 < ROWS ? q_lens[i] - r0 : ROWS;
                const int64_t pos0 = ctx_lens[i] - q_lens[i] + r0;
                tiles[n++] = (Tile){i, h, r0, rows, pos0, rows * (pos0 + rows)};
            }
    /* Costliest tiles first: the cheap ones left at the end keep the threads even. */
    qsort(tiles, n, sizeof(Tile), by_cost_desc);
    int failed = 0;
    #pragma omp parallel
    {
        Scratch *w = aligned_alloc(64, (sizeof(Scratch) + 63) / 64 * 64);
        if (w == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < n; k++) {
            if (w == NULL) continue;
            const Tile t = tiles[k];
            const int64_t row = q_starts[t.span] + t.row0;
            const int64_t head0 = t.head * GROUP * HEAD_DIM;
            prefill_tile(w, q + row * q_stride + head0, q_stride, t.rows, t.pos0,
                         kv + t.head * plane, kv + (kv_heads + t.head) * plane,
                         tables + t.span * width, scale, out + row * out_stride + head0,
                         out_stride);
        }
        free(w);
    }
    free(tiles);
    return failed ? -1 : 0;
}

/* ---- the new tokens' RoPE and cache write ------------------------------------------------ */

/* For each new token t: rotate its query and key heads in place (rotate-half RoPE: with
 * x = (x1, x2) halves, x' = (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin per column), then copy
 * its (rotated) K and V heads into cache slot slots[t] (block * BLOCK + offset).
 *   qkv  (T, (Hkv * GROUP + 2 Hkv) * HEAD_DIM) rows at stride ld: q heads, k heads, v heads
 *   cos, sin  (T, HEAD_DIM) rows at stride cs_stride
 * One call per layer replaces ~8 tensor ops (slices, negation, concatenation, products and
 * two indexed writes); every element's arithmetic depends only on its own token. */
void rope_write_f32(float *restrict qkv, int64_t ld, const float *restrict cos,
                    const float *restrict sin, int64_t cs_stride, const int64_t *restrict slots,
                    void *kv_cache, int64_t tokens, int64_t kv_heads, int64_t num_blocks) {
    kv_t *kv = kv_cache;
    const int64_t plane = num_blocks * BLOCK * HEAD_DIM, rotated = kv_heads * (GROUP + 1);
    enum { HALF = HEAD_DIM / 2 };
    #pragma omp parallel for schedule(static) if (tokens > 64)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * ld;
        const float *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        for (int64_t h = 0; h < rotated; h++) {
            float *x = row + h * HEAD_DIM;
            float x1[HALF], x2[HALF];
            memcpy(x1, x, sizeof x1);
            memcpy(x2, x + HALF, sizeof x2);
            for (int i = 0; i < HALF; i++) {
                x[i] = x1[i] * c[i] - x2[i] * s[i];
                x[HALF + i] = x2[i] * c[HALF + i] + x1[i] * s[HALF + i];
            }
        }
        const float *k = row + kv_heads * GROUP * HEAD_DIM, *v = k + kv_heads * HEAD_DIM;
        for (int64_t h = 0; h < kv_heads; h++) {
            kv_t *kd = kv + h * plane + slots[t] * HEAD_DIM;
            kv_t *vd = kv + (kv_heads + h) * plane + slots[t] * HEAD_DIM;
            for (int d = 0; d < HEAD_DIM; d++) {
                kd[d] = kv_store(k[h * HEAD_DIM + d]);
                vd[d] = kv_store(v[h * HEAD_DIM + d]);
            }
        }
    }
}
