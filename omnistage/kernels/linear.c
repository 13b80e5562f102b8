/* y = x W^T (+ bias) in float32 over weights packed in 64-column panels: the linear layers
 * of our LLM stages on CPU, for one row (a single-stream decode) as for thousands (prefill).
 *
 * Layout: the (N, K) weight is cut into ceil(N/64) panels of 64 output columns; panel j is
 * stored as K rows of 64 floats (P[j][k][c] = W[64j + c][k], zero past N). One layout serves
 * both regimes:
 * - one row reads every panel front to back, one sequential stream per thread: a
 *   matrix-vector product at memory speed (oneDNN's packed layout streams ~20% slower for
 *   one row on the CPUs we serve from, and each of its calls costs ~10 us more);
 * - many rows run a 6 x 64 register tile (24 accumulators) over a panel kept in L2: as fast
 *   as oneDNN's GEMM here (~480 GFLOP/s on two Zen 5 cores).
 *
 * Batch invariance: every output element is one chain of fused multiply-adds over k = 0..K-1
 * in order, then + bias, whatever the number of rows, the tile it falls in or the threads. A
 * row's result is therefore bit-identical alone or inside any batch, so a request's tokens do
 * not depend on what it is batched with (the build passes -ffp-contract=fast, so `acc += a*b`
 * is one FMA everywhere).
 *
 * Threads: OpenMP over (panel, tile) work items, torch's runtime (see paged_attention.c). */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PANEL 64                   /* output columns per panel */
/* A tile computes 4 vectors of columns (4 * LANES) for MR rows at most: 4 * MR accumulators
 * plus 4 panel vectors should fit the vector registers. AVX-512: 16 lanes, one tile covers a
 * panel, 6 rows (24 + 4 of 32 registers). Without it (AVX2: 16 registers of 8 lanes): a panel
 * is two column blocks, 3 rows a tile (12 + 4 + the broadcast; measured on 2 Zen cores: 93
 * GFLOP/s, 83 at 2 rows, 85-100% of torch's GEMM; one row 20-40% faster than torch). 16-lane
 * vectors there were split in pairs and spilled: one row at 9 GB/s against torch's 27. */
#if defined(__AVX512F__)
#define LANES 16
#define MR 6
#else
#define LANES 8
#define MR 3
#endif
#define BLOCK (4 * LANES)          /* columns a tile computes */
#define BLOCKS (PANEL / BLOCK)     /* column blocks per panel: 1 (AVX-512) or 2 */
#define PREFETCH 8                 /* panel rows ahead, for the streaming (1-2 row) tiles */

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

#define REP1(X) X(0)
#define REP2(X) REP1(X) X(1)
#define REP3(X) REP2(X) X(2)
#define REP4(X) REP3(X) X(3)
#define REP5(X) REP4(X) X(4)
#define REP6(X) REP5(X) X(5)
/* Named accumulators, not an array: compilers keep these in registers (an array of vectors
 * is spilled to the stack, 2.5x slower). */
#define DECL(m) vf c##m##0 = {}, c##m##1 = {}, c##m##2 = {}, c##m##3 = {};
#define FMA(m) { const vf a = (vf){} + x[(m) * ldx + k]; \
    c##m##0 += a * b0; c##m##1 += a * b1; c##m##2 += a * b2; c##m##3 += a * b3; }
#define PUT(m) store(y + (m) * ldy, c##m##0 + d0); store(y + (m) * ldy + LANES, c##m##1 + d1); \
    store(y + (m) * ldy + 2 * LANES, c##m##2 + d2); store(y + (m) * ldy + 3 * LANES, c##m##3 + d3);

/* y[0..R) x [0..64) = x[0..R) . panel (+ bias[0..64)); R rows of x at stride ldx. */
#define TILE(R, PF) \
static void tile##R(const float *restrict x, int64_t ldx, const float *restrict p, int64_t K, \
                    const float *restrict bias, float *restrict y, int64_t ldy) { \
    REP##R(DECL) \
    for (int64_t k = 0; k < K; k++) { \
        const float *row = p + k * PANEL; \
        if (PF) { __builtin_prefetch(row + PREFETCH * PANEL); \
                  __builtin_prefetch(row + PREFETCH * PANEL + 2 * LANES); } \
        const vf b0 = load(row), b1 = load(row + LANES), b2 = load(row + 2 * LANES), \
                 b3 = load(row + 3 * LANES); \
        REP##R(FMA) \
    } \
    vf d0 = {}, d1 = {}, d2 = {}, d3 = {}; \
    if (bias != NULL) { d0 = load(bias); d1 = load(bias + LANES); d2 = load(bias + 2 * LANES); \
                        d3 = load(bias + 3 * LANES); } \
    REP##R(PUT) \
}
typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, const float *, float *,
                        int64_t);
#if MR == 6
TILE(1, 1) TILE(2, 1) TILE(3, 0) TILE(4, 0) TILE(5, 0) TILE(6, 0)
static const tile_fn TILES[MR + 1] = {NULL, tile1, tile2, tile3, tile4, tile5, tile6};
#else
TILE(1, 1) TILE(2, 1) TILE(3, 0)
static const tile_fn TILES[MR + 1] = {NULL, tile1, tile2, tile3};
#endif

/* The R rows of one panel, block by block (a block's panel rows sit at stride PANEL). */
static void panel_rows(int rows, const float *xs, int64_t ldx, const float *p, int64_t k,
                       const float *bias, float *y, int64_t ldy) {
    for (int b = 0; b < BLOCKS; b++)
        TILES[rows](xs, ldx, p + b * BLOCK, k, bias != NULL ? bias + b * BLOCK : NULL,
                    y + b * BLOCK, ldy);
}

/* x (M, K) rows at stride ldx; panels as above; bias (N) or NULL; y (M, N) rows at stride
 * ldy. */
void linear_f32(const float *x, int64_t ldx, const float *panels, const float *bias, float *y,
                int64_t ldy, int64_t m, int64_t n, int64_t k) {
    const int64_t num_panels = (n + PANEL - 1) / PANEL, tiles = (m + MR - 1) / MR;
    /* Work items panel-major: a thread's consecutive items share a panel, which stays in L2
     * while the tiles of x stream past it. */
    #pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < num_panels * tiles; item++) {
        const int64_t j = item / tiles, m0 = item % tiles * MR;
        const int rows = m - m0 < MR ? (int)(m - m0) : MR;
        const int64_t n0 = j * PANEL;
        const float *p = panels + j * k * PANEL, *xs = x + m0 * ldx;
        if (n0 + PANEL <= n) {
            panel_rows(rows, xs, ldx, p, k, bias != NULL ? bias + n0 : NULL, y + m0 * ldy + n0, ldy);
            continue;
        }
        /* The last, partial panel: computed whole into scratch (its padding columns are
         * zeros), then the real columns are kept, with the same arithmetic per element. */
        float scratch[MR * PANEL];
        panel_rows(rows, xs, ldx, p, k, NULL, scratch, PANEL);
        for (int r = 0; r < rows; r++)
            for (int64_t c = 0; c < n - n0; c++)
                y[(m0 + r) * ldy + n0 + c] = scratch[r * PANEL + c]
                                             + (bias != NULL ? bias[n0 + c] : 0.0f);
    }
}
