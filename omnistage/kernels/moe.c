/* A mixture-of-experts MLP's work around its two products, in two native calls per layer and
 * step (layers/moe.py): the rows grouped by expert before the experts' gate|up product, and
 * their weighted outputs summed back into rows after the down product.
 *
 * Why: in Python the grouping (a stable sort of the (row, slot) picks by expert, the counts,
 * a gather) and the combination (the weights, each row's slots in ascending expert order, k
 * gathered adds) were ~15 tensor ops a layer: 0.3 ms of a decode step's layer at 1 row and 0.5
 * at 8 on 2 Zen 3 cores, against 0.1-0.6 ms for the experts' products themselves.
 *
 * The arithmetic is the Python path's, so the same bits: the products through the same
 * segmented kernel (linear.c's linear_segments, reached by function pointer), each weighted
 * output one float32 product (output * routing weight), and a row's output its slots' weighted
 * outputs added to +0.0 in ascending expert order. SiLU(gate) * up stays with the caller
 * (torch's, between the two calls). Built with -ffp-contract=off (moe.py), unlike the other
 * kernels: torch rounds the weighted output before adding it, which a fused multiply-add would
 * not.
 *
 * Picks: `experts` (rows, k) expert ids in [0, num_experts), distinct within a row (top-k);
 * slot s = row * k + j. Grouped order: by expert, slots ascending within an expert (a stable
 * sort of the flat picks, as torch.argsort(stable=True)). */

#include <stdint.h>
#include <string.h>

#include "linear_call.h"

typedef void (*segments_fn)(const Linear *w, const int64_t *off, int64_t count, const float *x, float *y);

#define PARALLEL_ELEMENTS 65536        /* copies / sums smaller than this run on one thread */

/* The grouping: off (num_experts + 1) the segments' row offsets, order (rows * k) the slot at
 * each grouped position, pos (rows * k) each slot's grouped position; grouped (rows * k,
 * hidden) = x's row of each slot in grouped order; then gu = grouped through gate_up[e] per
 * segment. Returns -1 (nothing written past off) when an expert id is out of range. */
int moe_group_f32(segments_fn segments, const Linear *gate_up, int64_t num_experts,
                  const float *x, int64_t rows, int64_t hidden, const int64_t *experts, int64_t k,
                  int64_t *off, int64_t *order, int64_t *pos, float *grouped, float *gu) {
    const int64_t picks = rows * k;
    memset(off, 0, (size_t)(num_experts + 1) * sizeof *off);
    for (int64_t s = 0; s < picks; s++) {
        if (experts[s] < 0 || experts[s] >= num_experts)
            return -1;
        off[experts[s] + 1]++;
    }
    for (int64_t e = 0; e < num_experts; e++)
        off[e + 1] += off[e];
    for (int64_t s = 0; s < picks; s++) {       /* counting sort: slots ascending per expert */
        const int64_t e = experts[s];
        int64_t p = off[e]++;
        order[p] = s;
        pos[s] = p;
    }
    for (int64_t e = num_experts; e > 0; e--)   /* the cursors ended one segment on: back */
        off[e] = off[e - 1];
    off[0] = 0;
    #pragma omp parallel for schedule(static) if (picks * hidden > PARALLEL_ELEMENTS)
    for (int64_t p = 0; p < picks; p++)
        memcpy(grouped + p * hidden, x + order[p] / k * hidden, (size_t)hidden * sizeof(float));
    segments(gate_up, off, num_experts, grouped, gu);
    return 0;
}

/* act (rows * k, intermediate) in grouped order through down[e] per segment into eo, then
 * out (rows, hidden): each row's slots' eo * weight, added to +0.0 in ascending expert order
 * (its slots' grouped positions ascending). weights (rows, k) float32; off, pos as
 * moe_group_f32 left them. */
void moe_combine_f32(segments_fn segments, const Linear *down, int64_t num_experts,
                     const float *act, const int64_t *off, const int64_t *pos, const float *weights,
                     int64_t rows, int64_t k, int64_t hidden, float *eo, float *out) {
    segments(down, off, num_experts, act, eo);
    #pragma omp parallel for schedule(static) if (rows * k * hidden > PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        int64_t at[k];                          /* this row's grouped positions, ascending */
        float w[k];
        for (int64_t j = 0; j < k; j++) {
            int64_t i = j;
            const int64_t p = pos[r * k + j];
            for (; i > 0 && at[i - 1] > p; i--) {
                at[i] = at[i - 1];
                w[i] = w[i - 1];
            }
            at[i] = p;
            w[i] = weights[r * k + j];
        }
        float *o = out + r * hidden;
        for (int64_t d = 0; d < hidden; d++)
            o[d] = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const float *src = eo + at[j] * hidden;
            const float wj = w[j];
            for (int64_t d = 0; d < hidden; d++)
                o[d] += src[d] * wj;            /* two roundings: built without contraction */
        }
    }
}
