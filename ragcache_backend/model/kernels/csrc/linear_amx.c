/* A bf16 GEMM on AMX tiles whose every output row depends on its own input row only (ragcache):
 * y = x W^T + b for a forward step's prompt rows, in one call whatever the row count.
 *
 * Why: oneDNN's AMX GEMMs block by the row count M, so a row's rounding changes with M, and the
 * Python side had to run prompt rows in calls of exactly 128 rows (linear.py, ROW_TILE) to keep a
 * prompt's K/V the same bits computed over a cached prefix or in full: ~1.6x the time of one
 * oneDNN call at 2,048 rows (the weight read once per 128 rows, the outputs joined by copies).
 * Here the blocking never mixes rows: every 32-row micro-block computes its 16-row A tiles against
 * the weight's B tiles with TDPBF16PS over the input size in order (32 at a time), each C tile row
 * the sum of its own A row's products; a block with fewer than 32 rows is padded with zeros in a
 * scratch copy (never read past x). The float32 sums get the bias (float32) and one rounding to bf16.
 *
 * Layout of the packed weight (rc_amx_pack): for every block of 16 output columns nb and bf16 pair
 * kp of the input, the 16 columns' pairs side by side: wp[((nb * K/2 + kp) * 16 + n) * 2 + j] =
 * W[16 nb + n][2 kp + j]; a B tile (16 pairs x 16 columns) is then 1 KB contiguous.
 *
 * Blocking: work items of MC rows x NC columns over OpenMP threads, handed out column-major (the
 * items of one NC-column panel of W, every row block, before the next panel: the panel is read
 * from memory once and stays in L2 while x's row blocks pass it; row-major items re-read each panel
 * of a weight larger than L2 once per row block: the four layer GEMMs of SmolLM2-135M over 30
 * layers' weights took 0.90-0.95x the time at 1,000-2,000 rows, 2026-11-28, Xeon with AMX); inside,
 * 32 x 32 micro-blocks, the rows outer (32 rows of x stay in L1 while the item's NC columns of W pass
 * from L2: ~10% faster than the columns outer for a 3,072 x 576 weight at 2,048 rows; MC 64 / 256,
 * NC 512-1,024 no better). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_common.h" /* bf16_t, RC_HAVE_AMX, TGT_AMX, amx_configure, rc_amx */

#define MC 128 /* rows per work item */
#define NC 256 /* columns per work item */

/* W [N, K] bf16 (row stride K) into the tile layout above, wp [N * K]. N, K multiples of 32 (checked
 * by the caller). */
void rc_amx_pack(const bf16_t *w, int64_t N, int64_t K, bf16_t *wp) {
    for (int64_t nb = 0; nb < N / 16; nb++)
        for (int64_t kp = 0; kp < K / 2; kp++)
            for (int64_t n = 0; n < 16; n++) {
                const bf16_t *src = w + (nb * 16 + n) * K + 2 * kp;
                bf16_t *dst = wp + ((nb * (K / 2) + kp) * 16 + n) * 2;
                dst[0] = src[0];
                dst[1] = src[1];
            }
}

#ifdef RC_HAVE_AMX
/* A micro-block's float32 sums waiting to be stored (store_rows), one step behind the TDPs. */
typedef struct {
    const float *c;                 /* [32][32] sums, or NULL: nothing waiting */
    int64_t rows, done;             /* rows of c that are real; rows stored so far */
    const float *bias, *bias_up;    /* as store_rows takes them */
    bf16_t *y;                      /* its first output */
} pending_t;

/* Rows r0 .. r1 - 1 of a micro-block's float32 sums c [32][32] into y's rows (row stride N): the bias
 * added, one bf16 rounding (32 outputs a row); or, gated, c's first 16 columns the gate and its last
 * 16 the up projection of 16 outputs: each rounded to bf16 (bias added first) as the plain GEMM
 * rounds it, then SiLU(gate) * up as rc_silu_mul computes it (silu_mul16), one rounding. */
TGT_AMX static inline void store_rows(const float *c, int64_t r0, int64_t r1, const float *bias, const float *bias_up, int gated,
                                      bf16_t *y, int64_t N) {
    const __m512 bl = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 bh = bias_up ? _mm512_loadu_ps(bias_up) : _mm512_setzero_ps();
    for (int64_t r = r0; r < r1; r++) {
        const __m512 lo = _mm512_add_ps(_mm512_load_ps(c + r * 32), bl), hi = _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), bh);
        if (gated)
            store_bf16(y + r * N, silu_mul16(round_bf16(lo), round_bf16(hi)));
        else
            _mm512_storeu_si512(y + r * N, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* c [32][32] float32 = rows 0..31 of a (row stride a_row elements) x the 32 columns of B tiles b0
 * (columns 0-15) and b1 (16-31), K in steps of 32; meanwhile the previous micro-block's sums (wait)
 * are stored a few rows per step of K, between the TDPs: the vector work (conversion, SiLU) then
 * runs while the tiles compute. Stored after the block's TDPs instead, it added ~25% to a GEMM of
 * K = 576 (the tile unit and the vector units took turns); interleaved, the layer GEMMs of
 * SmolLM2-135M took 0.81-0.82x the time at 1,000-2,000 rows, gate/up + SiLU 0.72-0.74x (2026-11-28,
 * Xeon with AMX; the same bits: the order of the stores changes, not their operations). Issuing
 * the next block's TDPs before the whole store, without the interleave, gained nothing. */
TGT_AMX static void micro_block(const bf16_t *a, int64_t a_row, const bf16_t *b0, const bf16_t *b1, int64_t K, float *c,
                                pending_t *wait, int gated, int64_t N) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t stride = a_row * (int64_t)sizeof(bf16_t), per = (wait->rows + K / 32 - 1) / (K / 32); /* K / 32 steps */
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(4, a + k, stride);
        _tile_loadd(6, b0 + k * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b1 + k * 16, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a + 16 * a_row + k, stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (wait->c && wait->done < wait->rows) {
            const int64_t r1 = wait->done + per < wait->rows ? wait->done + per : wait->rows;
            store_rows(wait->c, wait->done, r1, wait->bias, wait->bias_up, gated, wait->y, N);
            wait->done = r1;
        }
    }
    _tile_stored(0, c, 32 * sizeof(float));
    _tile_stored(1, c + 16, 32 * sizeof(float));
    _tile_stored(2, c + 16 * 32, 32 * sizeof(float));
    _tile_stored(3, c + 16 * 32 + 16, 32 * sizeof(float));
}

/* y [M, N] = x W^T + b; gated: W is [2 N, K], its first N rows the gate and the others the up
 * projection, and y = SiLU(x Wg^T + bg) * (x Wu^T + bu) (see store_rows). Each thread's micro-blocks
 * form one pipeline (micro_block), across its row blocks and work items; it stores its last one at
 * the end. */
TGT_AMX static void linear_items(const bf16_t *x, int64_t x_row, const bf16_t *wp, const float *bias, int64_t M, int64_t N,
                                 int64_t K, bf16_t *y, bf16_t *pad, int nthreads, int gated) {
    const int64_t cols = gated ? NC / 2 : NC; /* output columns per work item: the weight columns it reads are NC */
    const int64_t step = gated ? 16 : 32;     /* output columns per micro-block */
    const int64_t nm = (M + MC - 1) / MC, nn = (N + cols - 1) / cols, blk = (K / 2) * 32; /* blk: one 16-column block of wp */
#pragma omp parallel num_threads(nthreads)
    {
        amx_configure();
        float c[2][32 * 32] __attribute__((aligned(64))); /* this block's sums and the pending block's */
        pending_t wait = {NULL, 0, 0, NULL, NULL, NULL};
        int cur = 0;
        bf16_t *mine = pad + (size_t)omp_get_thread_num() * 32 * K;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < nm * nn; w++) {
            const int64_t m0 = (w % nm) * MC, n0 = (w / nm) * cols; /* column-major */
            const int64_t m1 = m0 + MC < M ? m0 + MC : M, n1 = n0 + cols < N ? n0 + cols : N;
            for (int64_t m = m0; m < m1; m += 32) {
                const int64_t rows = m1 - m < 32 ? m1 - m : 32;
                const bf16_t *a = x + m * x_row;
                int64_t a_row = x_row;
                if (rows < 32) { /* the last rows, padded with zeros in a copy */
                    for (int64_t r = 0; r < 32; r++) {
                        if (r < rows) memcpy(mine + r * K, x + (m + r) * x_row, sizeof(bf16_t) * K);
                        else memset(mine + r * K, 0, sizeof(bf16_t) * K);
                    }
                    a = mine;
                    a_row = K;
                }
                for (int64_t n = n0; n < n1; n += step) {
                    const bf16_t *b0 = wp + (n / 16) * blk, *b1 = gated ? wp + ((N + n) / 16) * blk : b0 + blk;
                    micro_block(a, a_row, b0, b1, K, c[cur], &wait, gated, N); /* stores all of wait's rows */
                    wait = (pending_t){c[cur], rows, 0, bias ? bias + n : NULL, bias ? bias + (gated ? N : 16) + n : NULL, y + m * N + n};
                    cur ^= 1;
                }
            }
        }
        if (wait.c) store_rows(wait.c, wait.done, wait.rows, wait.bias, wait.bias_up, gated, wait.y, N);
        _tile_release();
    }
}
#endif

/* linear_items with its scratch (the padded rows' copies), outside any parallel region; 0, 2 or 3
 * as rc_amx_linear returns. */
static int run_items(const bf16_t *x, int64_t x_row, const bf16_t *wp, const float *bias, int64_t M, int64_t N, int64_t K,
                     bf16_t *y, int nthreads, int gated) {
#ifdef RC_HAVE_AMX
    if (!rc_amx(-1)) return 3;
    bf16_t *pad = aligned_alloc(64, (size_t)nthreads * 32 * (size_t)K * sizeof(bf16_t));
    if (!pad) return 2;
    linear_items(x, x_row, wp, bias, M, N, K, y, pad, nthreads, gated);
    free(pad);
    return 0;
#else
    (void)x; (void)x_row; (void)wp; (void)bias; (void)M; (void)N; (void)K; (void)y; (void)nthreads; (void)gated;
    return 3;
#endif
}

/* y [M, N] bf16 (contiguous) = x [M, K] bf16 (row stride x_row) W^T + bias (float32 [N] or NULL),
 * wp: W packed by rc_amx_pack. Returns 0 on success, 1 if the arguments are out of range (N or K
 * not a multiple of 32, M < 1), 2 if out of memory, 3 if AMX does not run here (rc_amx). */
int rc_amx_linear(const bf16_t *x, int64_t x_row, const bf16_t *wp, const float *bias, int64_t M, int64_t N, int64_t K,
                  bf16_t *y, int nthreads) {
    if (M < 1 || N < 32 || K < 32 || N % 32 || K % 32 || x_row < K || nthreads < 1) return 1;
    return run_items(x, x_row, wp, bias, M, N, K, y, nthreads, 0);
}

/* y [M, I] bf16 (contiguous) = SiLU(x Wg^T + bg) * (x Wu^T + bu), the bits of rc_amx_linear's [M, 2 I]
 * product through rc_silu_mul, without writing it: wp packs W [2 I, K] (gate rows, then up rows;
 * rc_amx_pack), bias float32 [2 I] or NULL. Returns as rc_amx_linear (1: I not a multiple of 16). */
int rc_amx_linear_silu(const bf16_t *x, int64_t x_row, const bf16_t *wp, const float *bias, int64_t M, int64_t I, int64_t K,
                       bf16_t *y, int nthreads) {
    if (M < 1 || I < 16 || K < 32 || I % 16 || K % 32 || x_row < K || nthreads < 1) return 1;
    return run_items(x, x_row, wp, bias, M, I, K, y, nthreads, 1);
}
