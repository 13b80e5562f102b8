/* Greedy decoding's argmax over rows of logits, with torch.argmax's answer: the index of a
 * row's largest value, the first where several are equal, and where the row holds a NaN the
 * index of its first NaN.
 *
 * Why: torch's CPU argmax compares one element at a time (~2.7 GB/s on one core of an Intel
 * Xeon: 48 us for a 32000-token vocabulary, 218 us for 151936, 0.75 ms for 32 rows of 32000),
 * 2-3% of a small model's decode step and more of a large vocabulary's. Here a row takes two
 * vectorised passes: its maximum (and whether it holds a NaN), then the first index that
 * reaches it; the second pass stops there and finds the row in cache. */
#include <math.h>
#include <stdint.h>
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

/* Greedy rows with their bans and HF's repetition penalty applied on the way, as the sampler's
 * torch path computes them (mask_banned, then apply_penalties, then the argmax): row r is
 * copied into work, banned[r] ids (of banned_counts[r]) set to -inf, then every id in seen[r]
 * (prompt and output so far, repeats allowed) takes l / p if l > 0 else l * p of its value
 * after the bans (all values read before any is written, so a repeated id is penalised once),
 * and out[r] is the copy's argmax. Ids outside [0, n) are ignored. The same float32 operations
 * as torch's, so the same token. work: rows * (n + the longest seen) floats.
 * Why: as torch ops (a clone, a mask, gathers and scatters of flat indices, a where) a talker's
 * row (8448 codes, ~1000 banned, a few hundred seen) cost ~0.25 ms a step, here ~0.02. */
void penalized_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld,
                           const int64_t *const *banned, const int64_t *banned_counts,
                           const int64_t *const *seen, const int64_t *seen_counts,
                           const float *penalty, float *work, int64_t width, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        float *y = work + r * width, *vals = y + n;
        memcpy(y, x + r * ld, sizeof(float) * (size_t)n);
        for (int64_t i = 0; i < banned_counts[r]; i++) {
            const int64_t id = banned[r][i];
            if (id >= 0 && id < n) y[id] = -INFINITY;
        }
        const float p = penalty[r];
        const int64_t m = seen_counts[r];
        if (p != 1.0f && m > 0) {
            for (int64_t i = 0; i < m; i++) {
                const int64_t id = seen[r][i];
                vals[i] = id >= 0 && id < n ? y[id] : 0.0f;
            }
            for (int64_t i = 0; i < m; i++) {
                const int64_t id = seen[r][i];
                if (id >= 0 && id < n) y[id] = vals[i] > 0.0f ? vals[i] / p : vals[i] * p;
            }
        }
        out[r] = row_argmax(y, n);
    }
}
