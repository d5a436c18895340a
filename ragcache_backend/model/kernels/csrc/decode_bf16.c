/* A whole bf16 decode step in one call, and the few-row bf16 linear layer it is built on, for CPUs
 * with AVX512-BF16 (ragcache).
 *
 * Why: a decode step of a small model reads its weights once and otherwise does little; run as
 * one PyTorch GEMM and one native call per operation it pays ~9 dispatches and OpenMP regions per
 * layer (~270 a step for a 30-layer model). Here every layer of the step runs in one parallel
 * region: 11.8 -> 7.9 ms a step for SmolLM2-135M at batch 1 on a 2-core Zen 5, 1.36x the time of
 * reading the weights once (benchmarks/forward_vs_vllm.py, docs/benchmarks.md). Its barriers still
 * sleep where another thread of the process owns an OpenMP pool (model/kernels/openmp.py).
 *
 * The linear layer, y [M, N] = x [M, K] W [N, K]^T (+ b): W in PyTorch's own layout (no packed copy),
 * each thread streaming a contiguous range of W's rows once for all M rows (M <= 16); per output,
 * VDPBF16PS over K in steps of 32 into one float32 register, its 16 lanes summed (four outputs'
 * together, sum4), the bias added, one bf16 rounding (round to nearest even). An output's
 * operations never depend on M or on the other rows, so a generated token gets the same bits alone
 * or in a batch. The bits differ from
 * PyTorch's (oneDNN's) bf16 GEMM by the float32 summation order: a prompt never takes this path
 * (its K/V must be the same bits cached or not, which the per-operation path keeps), and a
 * generated token's K/V is not kept as cache blocks in bf16.
 *
 * On CPUs with AMX the step's GEMMs run on tiles instead (linear_tiles_for, over the weights as
 * linear_amx.c packs them, where the layers have them: rc_layer_tiles_t): the A tile and the sums
 * configured with the step's M rows, so a 1-row step reads and computes one row. Each output then
 * gets rc_amx_linear's bits for its row, the bits the per-operation path gives every row of a step
 * on those CPUs (linear.py, Linear.amx). SmolLM2-135M, 1,024 tokens of context, a 2-core Xeon with
 * AMX (2026-11-28, benchmarks/forward_vs_vllm.py): decode steps at batch 1 / 4 / 8 / 16 took 15.9 /
 * 27.8 / 40.1 / 57.9 ms on linear_for, 12.9 / 19.5 / 27.3 / 39.8 ms on tiles.
 *
 * The step: per layer QKV, RoPE + KV write, decode attention (rc_decode_chunk over chunks of
 * DECODE_CHUNK keys shared among the threads, then rc_decode_merge: the per-operation path's
 * kernels, same bits), O, add + RMSNorm, gate/up, SiLU x up, down, add + RMSNorm, the threads
 * meeting between the phases; the row phases are the per-operation kernels' rows (same bits).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16_common.h"

#define NT 4 /* outputs (rows of W) per register tile (sum4 reduces four) */
#define SEQ_ROWS 8 /* most input rows for which a tile reads its weight rows one after another */

/* Outputs n0 .. n0 + NT - 1 of rows m0 .. m0 + MR - 1 (MR a constant after inlining). next: the
 * next tile's weight rows, prefetched meanwhile (or NULL): the rows of four rows' tiles after the
 * first come from the cache, so without it the loads of the next tile's rows stall (batch 16: a
 * decode step 0.77x the time with it, 16 tokens of context; batch 1 unchanged).
 * seq (a call of at most SEQ_ROWS rows, decode at batch 1-8: bound by reading W): the tile reads its
 * weight rows one after another, each start to end, instead of the four side by side: one
 * sequential stream, which the hardware prefetcher follows. On a 2-core Zen 4, weights larger than
 * the caches: one row 16 -> 24-38 GB/s (a batch-1 decode step 0.70x the time); a layer's GEMMs at
 * 2 rows 0.52-0.77x the time, 4 rows 0.66-0.86x, 8 rows 0.83-0.89x (a batch-4 decode step 0.89x).
 * More rows keep the four side by side: 16 independent VDPBF16PS chains, not 4 per weight row (16
 * rows in sequence: 1.2-1.3x slower). Each output's sum runs over k in the same order either way:
 * the same bits whatever M. The seq path does not prefetch next (the hardware prefetcher follows
 * the one stream; measured without). */
TGT_BF16 __attribute__((always_inline)) static inline void tile(const bf16_t *x, int64_t K, const bf16_t *W, const bf16_t *b,
                                                                int64_t N, bf16_t *y, int64_t n0, int64_t m0, const int MR,
                                                                const bf16_t *next, const int seq) {
    __m512 acc[NT][4];
    for (int i = 0; i < NT; i++)
        for (int j = 0; j < MR; j++) acc[i][j] = _mm512_setzero_ps();
    const bf16_t *w0 = W + n0 * K, *x0 = x + m0 * K;
    if (seq) { /* few rows: each weight row streamed start to end, the tile's rows one after another */
        for (int i = 0; i < NT; i++)
            for (int64_t k = 0; k < K; k += 32) {
                const __m512bh wv = (__m512bh)_mm512_loadu_si512(w0 + i * K + k);
                for (int j = 0; j < MR; j++)
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, (__m512bh)_mm512_loadu_si512(x0 + j * K + k));
            }
    } else
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[NT], xv[4];
        for (int i = 0; i < NT; i++) wv[i] = (__m512bh)_mm512_loadu_si512(w0 + i * K + k);
        if (next)
            for (int i = 0; i < NT; i++) _mm_prefetch((const char *)(next + i * K + k), _MM_HINT_T0);
        for (int j = 0; j < MR; j++) xv[j] = (__m512bh)_mm512_loadu_si512(x0 + j * K + k);
        for (int i = 0; i < NT; i++)
            for (int j = 0; j < MR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], xv[j]);
    }
    const __m128 bias = b ? _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(b + n0))), 16))
                          : _mm_setzero_ps(); /* outputs n0 .. n0 + 3 */
    for (int j = 0; j < MR; j++) {
        __m128 sums = _mm_add_ps(sum4(acc[0][j], acc[1][j], acc[2][j], acc[3][j]), bias);
        _mm_storel_epi64((__m128i *)(y + (m0 + j) * N + n0), (__m128i)_mm_cvtneps_pbh(sums));
    }
}

/* The linear layer inside a parallel region (an omp for over the outputs, static: each thread
 * streams one contiguous range of W). K % 32 == 0, N % NT == 0. */
TGT_BF16 static void linear_for(const bf16_t *x, int64_t M, int64_t K, const bf16_t *W, const bf16_t *b, int64_t N, bf16_t *y) {
    const int seq = M <= SEQ_ROWS;
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NT) {
        int64_t m0 = 0;
        const bf16_t *next = n0 + 2 * NT <= N ? W + (n0 + NT) * K : NULL; /* the next tile's rows, fetched meanwhile */
        for (; m0 + 4 <= M; m0 += 4) tile(x, K, W, b, N, y, n0, m0, 4, m0 ? NULL : next, seq);
        switch (M - m0) {
        case 3: tile(x, K, W, b, N, y, n0, m0, 3, m0 ? NULL : next, seq); break;
        case 2: tile(x, K, W, b, N, y, n0, m0, 2, m0 ? NULL : next, seq); break;
        case 1: tile(x, K, W, b, N, y, n0, m0, 1, m0 ? NULL : next, seq); break;
        default: break;
        }
    }
}

/* y [M, N] = x [M, K] W [N, K]^T (+ b [N]), bf16, for few rows (see the file's comment).
 * Returns 0, or 1 when K is not a multiple of 32 or N not a multiple of 4. */
TGT_BF16 int rc_linear_rows(const bf16_t *x, int64_t M, int64_t K, const bf16_t *W, const bf16_t *b, int64_t N, bf16_t *y,
                            int nthreads) {
    if (M < 1 || K < 32 || K % 32 || N < NT || N % NT || nthreads < 1) return 1;
#pragma omp parallel num_threads(nthreads)
    linear_for(x, M, K, W, b, N, y);
    return 0;
}

#ifdef RC_HAVE_AMX
/* linear_for on AMX tiles (CPUs with AMX-BF16): y [M, N] = x [M, K] W^T (+ b), W laid out by
 * rc_amx_pack (linear_amx.c), inside a parallel region whose threads configured their tiles with
 * amx_configure_rows(M) (so the A tile and the sums have M rows: only x's M rows are read). Per
 * group of 64 output columns (an omp for, static: each thread streams a contiguous range of the
 * packed weight once), four 1 KB B tiles per 32 inputs against the one A tile, TDPBF16PS over K in
 * order: each output the same operations as rc_amx_linear's for the same row (its bits, whatever
 * M or the other rows), the bias (bf16, exact in float32) added, one bf16 rounding. N % 32 == 0. */
TGT_AMX static void linear_tiles_for(const bf16_t *x, int64_t x_row, int64_t M, int64_t K, const bf16_t *wp, const bf16_t *b,
                                     const float *b32, int64_t N, bf16_t *y) {
    float c[16 * 64] __attribute__((aligned(64)));
    const int64_t xs = x_row * (int64_t)sizeof(bf16_t), blk = (K / 2) * 32; /* one 16-column block of wp */
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 64) {
        const bf16_t *w0 = wp + (n0 / 16) * blk;
        const int64_t cols = N - n0 < 64 ? N - n0 : 64;
        const int full = cols == 64; /* else the last 32 columns: tiles 0 and 1 only */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += 32) {
            _tile_loadd(4, x + k, xs);
            _tile_loadd(5, w0 + k * 16, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, w0 + blk + k * 16, 64);
            _tile_dpbf16ps(1, 4, 6);
            if (full) {
                _tile_loadd(7, w0 + 2 * blk + k * 16, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, w0 + 3 * blk + k * 16, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, c, 64 * sizeof(float));
        _tile_stored(1, c + 16, 64 * sizeof(float));
        _tile_stored(2, c + 32, 64 * sizeof(float));
        _tile_stored(3, c + 48, 64 * sizeof(float));
        for (int64_t j = 0; j < cols; j += 32) {
            const __m512 bl = b ? load_bf16(b + n0 + j) : b32 ? _mm512_loadu_ps(b32 + n0 + j) : _mm512_setzero_ps();
            const __m512 bh = b ? load_bf16(b + n0 + j + 16) : b32 ? _mm512_loadu_ps(b32 + n0 + j + 16) : _mm512_setzero_ps();
            for (int64_t m = 0; m < M; m++) {
                const __m512 lo = _mm512_add_ps(_mm512_load_ps(c + m * 64 + j), bl);
                const __m512 hi = _mm512_add_ps(_mm512_load_ps(c + m * 64 + j + 16), bh);
                _mm512_storeu_si512(y + m * N + n0 + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
        }
    }
}

TGT_AMX static void tiles_begin(int64_t rows) { amx_configure_rows((int)rows); }
TGT_AMX static void tiles_end(void) { _tile_release(); }
#endif

/* y [M, N] (contiguous) = x [M, K] (row stride x_row) W^T + bias (float32 [N] or NULL) for M <= 16,
 * W packed by rc_amx_pack: linear_tiles_for on tiles of M rows, rc_amx_linear's bits for every row
 * (which pads a call to 32-row blocks: at 1-2 rows the whole weight's TDPs for 32). Returns 0, 1
 * on bad arguments, 3 where AMX does not run (rc_amx). */
TGT_BF16 int rc_amx_linear_rows(const bf16_t *x, int64_t x_row, const bf16_t *wp, const float *bias, int64_t M, int64_t N,
                                int64_t K, bf16_t *y, int nthreads) {
    if (M < 1 || M > 16 || N < 32 || K < 32 || N % 32 || K % 32 || x_row < K || nthreads < 1) return 1;
#ifdef RC_HAVE_AMX
    if (!rc_amx(-1)) return 3;
#pragma omp parallel num_threads(nthreads)
    {
        tiles_begin(M);
        linear_tiles_for(x, x_row, M, K, wp, NULL, bias, N, y);
        tiles_end();
    }
    return 0;
#else
    (void)x; (void)wp; (void)bias; (void)y;
    return 3;
#endif
}

/* A layer's linear: on AMX tiles where the layer has its weight packed for them (tiles not NULL),
 * else linear_for. */
TGT_BF16 static inline void layer_linear(const bf16_t *x, int64_t M, int64_t K, const bf16_t *W, const bf16_t *tiles,
                                         const bf16_t *b, int64_t N, bf16_t *y) {
#ifdef RC_HAVE_AMX
    if (tiles) {
        linear_tiles_for(x, K, M, K, tiles, b, NULL, N, y);
        return;
    }
#endif
    (void)tiles;
    linear_for(x, M, K, W, b, N, y);
}

/* One decoder layer's weights, as rc_decode_step reads them (bf16). */
typedef struct {
    const bf16_t *qkv_w, *qkv_b;   /* [(Hq + 2 Hkv) D, H] and its bias or NULL */
    const bf16_t *o_w, *o_b;       /* [H, Hq D] */
    const bf16_t *gu_w;            /* [2 I, H]: gate rows, then up rows */
    const bf16_t *down_w, *down_b; /* [H, I] */
    const bf16_t *post_norm;       /* [H]: post-attention RMSNorm */
    const bf16_t *next_norm;       /* [H]: the next layer's input RMSNorm, or the final norm */
    float post_eps, next_eps;
} rc_layer_t;

/* One decoder layer's GEMM weights laid out for AMX tiles (rc_amx_pack), each NULL where that GEMM
 * runs on linear_for: the same choice, GEMM by GEMM, as the per-operation path's (linear.py's
 * Linear.amx), so a generated token's bits do not depend on which path ran its step. */
typedef struct {
    const bf16_t *qkv, *o, *gu, *down;
} rc_layer_tiles_t;

/* Present in every library whose rc_decode_step takes the tiles argument (library.py sets the
 * ctypes signature by it: an older revision's library, built by benchmarks/kernel_ab.py, has not). */
int rc_decode_takes_tiles(void) { return 1; }

/* Every decoder layer of a step whose M rows (M <= 16) are all generated tokens, in one call and
 * one parallel region.
 *   h: [M, H] residual stream (in: the embeddings; updated in place);
 *   x: [M, H] in: layer 0's input-normed rows; out: the final-normed rows;
 *   cos, sin: [M, D] float32; k_base, v_base: the arena, layer l at + l * layer_stride ([slots, Hkv, D]);
 *   write: [M] slot of each row's new K/V; slots/ctx_off: each row's context (its new token last);
 *   tiles: [L] the layers' GEMM weights packed for AMX (rc_layer_tiles_t), or NULL: every GEMM on
 *     linear_for.
 * Returns 0, 1 on bad arguments (tiles where AMX does not run, rc_amx), 2 when out of memory. */
TGT_BF16 int rc_decode_step(const rc_layer_t *layers, int64_t L, bf16_t *h, bf16_t *x, int64_t M, int64_t H, int64_t Hq,
                            int64_t Hkv, int64_t D, int64_t I, const float *cos, const float *sin, bf16_t *k_base,
                            bf16_t *v_base, int64_t layer_stride, const int64_t *write, const int64_t *slots,
                            const int64_t *ctx_off, float scale, int nthreads, const rc_layer_tiles_t *tiles) {
    if (M < 1 || M > 16 || L < 1 || Hkv < 1 || Hq % Hkv || Hq / Hkv > 8 || D % 64 || D > 256 || H % 32 || I % 32 ||
        nthreads < 1)
        return 1;
    for (int64_t b = 0; b < M; b++)
        if (ctx_off[b + 1] - ctx_off[b] < 1) return 1;
#ifdef RC_HAVE_AMX
    if (tiles && !rc_amx(-1)) return 1;
#else
    if (tiles) return 1;
#endif
    const int64_t g = Hq / Hkv, row = (Hq + 2 * Hkv) * D, slot_row = Hkv * D;
    bf16_t *qkv = malloc(sizeof(bf16_t) * (size_t)(M * row));
    bf16_t *att = malloc(sizeof(bf16_t) * (size_t)(M * Hq * D));
    bf16_t *tmp = malloc(sizeof(bf16_t) * (size_t)(M * H));
    bf16_t *gu = malloc(sizeof(bf16_t) * (size_t)(M * 2 * I));
    bf16_t *act = malloc(sizeof(bf16_t) * (size_t)(M * I));
    /* a generated token's attention in chunks of DECODE_CHUNK keys, each (row, chunk) one work item */
    int64_t nitems = 0;
    for (int64_t b = 0; b < M; b++) nitems += (ctx_off[b + 1] - ctx_off[b] + DECODE_CHUNK - 1) / DECODE_CHUNK;
    int64_t *item_row = malloc(sizeof(int64_t) * (size_t)nitems), *chunks_of = malloc(sizeof(int64_t) * (size_t)(M + 1));
    float *parts = malloc(sizeof(float) * (size_t)(nitems * Hq * (D + 2)));
    int failed = 0;
    if (!qkv || !att || !tmp || !gu || !act || !item_row || !chunks_of || !parts) {
        failed = 2;
        goto done;
    }
    chunks_of[0] = 0;
    for (int64_t b = 0; b < M; b++) {
        chunks_of[b + 1] = chunks_of[b] + (ctx_off[b + 1] - ctx_off[b] + DECODE_CHUNK - 1) / DECODE_CHUNK;
        for (int64_t c = chunks_of[b]; c < chunks_of[b + 1]; c++) item_row[c] = b;
    }
#pragma omp parallel num_threads(nthreads)
    {
#ifdef RC_HAVE_AMX
    if (tiles) tiles_begin(M);
#endif
    for (int64_t l = 0; l < L; l++) {
        const rc_layer_t *w = layers + l;
        const rc_layer_tiles_t none = {NULL, NULL, NULL, NULL}, *t = tiles ? tiles + l : &none;
        bf16_t *kc = k_base + l * layer_stride, *vc = v_base + l * layer_stride;
        layer_linear(x, M, H, w->qkv_w, t->qkv, w->qkv_b, row, qkv);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < M; n++)
            rc_rope_write_row(qkv + n * row, Hq, Hkv, D, cos + n * D, sin + n * D, kc + write[n] * slot_row,
                              vc + write[n] * slot_row);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nitems; it++) {
            const int64_t b = item_row[it], c0 = (it - chunks_of[b]) * DECODE_CHUNK, S = ctx_off[b + 1] - ctx_off[b];
            rc_decode_chunk(qkv + b * row, D, g, Hkv, S - c0 < DECODE_CHUNK ? S - c0 : DECODE_CHUNK, kc, vc, slot_row,
                            slots + ctx_off[b] + c0, scale, parts + it * Hq * (D + 2));
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < M * Hq; u++) {
            const int64_t b = u / Hq, hq = u % Hq;
            rc_decode_merge(parts + chunks_of[b] * Hq * (D + 2), chunks_of[b + 1] - chunks_of[b], Hq, D, hq, att + (b * Hq + hq) * D);
        }
        layer_linear(att, M, Hq * D, w->o_w, t->o, w->o_b, H, tmp);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < M; n++) rc_add_rms_norm_row(h + n * H, tmp + n * H, w->post_norm, w->post_eps, H, x + n * H);
        layer_linear(x, M, H, w->gu_w, t->gu, NULL, 2 * I, gu);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < M; n++) rc_silu_mul_row(gu + n * 2 * I, gu + n * 2 * I + I, I, act + n * I);
        layer_linear(act, M, I, w->down_w, t->down, w->down_b, H, tmp);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < M; n++) rc_add_rms_norm_row(h + n * H, tmp + n * H, w->next_norm, w->next_eps, H, x + n * H);
    }
#ifdef RC_HAVE_AMX
    if (tiles) tiles_end();
#endif
    }
done:
    free(qkv); free(att); free(tmp); free(gu); free(act); free(item_row); free(chunks_of); free(parts);
    return failed;
}
