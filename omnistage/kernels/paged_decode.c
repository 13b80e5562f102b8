/* Decode attention over a paged KV cache, for CPUs: one query token per sequence against its
 * whole context, read straight from the cache blocks.
 *
 * The PyTorch path gathers every context into a contiguous buffer first (a copy of all of
 * K and V per layer and step) and then runs two batched matmuls over it; this kernel reads
 * each K and V row once, where it lies. It is compiled on first use for one model's shape
 * (HEAD_DIM, GROUP, BLOCK as -D constants, see omnistage/kernels/paged_decode.py), so every
 * loop below has a fixed trip count and the compiler keeps the accumulators in registers.
 *
 * Layouts (float32; contiguous except where said):
 *   q      (B, Hkv * GROUP, HEAD_DIM)   query heads h*GROUP .. h*GROUP+GROUP-1 share KV head h;
 *                                        sequence b starts at q + b * q_stride (rows may be
 *                                        views into a wider projection output)
 *   kv     (2, Hkv, num_blocks, BLOCK, HEAD_DIM)   K planes, then V planes
 *   tables (B, width) int64              block ids of each context, padded past its end
 *   lens   (B,) int64                    context length (keys) of each sequence, >= 1
 *   out    (B, Hkv * GROUP, HEAD_DIM)
 *
 * Numerics: scores are float32 dot products; softmax subtracts the row max, exponentiates
 * with a polynomial exp (about 2 ulp) and divides the weighted sum of V by the sum of the
 * weights at the end. Only the order of additions differs from softmax(q k^T) v.
 *
 * Work is split over (sequence, KV head) pairs with OpenMP: torch's own OpenMP runtime (the
 * library links libgomp by soname, which torch has loaded already), so torch.set_num_threads
 * governs it too. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if HEAD_DIM % 16 != 0 || BLOCK % 16 != 0
#error "HEAD_DIM and BLOCK must be multiples of 16"
#endif

#define LANES 16
#define CHUNKS (HEAD_DIM / LANES)

/* 16 float lanes; GCC/Clang lower it to whatever vector registers -march=native gives. */
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vf load(const float *p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return (vf){} + x; }
static inline vf vselect(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

/* exp on 16 lanes: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2 (Cephes' expf polynomial).
 * Lanes below -87 (including -inf) give exactly 0. */
static inline vf vexp(vf x) {
    const vi keep = x >= splat(-87.0f);
    x = (vf)((vi)x & keep);                            /* dropped lanes: 0, kept finite */
    x = vselect(x < splat(88.0f), x, splat(88.0f));
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

static inline float max_lanes(vf v) {
    float m = v[0];
    for (int i = 1; i < LANES; i++) m = v[i] > m ? v[i] : m;
    return m;
}

static inline float sum_lanes(vf v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

/* One (sequence, KV head): GROUP queries over `len` keys. `s` holds GROUP * padded scores. */
static void attend(const float *restrict q, const float *restrict k_plane,
                   const float *restrict v_plane, const int64_t *restrict table, int64_t len,
                   float scale, float *restrict s, float *restrict out) {
    const int64_t padded = (len + LANES - 1) / LANES * LANES;
    const int64_t spans = padded / LANES;             /* 16-key spans of the context */
    vf qv[GROUP][CHUNKS], row_max[GROUP];
    for (int g = 0; g < GROUP; g++) {
        for (int c = 0; c < CHUNKS; c++) qv[g][c] = load(q + g * HEAD_DIM + c * LANES) * scale;
        row_max[g] = splat(-INFINITY);
    }
    /* Scores: span i covers keys 16i .. 16i+15 of block table[16i / BLOCK]. */
    for (int64_t i = 0; i < spans; i++) {
        const int64_t key0 = i * LANES;
        const float *kb = k_plane + (table[key0 / BLOCK] * BLOCK + key0 % BLOCK) * HEAD_DIM;
        for (int g = 0; g < GROUP; g++) {
            vf acc[LANES];
            for (int t = 0; t < LANES; t++) {
                vf a = qv[g][0] * load(kb + t * HEAD_DIM);
                for (int c = 1; c < CHUNKS; c++) a += qv[g][c] * load(kb + t * HEAD_DIM + c * LANES);
                acc[t] = a;
            }
            vf sc = sum_lanes16(acc);
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
    vf o[GROUP][CHUNKS];
    for (int g = 0; g < GROUP; g++)
        for (int c = 0; c < CHUNKS; c++) o[g][c] = (vf){};
    for (int64_t t = 0; t < len; t++) {
        const float *vt = v_plane + (table[t / BLOCK] * BLOCK + t % BLOCK) * HEAD_DIM;
        vf v[CHUNKS];
        for (int c = 0; c < CHUNKS; c++) v[c] = load(vt + c * LANES);
        for (int g = 0; g < GROUP; g++) {
            const vf p = splat(s[g * padded + t]);
            for (int c = 0; c < CHUNKS; c++) o[g][c] += p * v[c];
        }
    }
    for (int g = 0; g < GROUP; g++)
        for (int c = 0; c < CHUNKS; c++) store(out + g * HEAD_DIM + c * LANES, o[g][c] * inv_sum[g]);
}

/* Returns 0, or -1 when a thread could not allocate its score buffer (out is then undefined). */
int paged_decode_f32(const float *restrict q, int64_t q_stride, const float *restrict kv,
                     const int64_t *restrict tables, const int64_t *restrict lens,
                     float *restrict out, int64_t batch, int64_t kv_heads, int64_t num_blocks,
                     int64_t width, float scale) {
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
