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

#endif
