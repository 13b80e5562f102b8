/* Greedy decoding's argmax over rows of logits, with torch.argmax's answer: the index of a
 * row's largest value, the first where several are equal, and where the row holds a NaN the
 * index of its first NaN.
 *
 * Why: torch's CPU argmax compares one element at a time (~2.7 GB/s on one core of an Intel
 * Xeon: 48 us for a 32000-token vocabulary, 218 us for 151936, 0.75 ms for 32 rows of 32000),
 * 2-3% of a small model's decode step and more of a large vocabulary's. Here a row takes two
 * vectorised passes: its maximum (and whether it holds a NaN), then the first index that
 * reaches it; the second pass stops there and finds the row in cache. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"                    /* vf, vi (16 lanes), load, splat, vmax, vge, any_lane */

#define PARALLEL_ELEMENTS 65536       /* fewer logits than this run on one thread */

#if defined(__AVX__) && !defined(__AVX512F__)
/* Where vectors are 256 bits: the loops in 8-lane registers. Written with the 16-lane types,
 * GCC kept the running maximum and the NaN mask on the stack, moved through general registers
 * at every step (80 us for 32000 logits, against 7.6 with AVX-512). A NaN-free row's maximum
 * is exact either way (max_ps differs from the 16-lane select only where a NaN is). */
#include <immintrin.h>

static int64_t row_argmax(const float *x, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, v);
    }
    float lanes[8], best = -INFINITY;
    _mm256_storeu_ps(lanes, m);
    for (int k = 0; k < 8; k++) best = lanes[k] > best ? lanes[k] : best;
    int has_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t t = i; t < n; t++) {
        has_nan |= x[t] != x[t];
        best = x[t] > best ? x[t] : best;
    }
    const __m256 b = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n; i += 8) {        /* the first index that reaches it (or a NaN) */
        const __m256 v = _mm256_loadu_ps(x + i);
        const int hit = _mm256_movemask_ps(has_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                                   : _mm256_cmp_ps(v, b, _CMP_GE_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
    for (; i < n; i++)
        if (has_nan ? x[i] != x[i] : x[i] >= best) return i;
    return n;
}
#else
/* The first index i with x[i] >= best, or with x[i] a NaN when nan (n when none). */
static int64_t first_at_least(const float *x, int64_t n, float best, int nan) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vf v = load(x + i);
        const vi hit = nan ? ~vge(v, v) : vge(v, splat(best));   /* NaN: unordered with itself */
        if (any_lane(hit))
            for (int k = 0; k < LANES; k++)
                if (hit[k]) return i + k;
    }
    for (; i < n; i++)
        if (nan ? x[i] != x[i] : x[i] >= best) return i;
    return n;
}

static int64_t row_argmax(const float *x, int64_t n) {
    vf m = splat(-INFINITY);
    vi nan = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vf v = load(x + i);
        nan |= ~vge(v, v);
        m = vmax(m, v);
    }
    float best = max_lanes(m);
    int tail_nan = 0;
    for (; i < n; i++) {
        tail_nan |= x[i] != x[i];
        best = x[i] > best ? x[i] : best;
    }
    const int has_nan = any_lane(nan) || tail_nan;
    return first_at_least(x, n, best, has_nan);    /* every value -inf: 0, as torch gives */
}
#endif

/* out[r] = argmax of row r: x (rows, n), row r at x + r * ld; n >= 1. */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out) {
    #pragma omp parallel for schedule(static) if (rows > 1 && rows * n >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++)
        out[r] = row_argmax(x + r * ld, n);
}

/* Row r's logits as the sampler's torch path leaves them before it chooses (mask_banned, then
 * apply_penalties' repetition penalty): copied into y, its banned ids (nb of them) set to -inf,
 * then every id in seen (ns of them: prompt and output so far, repeats allowed) takes l / p if
 * l > 0 else l * p of its value after the bans (all values read into vals before any is
 * written, so a repeated id is penalised once). Ids outside [0, n) are ignored. The same
 * float32 operations as torch's. */
static void penalize_row(const float *x, int64_t n, float *y, const int64_t *banned, int64_t nb,
                         const int64_t *seen, int64_t ns, float p, float *vals) {
    memcpy(y, x, sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < nb; i++)
        if (banned[i] >= 0 && banned[i] < n) y[banned[i]] = -INFINITY;
    if (p == 1.0f || ns == 0) return;
    for (int64_t i = 0; i < ns; i++)
        vals[i] = seen[i] >= 0 && seen[i] < n ? y[seen[i]] : 0.0f;
    for (int64_t i = 0; i < ns; i++)
        if (seen[i] >= 0 && seen[i] < n) y[seen[i]] = vals[i] > 0.0f ? vals[i] / p : vals[i] * p;
}

/* Greedy rows with their bans and HF's repetition penalty applied on the way (penalize_row),
 * then out[r] = the copy's argmax: the sampler's torch path's token. work: rows * (n + the
 * longest seen) floats.
 * Why: as torch ops (a clone, a mask, gathers and scatters of flat indices, a where) a talker's
 * row (8448 codes, ~1000 banned, a few hundred seen) cost ~0.25 ms a step, here ~0.02. */
void penalized_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld,
                           const int64_t *const *banned, const int64_t *banned_counts,
                           const int64_t *const *seen, const int64_t *seen_counts,
                           const float *penalty, float *work, int64_t width, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        float *y = work + r * width;
        penalize_row(x + r * ld, n, y, banned[r], banned_counts[r], seen[r], seen_counts[r],
                     penalty[r], y + n);
        out[r] = row_argmax(y, n);
    }
}

/* The k-th largest of y's n values (k in [1, n]; NaNs are passed over): a min-heap of the k
 * largest seen, which a value enters only when it beats the heap's least (most do not: one
 * compare each). heap: k floats. */
static float kth_largest(const float *y, int64_t n, int64_t k, float *heap) {
    for (int64_t i = 0; i < k; i++) heap[i] = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        const float v = y[i];
        if (!(v > heap[0])) continue;
        int64_t at = 0;                      /* sift v down from the root */
        for (;;) {
            int64_t c = 2 * at + 1;
            if (c >= k) break;
            if (c + 1 < k && heap[c + 1] < heap[c]) c++;
            if (heap[c] >= v) break;
            heap[at] = heap[c];
            at = c;
        }
        heap[at] = v;
    }
    return heap[0];
}

static int descending(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* s[0..c) in descending order: by insertion for a top-k's few dozen values (qsort's calls
 * through a comparator cost a predictor row of 50 candidates more than the rest of its
 * choice), qsort beyond. */
static void sort_descending(float *s, int64_t c) {
    if (c > 64) {
        qsort(s, (size_t)c, sizeof(float), descending);
        return;
    }
    for (int64_t i = 1; i < c; i++) {
        const float v = s[i];
        int64_t j = i;
        for (; j > 0 && s[j - 1] < v; j--) s[j] = s[j - 1];
        s[j] = v;
    }
}

/* The cut top_p makes in the tokens at or above t_k (their values s[0..c), sorted here
 * descending): the softmax over them (their log-sum-exp, then exp(s - lse)), cumulated in
 * double as torch's CPU cumsum does; position j > 0 stays while the mass before it is below
 * top_p, position 0 always, and the cut is the last kept value (ties with it stay too). */
static float top_p_cut(float *s, int64_t c, float top_p) {
    if (top_p >= 1.0f) return -INFINITY;
    sort_descending(s, c);
    const float m = s[0];
    if (m == -INFINITY) return -INFINITY;
    float sum = 0.0f;
    for (int64_t j = 0; j < c; j++) sum += expf(s[j] - m);
    const float lse = logf(sum) + m;
    double acc = 0.0;
    int64_t keep = 1;
    for (int64_t j = 0; j + 1 < c; j++) {
        acc += (double)expf(s[j] - lse);
        if ((float)acc < top_p) keep++;
        else break;                          /* the cumulative mass only grows */
    }
    return s[keep - 1];
}

/* Sampled rows of a talker-like step, the sampler's torch path's token: row r's logits after
 * penalize_row, divided by temperature[r]; the tokens at or above its top_k[r]-th largest
 * value (ties all in), cut again by top_p[r] (top_p_cut); among those, the largest
 * y - log E, E = max(-log u, FLT_MIN) (the exponential race over the row's uniforms u, drawn by
 * the caller; only the kept tokens' noise is computed), the first index where several are
 * equal (index 0 where all are -inf, as torch's argmax). top_k[r] in [1, n]. work: rows *
 * (n + the longest seen + top_k max + n) floats (width); cand: rows * n indices.
 * The same float32 operations as torch's except where libm and SLEEF round differently (the
 * noise's logs, the top-p normaliser's exp and its sum order): a token can differ only where
 * two kept tokens' noisy scores, or a cumulative probability and top_p, lie within a few ulps.
 * Why: as torch ops (clone, mask, gathers, a divide, topk, logsumexp over the row, cumsum,
 * masked_fill, the noise's four passes over the row, subtract, argmax) a talker's row of 8448
 * codes cost ~0.15 ms a step, six rows ~1 ms of a ~2.9 ms step; here ~0.02 ms a row. */
void topk_race_rows(const float *x, int64_t rows, int64_t n, int64_t ld,
                    const int64_t *const *banned, const int64_t *banned_counts,
                    const int64_t *const *seen, const int64_t *seen_counts,
                    const float *penalty, const float *temperature, const int64_t *top_k,
                    const float *top_p, const float *u, int64_t ld_u,
                    float *work, int64_t width, int64_t *cand, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        float *y = work + r * width, *scratch = y + n;   /* seen values, then heap and values */
        int64_t *idx = cand + r * n;
        penalize_row(x + r * ld, n, y, banned[r], banned_counts[r], seen[r], seen_counts[r],
                     penalty[r], scratch);
        const float t = temperature[r];
        for (int64_t i = 0; i < n; i++) y[i] = y[i] / t;
        const float t_k = kth_largest(y, n, top_k[r], scratch);
        float *s = scratch + top_k[r];
        int64_t c = 0;
        for (int64_t i = 0; i < n; i++)
            if (y[i] >= t_k) { idx[c] = i; s[c] = y[i]; c++; }
        const float cut = c ? top_p_cut(s, c, top_p[r]) : t_k;
        const float keep = cut > t_k ? cut : t_k;
        const float *ur = u + r * ld_u;
        float best = -INFINITY;
        int64_t choice = 0;
        for (int64_t j = 0; j < c; j++) {
            const int64_t i = idx[j];
            if (!(y[i] >= keep)) continue;
            float e = -logf(ur[i]);                  /* u = 0: e = inf, the token loses */
            if (!(e >= FLT_MIN)) e = FLT_MIN;
            const float v = y[i] - logf(e);
            if (v > best) { best = v; choice = i; }
        }
        out[r] = choice;
    }
}
