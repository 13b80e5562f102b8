/* A packed weight bound for calls from C (linear.c's linear_segments, decoder_stack.c): its
 * format's linear_<format> entry and that entry's arguments after x, as kernels/linear.py's
 * LinearCall fills them. */
#ifndef OMNISTAGE_LINEAR_CALL_H
#define OMNISTAGE_LINEAR_CALL_H

#include <stdint.h>

typedef void (*linear_fn)(const float *x, int64_t ldx, const void *panels, const float *gscales,
                          int64_t group, const float *cscales, const float *bias, float *y,
                          int64_t ldy, int64_t m, int64_t n, int64_t k);

typedef struct {
    linear_fn fn;
    const void *panels;
    const float *gscales;
    int64_t group;
    const float *cscales;
    const float *bias;
    int64_t n, k;                      /* out_features, in_features */
} Linear;

/* y (rows, n) = x (rows, k) W (+ bias), both contiguous. */
static inline void product(const Linear *w, const float *x, float *y, int64_t rows) {
    w->fn(x, w->k, w->panels, w->gscales, w->group, w->cscales, w->bias, y, w->n, rows, w->n, w->k);
}

/* The product kernels' software prefetch (linear.c, linear_dots.c; into L2, no arithmetic
 * changed): a thread's consecutive work items share a panel, read in passes (tiles of rows, or
 * rows). The first pass reads the panel from memory and prefetches PREFETCH_AHEAD bytes ahead
 * of itself (into the next panel at its end); later passes reread it from L2 and prefetch
 * nothing. Why not the next panel from the second pass as well (an earlier plan): that pass
 * is short (8 rows: a 6-row then a 2-row tile) and then waited on a whole panel of memory,
 * after which the next first pass found its panel in L2 and memory idled while it computed:
 * float32 2048 x 384 past the cache at 8 rows 98 -> 83 us, 32000 x 512 at 8 rows 1.90 -> 1.59
 * ms, 384 x 384 at 8 rows 20 -> 18, 18 rows 131 -> 125, 256 rows 1.28 -> 1.25 ms (2 threads,
 * Intel Xeon, AVX-512; the AVX2 build and int8k the same or 1-4% faster). -> the distance of
 * a pass over a panel, `first` whether it is the panel's first (0: none). */
#define PREFETCH_AHEAD 16384
static inline int64_t pass_prefetch(int first) {
    return first ? PREFETCH_AHEAD : 0;
}

#endif
