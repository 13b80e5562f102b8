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
 * of itself (into the next panel at its end); the second rereads it from L2 and prefetches
 * the next panel, the thread's next item; later passes none. -> pass `pass`'s distance (0:
 * none). */
#define PREFETCH_AHEAD 16384
static inline int64_t pass_prefetch(int64_t pass, int64_t panel_bytes) {
    return pass == 0 ? PREFETCH_AHEAD : pass == 1 ? panel_bytes : 0;
}

#endif
