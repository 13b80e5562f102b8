/* A 1-D convolution (stride 1, dilation d, zero padding) over time-major activations:
 *
 *   y[b, t, o] = bias[o] + sum_k sum_i w[k][i][o] * x[b, t - left + k d, i]   (x = 0 outside [0, L))
 *
 * with `left` zero steps before the input and `right` after (a causal convolution: right 0),
 * and its depthwise form (one input channel per output channel, depthwise_conv1d_time_major).
 *
 * Why: serving Realtime sessions (Qwen2.5-Omni's small checkpoint, 96 down to 3 channels),
 * oneDNN executed BigVGAN's convolutions in about a quarter of their time; the rest went to
 * primitives JIT-compiled for every new (batch, length), which a stream's windows, batches and
 * tails keep producing, to descriptors made per call and to weights reordered per call. With
 * steady shapes the two run even. Here the weights are packed once (Python side:
 * [k][in][out], out padded to a multiple of 16 with zeros) and a call is one pass.
 *
 * A task takes TILE output steps of one batch row. Its input rows (the tile's steps and the
 * (K - 1) d around them) are read in place where they lie inside [0, L), else copied with
 * zero rows into scratch. Register tiles: AVX-512, 12 steps x 32 or 16 output channels in
 * 16-lane vectors; otherwise 6 steps x 16 in named 8-lane accumulators (tile6). Each output
 * element is the same products added in the same order (k, then i) wherever its step falls:
 * a step's result depends only on what it reads (batch, tile and length invariant), and both
 * tiles give the same bits. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#if defined(__AVX512F__) && !defined(OMNISTAGE_NO_AVX512)
#define WIDE 1                       /* 16-lane tiles (tile): twice the FMA width */
#define ROWS 12                      /* steps per register tile */
#define MAXV 2                       /* 16-lane column vectors per register tile */
#else
#define WIDE 0
#define ROWS 6
#endif
#define TILE (8 * ROWS)              /* output steps per task */

#if !WIDE
#include "v8.h"

/* Stores a row's `width` sums of the columns from cb (bias added) where the columns are below
 * cout: a tile's last, partial column block. */
static inline void store_row(float *out, int64_t cout, int64_t cb, const float *acc, int64_t width,
                             const float *bias) {
    const int64_t n = cout - cb < width ? cout - cb : width;
    for (int64_t j = 0; j < n; j++)
        out[cb + j] = acc[j] + (bias != NULL ? bias[cb + j] : 0.0f);
}

/* 6 output steps x 16 columns from cb, as `tile` below computes them, in named 8-lane
 * accumulators: an array of 16-lane vectors indexed in loops is lowered through the stack
 * where 16 lanes are two AVX2 registers (~7 GFLOP/s a core on a Zen 3, a tenth of oneDNN's).
 * 12 accumulators, two weight vectors and a broadcast: 15 of AVX2's 16 registers. */
static void tile6(const float *in, int64_t rs, int64_t tap, int64_t taps, int64_t cin, const float *w,
                  int64_t cp, const float *bias, float *out, int64_t cout, int64_t cb, int64_t rows) {
    v8 a00 = {}, a01 = {}, a10 = {}, a11 = {}, a20 = {}, a21 = {};
    v8 a30 = {}, a31 = {}, a40 = {}, a41 = {}, a50 = {}, a51 = {};
    for (int64_t k = 0; k < taps; k++) {
        const float *x = in + k * tap;
        const float *wk = w + k * cin * cp + cb;
        for (int64_t i = 0; i < cin; i++) {
            const v8 w0 = load8(wk + i * cp), w1 = load8(wk + i * cp + 8);
            v8 b;
            b = bcast8(x + i);          a00 += b * w0; a01 += b * w1;
            b = bcast8(x + rs + i);     a10 += b * w0; a11 += b * w1;
            b = bcast8(x + 2 * rs + i); a20 += b * w0; a21 += b * w1;
            b = bcast8(x + 3 * rs + i); a30 += b * w0; a31 += b * w1;
            b = bcast8(x + 4 * rs + i); a40 += b * w0; a41 += b * w1;
            b = bcast8(x + 5 * rs + i); a50 += b * w0; a51 += b * w1;
        }
    }
    const v8 acc[ROWS][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
    for (int64_t r = 0; r < rows && r < ROWS; r++) {
        if (cb + 16 <= cout) {
            const v8 b0 = bias != NULL ? load8(bias + cb) : (v8){};
            const v8 b1 = bias != NULL ? load8(bias + cb + 8) : (v8){};
            store8(out + r * cout + cb, acc[r][0] + b0);
            store8(out + r * cout + cb + 8, acc[r][1] + b1);
        } else {
            float part[16];
            store8(part, acc[r][0]);
            store8(part + 8, acc[r][1]);
            store_row(out + r * cout, cout, cb, part, 16, bias);
        }
    }
}
#endif

#if WIDE

/* ROWS output steps x V vectors of columns from cb: in row r at in + r * rs, tap k at
 * + k * tap; w: (taps, cin, cp) as [k][i][o]. Stores the first `rows` steps (and only the
 * columns below cout) at out + r * cout + cb, bias added. */
static inline __attribute__((always_inline)) void tile(const float *in, int64_t rs, int64_t tap,
                                                       int64_t taps, int64_t cin, const float *w,
                                                       int64_t cp, const float *bias, float *out,
                                                       int64_t cout, int64_t cb, int V, int64_t rows) {
    vf acc[ROWS][MAXV];
    for (int r = 0; r < ROWS; r++)
        for (int v = 0; v < MAXV; v++)
            acc[r][v] = (vf){};
    for (int64_t k = 0; k < taps; k++) {
        const float *x = in + k * tap;
        const float *wk = w + k * cin * cp + cb;
        for (int64_t i = 0; i < cin; i++) {
            vf wv[MAXV];
            for (int v = 0; v < V; v++)
                wv[v] = load(wk + i * cp + v * LANES);
            for (int r = 0; r < ROWS; r++) {
                const float s = x[r * rs + i];       /* broadcast operand */
                for (int v = 0; v < V; v++)
                    acc[r][v] += s * wv[v];
            }
        }
    }
    for (int v = 0; v < V; v++) {
        const int64_t c0 = cb + v * LANES, n = cout - c0 < LANES ? cout - c0 : LANES;
        if (n <= 0)
            break;
        const vf bv = bias != NULL ? load(bias + c0) : (vf){};
        for (int64_t r = 0; r < rows && r < ROWS; r++) {
            if (n == LANES) {
                store(out + r * cout + c0, acc[r][v] + bv);
            } else {
                float part[LANES];
                store(part, acc[r][v] + bv);
                memcpy(out + r * cout + c0, part, (size_t)n * sizeof(float));
            }
        }
    }
}

#endif

/* The tile's steps [0, n) of output, from input rows at in (row stride rs; tap offset tap). */
static void run_tile(const float *in, int64_t rs, int64_t tap, int64_t taps, int64_t cin,
                     const float *w, int64_t cp, const float *bias, float *out, int64_t cout,
                     int64_t n) {
    for (int64_t r = 0; r < n; r += ROWS) {
        const float *ir = in + r * rs;
        float *orow = out + r * cout;
        int64_t cb = 0;
#if WIDE
        for (; cb + 2 * LANES <= cp; cb += 2 * LANES)
            tile(ir, rs, tap, taps, cin, w, cp, bias, orow, cout, cb, 2, n - r);
        for (; cb < cp; cb += LANES)
            tile(ir, rs, tap, taps, cin, w, cp, bias, orow, cout, cb, 1, n - r);
#else
        for (; cb < cp; cb += 16)
            tile6(ir, rs, tap, taps, cin, w, cp, bias, orow, cout, cb, n - r);
#endif
    }
}

/* x: (B, L, cin), step (b, t) at x + b * stride_b + t * stride_t, channels unit stride.
 * y: contiguous (B, out_len, cout), out_len = L + left + right - (taps - 1) dilation >= 1;
 * not overlapping x. w: (taps, cin, cp), cp a multiple of 16 >= cout, columns >= cout zero;
 * bias: (cp,) or NULL. Returns 0, or -1 when scratch could not be allocated. */
int conv1d_time_major(const float *x, float *y, int64_t batch, int64_t length, int64_t cin,
                      int64_t stride_b, int64_t stride_t, const float *w, const float *bias,
                      int64_t cout, int64_t cp, int64_t taps, int64_t dilation, int64_t pad,
                      int64_t right) {
    const int64_t span = (taps - 1) * dilation, out_len = length + pad + right - span;
    const int64_t per_row = (out_len + TILE - 1) / TILE, tasks = batch * per_row;
    /* Input rows a tile reads, its computed steps rounded up to ROWS. */
    const int64_t in_rows = (TILE + ROWS - 1) / ROWS * ROWS + span;
    int failed = 0;
    #pragma omp parallel reduction(|: failed) if (tasks > 1)
    {
        float *s = NULL;        /* zero-padded copy of a tile's input rows, made when needed */
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (failed)
                continue;
            const int64_t b = task / per_row, t0 = (task % per_row) * TILE;
            const int64_t n = out_len - t0 < TILE ? out_len - t0 : TILE;
            const int64_t computed = (n + ROWS - 1) / ROWS * ROWS;
            const int64_t lo = t0 - pad, hi = lo + computed + span;      /* input steps read */
            const float *xb = x + b * stride_b;
            float *yt = y + (b * out_len + t0) * cout;
            if (lo >= 0 && hi <= length) {
                run_tile(xb + lo * stride_t, stride_t, dilation * stride_t, taps, cin, w, cp,
                         bias, yt, cout, n);
                continue;
            }
            if (s == NULL && (s = malloc((size_t)(in_rows * cin) * sizeof(float))) == NULL) {
                failed = 1;
                continue;
            }
            for (int64_t r = 0; r < hi - lo; r++) {
                const int64_t t = lo + r;
                if (t < 0 || t >= length)
                    memset(s + r * cin, 0, (size_t)cin * sizeof(float));
                else
                    memcpy(s + r * cin, xb + t * stride_t, (size_t)cin * sizeof(float));
            }
            run_tile(s, cin, dilation * cin, taps, cin, w, cp, bias, yt, cout, n);
        }
        free(s);
    }
    return failed ? -1 : 0;
}

/* The depthwise form: y[b, t, c] = bias[c] + sum_k w[k][c] * x[b, t - left + k d, c] (x = 0
 * outside [0, L)). x as above (channels unit stride); y: contiguous (B, out_len, C), out_len
 * = L + left + right - (taps - 1) dilation >= 1; w: (taps, C) as [k][c]; bias: (C,) or NULL.
 * A step's channels are one vector loop per tap, the taps added in order k = 0, 1, ...
 * whatever the batch, step or length. (The PyTorch form on time-major slices: eight
 * elementwise passes, ~4x oneDNN's time at ConvNeXt's 256 channels.) */
void depthwise_conv1d_time_major(const float *x, float *y, int64_t batch, int64_t length,
                                 int64_t channels, int64_t stride_b, int64_t stride_t,
                                 const float *w, const float *bias, int64_t taps,
                                 int64_t dilation, int64_t left, int64_t right) {
    const int64_t out_len = length + left + right - (taps - 1) * dilation;
    const int64_t per_row = (out_len + TILE - 1) / TILE, tasks = batch * per_row;
    #pragma omp parallel for schedule(static) if (tasks > 1 && batch * out_len * channels * taps > 65536)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t b = task / per_row, t0 = (task % per_row) * TILE;
        const int64_t t1 = out_len - t0 < TILE ? out_len : t0 + TILE;
        for (int64_t t = t0; t < t1; t++) {
            float *restrict yt = y + (b * out_len + t) * channels;
            for (int64_t c = 0; c < channels; c++)
                yt[c] = 0.0f;
            for (int64_t k = 0; k < taps; k++) {
                const int64_t at = t - left + k * dilation;
                if (at < 0 || at >= length)
                    continue;
                const float *restrict xt = x + b * stride_b + at * stride_t;
                const float *restrict wk = w + k * channels;
                for (int64_t c = 0; c < channels; c++)
                    yt[c] += xt[c] * wk[c];
            }
            if (bias != NULL)
                for (int64_t c = 0; c < channels; c++)
                    yt[c] += bias[c];
        }
    }
}
