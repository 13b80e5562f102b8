/* linear_w8a8.c's call types, shared with the kernels that call it by function pointer
 * (dit_stack.c): one definition, so a field or an argument cannot drift between them. */
#ifndef OMNISTAGE_LINEAR_W8A8_H
#define OMNISTAGE_LINEAR_W8A8_H

#include <stdint.h>

/* What linear_w8a8 fuses around the product (NULL: nothing). */
typedef struct {
    const float *norm_w, *norm_b;   /* (k,) each: x's rows LayerNorm'ed (eps) then * norm_w +
                                     * norm_b before quantizing; norm_w NULL: no norm */
    float eps;
    const float *res;               /* (m, n) at row stride ldr: y = res + gate * y; NULL: none */
    int64_t ldr;
    const float *gate;              /* (n,) */
} W8A8Fuse;

/* A weight as linear_w8a8 takes it (linear_w8a8.c's layout), with its bias (n,) or NULL. */
typedef struct {
    const int8_t *panels;
    const float *sw;
    const int32_t *comp;
    const float *bias;
    int64_t n, k;                   /* outputs, inputs */
} W8A8Matrix;

/* linear_w8a8 and linear_w8a8_ffn (see there). */
typedef void (*w8a8_fn)(const float *x, int64_t ldx, const int8_t *panels, const float *sw,
                        const int32_t *comp, const float *bias, int32_t act, float *y, int64_t ldy,
                        int64_t m, int64_t n, int64_t k, int32_t amx, const W8A8Fuse *fuse);
typedef void (*w8a8_ffn_fn)(const float *x, int64_t ldx, const W8A8Matrix *up, const W8A8Matrix *down,
                            float *y, int64_t ldy, int64_t m, int32_t amx, const W8A8Fuse *up_fuse,
                            const W8A8Fuse *down_fuse);

#endif
