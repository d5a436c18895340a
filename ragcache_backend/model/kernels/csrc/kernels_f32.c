/* Native float32 kernels for x86 CPUs with AVX2 and FMA (ragcache): attention over the paged KV
 * arena for a whole forward step (rc32_paged_attention), and the fused row-wise steps of a Llama
 * decoder layer (RoPE + KV write, residual add + RMSNorm, SiLU(gate) * up).
 *
 * They run on every x86-64 CPU since Haswell / Zen 1 (AVX-512 CPUs included), where the bf16
 * kernels (paged_attention_bf16.c, AVX512-BF16 only) cannot. Where the CPU has AVX-512F the
 * attention's FMA loops (prompt QK^T tiles and PV, decode PV) run on 512-bit registers
 * (score_block512, pv_block512, pv_tile512; rc32_wide): every lane does the same FMAs in the same
 * order as at 256 bits, so the results are the same bits on either kind of CPU.
 *
 * Prompt tokens (attend_item) compute, for T new queries at absolute positions P .. P+T-1 (GQA:
 * query head hq reads KV head hq / g), causal attention over context slots[0 .. P+T-1] read from
 * the arena: out[t, hq] = softmax(scale * q[t, hq] . K[0..P+t]^T) V[0..P+t]. Rows may instead sit at
 * explicit positions p_t inside the context (chunk-cache recomputation: ascending, < S; qpos), and
 * then attend to K[0..p_t], V[0..p_t] with the same arithmetic. Keys are packed per
 * call into [key/8][D][8] panels (QK^T as broadcast-FMA, 6 query vectors x 16 keys per register
 * tile: with GQA groups of 3, two positions' heads), values into [key][D] rows (PV: 6 query vectors
 * x 16 dims per tile), so the inner loops read contiguous aligned memory and no slot indices.
 * Online softmax in float32 over key blocks of 64 fixed at absolute key positions.
 *
 * Row independence: every query row is computed with the same operations in the same order
 * whatever the other rows of the call are: (1) key blocks sit at absolute positions, (2) a block
 * past a row's causal limit leaves the row unchanged (rescale exactly 1, probabilities exactly 0),
 * (3) rows are tiled side by side, never reduced together. So a prompt row's output is the same
 * whether its prefix came from the cache (small T, large P) or was computed in the same call, and
 * a row at an explicit position p gives the bits of the ordinary row at position p over the same keys.
 *
 * Generated tokens (decode_heads, decode_merge) read the arena without packing, split their
 * context into key chunks (flash-decoding) so two threads share even a single sequence, and merge
 * the chunks' partial softmax sums.
 *
 * Threads: OpenMP, linked against the libgomp torch has already loaded (its thread pool).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_exp.h" /* exp256, exp512: the same bits per lane */

#define TGT __attribute__((target("avx2,fma")))
#define TGT512 __attribute__((target("avx512f,avx2,fma")))
#define KB 64      /* keys per softmax block */
#define QT 6       /* query vectors per register tile (12 accumulators of 16) */
#define QPOS 16    /* query positions per prompt work item */
#define DMAX 256   /* largest head size */
#define HKVMAX 256 /* most KV heads in one decode work item */
#define DCHUNK 512 /* keys per decode chunk (fixed: a row's result never depends on the batch) */

int rc32_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* Whether the attention's inner loops (prompt rows: QK^T tiles, online softmax, PV; decode rows:
 * PV) run on 512-bit registers: on CPUs with AVX-512F by default. Every lane does the same FMAs in the same order at either width, so both
 * give the same bits; request 0 or 1 sets it (1 only where the CPU has AVX-512F), -1 only asks. */
static int wide_isa = -1;
int rc32_wide(int request) {
    if (request < 0 && wide_isa >= 0) return wide_isa; /* every attention call asks: no CPU probe then */
    __builtin_cpu_init();
    const int can = __builtin_cpu_supports("avx512f");
    wide_isa = request >= 0 ? request && can : can;
    return wide_isa;
}

TGT static inline float hsum256(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

TGT static inline float hmax256(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* Eight vectors' horizontal sums as one vector: out[k] = sum(a[k]). */
TGT static inline __m256 hsum8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    t0 = _mm256_hadd_ps(t0, t1);
    t2 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20), _mm256_permute2f128_ps(t0, t2, 0x31));
}

/* Lanes j0 .. j0+7 that are below `valid`, as an all-ones mask. */
TGT static inline __m256 lanes_below(int64_t j0, int64_t valid) {
    __m256i idx = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)j0));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid), idx));
}

/* ---- prompt rows --------------------------------------------------------------------------- */

/* Pack keys [start, end) of KV head h into kp ([S_pad/pw][D][pw] floats: panels of pw = 8 keys
 * for 256-bit tiles, 16 for 512-bit ones); keys >= S are zero. */
static void pack_keys(const float *kc, int64_t slot_row, const int64_t *slots, int64_t S, int64_t h, int64_t D,
                      int64_t start, int64_t end, int64_t pw, float *kp) {
    for (int64_t j = start; j < end; j++) {
        float *dst = kp + (j / pw) * D * pw + (j % pw);
        if (j < S) {
            const float *row = kc + slots[j] * slot_row + h * D;
            for (int64_t d = 0; d < D; d++) dst[d * pw] = row[d];
        } else {
            for (int64_t d = 0; d < D; d++) dst[d * pw] = 0.0f;
        }
    }
}

/* Copy values [start, end) of KV head h into vp ([S_pad][D] floats, row j = key j); rows >= S are zero. */
static void pack_values(const float *vc, int64_t slot_row, const int64_t *slots, int64_t S, int64_t h, int64_t D,
                        int64_t start, int64_t end, float *vp) {
    for (int64_t j = start; j < end; j++) {
        if (j < S) memcpy(vp + j * D, vc + slots[j] * slot_row + h * D, sizeof(float) * (size_t)D);
        else memset(vp + j * D, 0, sizeof(float) * (size_t)D);
    }
}

/* Scores of a tile's QT query rows against 16 packed keys (two [D][8] panels from k0), scaled:
 * dst[i * dst_row + 0 .. 15] = scale * q_i . K[0 .. 15]. The register tile of both prompt kernels
 * (attend_item, rc32_segment_mass), so a row's scores are the same bits in either. */
TGT static inline __attribute__((always_inline)) void score_tile16(const float *k0, int64_t D, const float *const *qv,
                                                                     __m256 vscale, float *dst, int64_t dst_row) {
    const float *k1 = k0 + D * 8;
    __m256 c[QT][2];
    for (int i = 0; i < QT; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m256 a = _mm256_load_ps(k0 + d * 8), b = _mm256_load_ps(k1 + d * 8);
        for (int i = 0; i < QT; i++) {
            __m256 bq = _mm256_broadcast_ss(qv[i] + d);
            c[i][0] = _mm256_fmadd_ps(a, bq, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(b, bq, c[i][1]);
        }
    }
    for (int i = 0; i < QT; i++) {
        _mm256_store_ps(dst + i * dst_row, _mm256_mul_ps(c[i][0], vscale));
        _mm256_store_ps(dst + i * dst_row + 8, _mm256_mul_ps(c[i][1], vscale));
    }
}

/* The 512-bit forms of the prompt tile's two inner loops (AVX-512F CPUs; see rc32_wide). Each
 * lane does what the 256-bit form does (FMAs in d order for a score, in key order for a value
 * sum, from the same operands), so the results are the same bits.
 * Scores of QT query rows against the keys [0, kend) of one KB-key block, 32 at a time from two
 * [D][16] panels (kp: the block's first panel): s[i * KB + j] = scale * q_i . K[j]. */
TGT512 static void score_block512(const float *kp, int64_t D, const float *const *qv, float scale, int64_t kend,
                                  float *s) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t k32 = 0; k32 * 32 < kend; k32++) {
        const float *k0 = kp + 2 * k32 * D * 16, *k1 = k0 + D * 16;
        __m512 c[QT][2];
        for (int i = 0; i < QT; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            __m512 a = _mm512_loadu_ps(k0 + d * 16), b = _mm512_loadu_ps(k1 + d * 16);
            for (int i = 0; i < QT; i++) {
                __m512 bq = _mm512_set1_ps(qv[i][d]);
                c[i][0] = _mm512_fmadd_ps(a, bq, c[i][0]);
                c[i][1] = _mm512_fmadd_ps(b, bq, c[i][1]);
            }
        }
        for (int i = 0; i < QT; i++) {
            _mm512_storeu_ps(s + i * KB + 32 * k32, _mm512_mul_ps(c[i][0], vscale));
            _mm512_storeu_ps(s + i * KB + 32 * k32 + 16, _mm512_mul_ps(c[i][1], vscale));
        }
    }
}

/* One row's online-softmax step over a KB-key block of scores si (0 < valid <= KB keys below the
 * row's limit), in place: the probabilities replace the scores (0 from valid on), m and l are
 * updated and alpha is the rescale of the row's earlier sums. The 256-bit form's arithmetic: the
 * max is exact in any order, exp512 is exp256 per lane, and the sum is taken 8 lanes at a time in
 * the 256-bit order. */
TGT512 static void softmax_row512(float *si, int64_t valid, float *m, float *l, float *alpha) {
    __m512 bm = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < valid; j += 16) {
        const __mmask16 k = valid - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (valid - j)) - 1);
        bm = _mm512_max_ps(bm, _mm512_mask_blend_ps(k, _mm512_set1_ps(-INFINITY), _mm512_loadu_ps(si + j)));
    }
    const float bmax = _mm512_reduce_max_ps(bm);
    const float mnew = bmax > *m ? bmax : *m;
    *alpha = mnew == *m ? 1.0f : expf(*m - mnew);
    const __m512 mv = _mm512_set1_ps(mnew);
    for (int64_t j = 0; j < KB; j += 16) {
        __m512 p = _mm512_setzero_ps();
        if (j < valid) {
            const __mmask16 k = valid - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (valid - j)) - 1);
            p = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_loadu_ps(si + j), mv)));
        }
        _mm512_storeu_ps(si + j, p);
    }
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < KB; j += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(si + j));
    *l = *l * *alpha + hsum256(sum);
    *m = mnew;
}

/* acc[i][0..D) = acc[i] * alpha[i] + sum over keys j < n of p[i][j] v_j for QT rows (acc: rows of
 * DMAX floats, p: rows of KB floats, vblk: the block's values [KB][D]), 32 dims per register tile
 * (16 for a last odd tile: D is a multiple of 16). */
TGT512 static void pv_block512(float *acc, const float *alpha, const float *p, const float *vblk, int64_t n, int64_t D) {
    int64_t dg = 0;
    for (; dg + 32 <= D; dg += 32) {
        __m512 o[QT][2];
        for (int i = 0; i < QT; i++) {
            __m512 a = _mm512_set1_ps(alpha[i]);
            o[i][0] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * DMAX + dg), a);
            o[i][1] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * DMAX + dg + 16), a);
        }
        for (int64_t j = 0; j < n; j++) {
            const float *vr = vblk + j * D + dg;
            __m512 va = _mm512_loadu_ps(vr), vb = _mm512_loadu_ps(vr + 16);
            for (int i = 0; i < QT; i++) {
                __m512 bp = _mm512_set1_ps(p[i * KB + j]);
                o[i][0] = _mm512_fmadd_ps(bp, va, o[i][0]);
                o[i][1] = _mm512_fmadd_ps(bp, vb, o[i][1]);
            }
        }
        for (int i = 0; i < QT; i++) {
            _mm512_storeu_ps(acc + i * DMAX + dg, o[i][0]);
            _mm512_storeu_ps(acc + i * DMAX + dg + 16, o[i][1]);
        }
    }
    if (dg < D) {
        __m512 o[QT];
        for (int i = 0; i < QT; i++) o[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * DMAX + dg), _mm512_set1_ps(alpha[i]));
        for (int64_t j = 0; j < n; j++) {
            __m512 va = _mm512_loadu_ps(vblk + j * D + dg);
            for (int i = 0; i < QT; i++) o[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * KB + j]), va, o[i]);
        }
        for (int i = 0; i < QT; i++) _mm512_storeu_ps(acc + i * DMAX + dg, o[i]);
    }
}

/* Per-tile state of attend_item: QT query vectors (the last tile padded with its last vector). */
typedef struct {
    int64_t lim[QT], tpos[QT], head[QT], maxlim;
    float m[QT], l[QT];
    const float *qv[QT];
} tile32_t;

/* Query vectors per prompt work item at most (QPOS positions x g heads), in tiles of QT. */
static inline int64_t item_tiles(int64_t g) { return (QPOS * g + QT - 1) / QT; }

/* One work item: query rows [t0, t1) of KV head h, all g query heads; row t sits at position
 * qpos[t] (qpos: the sequence's row positions) or, with qpos NULL, P + t.
 * kp, vp: this head's packed keys and values (pack_keys, pack_values); wide: kp holds 16-key
 * panels and the inner loops run on 512-bit registers (the same bits).
 * The key blocks are the outer loop and the item's tiles the inner one, so a block's keys and values
 * (16 KB each at D = 64) are fetched once per item and stay in L1/L2 for all its tiles (the other
 * order streamed the head's whole K and V once per tile: 0.90x the time on a Zen 3, 2026-11-29).
 * Each tile's rows see the same operations in the same order either way. tiles: item_tiles(g)
 * states; accs: as many [QT][DMAX] accumulators. */
TGT static void attend_item(const float *q, int64_t q_row, int64_t D, int64_t g, int64_t h, int64_t t0, int64_t t1,
                            int64_t P, const int64_t *qpos, const float *kp, const float *vp, float scale, float *out,
                            int64_t out_row, int wide, tile32_t *tiles, float *accs) {
    const int64_t nvec = (t1 - t0) * g, ntiles = (nvec + QT - 1) / QT;
    float s[QT][KB] __attribute__((aligned(64)));
    float alpha[QT];
    const __m256 vscale = _mm256_set1_ps(scale);
    int64_t nblocks = 0;
    for (int64_t ti = 0; ti < ntiles; ti++) {
        tile32_t *tl = tiles + ti;
        tl->maxlim = 0;
        for (int i = 0; i < QT; i++) {
            int64_t v = ti * QT + i < nvec ? ti * QT + i : nvec - 1; /* pad a short tile with its last row */
            tl->tpos[i] = t0 + v / g;
            tl->head[i] = h * g + v % g;
            tl->lim[i] = qpos ? qpos[tl->tpos[i]] : P + tl->tpos[i];
            if (tl->lim[i] > tl->maxlim) tl->maxlim = tl->lim[i];
            tl->qv[i] = q + tl->tpos[i] * q_row + tl->head[i] * D;
            tl->m[i] = -INFINITY;
            tl->l[i] = 0.0f;
            memset(accs + (ti * QT + i) * DMAX, 0, sizeof(float) * (size_t)D);
        }
        if (tl->maxlim / KB + 1 > nblocks) nblocks = tl->maxlim / KB + 1;
    }
    for (int64_t kb = 0; kb < nblocks; kb++) {
        const float *vblk = vp + kb * KB * D;
        for (int64_t ti = 0; ti < ntiles; ti++) {
            tile32_t *tl = tiles + ti;
            float *acc = accs + ti * QT * DMAX;
            if (kb > tl->maxlim / KB) continue; /* past every row of the tile */
            /* scores of the tile's rows against keys kb*64 .. (up to maxlim), 16 keys at a time */
            const int64_t kend = tl->maxlim - kb * KB + 1 < KB ? tl->maxlim - kb * KB + 1 : KB;
            if (wide)
                score_block512(kp + kb * KB * D, D, tl->qv, scale, kend, s[0]);
            else
                for (int64_t k16 = 0; k16 * 16 < kend; k16++)
                    score_tile16(kp + (kb * (KB / 8) + 2 * k16) * D * 8, D, tl->qv, vscale, s[0] + 16 * k16, KB);
            /* online softmax per row; probabilities replace the scores in s */
            int64_t maxvalid = 0;
            for (int i = 0; i < QT; i++) {
                int64_t valid = tl->lim[i] - kb * KB + 1;
                if (valid > KB) valid = KB;
                if (valid <= 0) { /* past this row's causal limit: leave it untouched */
                    alpha[i] = 1.0f;
                    memset(s[i], 0, sizeof(s[i]));
                    continue;
                }
                if (valid > maxvalid) maxvalid = valid;
                if (wide) {
                    softmax_row512(s[i], valid, &tl->m[i], &tl->l[i], &alpha[i]);
                    continue;
                }
                /* only the vector holding the row's limit has lanes to mask */
                __m256 bm = _mm256_set1_ps(-INFINITY);
                for (int64_t j = 0; j < valid; j += 8) {
                    __m256 x = _mm256_load_ps(s[i] + j);
                    if (j + 8 > valid) x = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, lanes_below(j, valid));
                    bm = _mm256_max_ps(bm, x);
                }
                const float bmax = hmax256(bm);
                const float mnew = bmax > tl->m[i] ? bmax : tl->m[i];
                alpha[i] = mnew == tl->m[i] ? 1.0f : expf(tl->m[i] - mnew);
                const __m256 mv = _mm256_set1_ps(mnew);
                __m256 sum = _mm256_setzero_ps();
                for (int64_t j = 0; j < KB; j += 8) {
                    __m256 p = _mm256_setzero_ps();
                    if (j < valid) {
                        p = exp256(_mm256_sub_ps(_mm256_load_ps(s[i] + j), mv));
                        if (j + 8 > valid) p = _mm256_and_ps(p, lanes_below(j, valid));
                    }
                    _mm256_store_ps(s[i] + j, p);
                    sum = _mm256_add_ps(sum, p);
                }
                tl->l[i] = tl->l[i] * alpha[i] + hsum256(sum);
                tl->m[i] = mnew;
            }
            if (maxvalid == 0) continue;
            /* PV: acc[i] = acc[i] * alpha[i] + p[i] . V[block], 16 dims at a time */
            if (wide) {
                pv_block512(acc, alpha, s[0], vblk, maxvalid, D);
                continue;
            }
            for (int64_t dg = 0; dg < D; dg += 16) {
                __m256 o[QT][2];
                for (int i = 0; i < QT; i++) {
                    __m256 a = _mm256_set1_ps(alpha[i]);
                    o[i][0] = _mm256_mul_ps(_mm256_load_ps(acc + i * DMAX + dg), a);
                    o[i][1] = _mm256_mul_ps(_mm256_load_ps(acc + i * DMAX + dg + 8), a);
                }
                for (int64_t j = 0; j < maxvalid; j++) {
                    const float *vr = vblk + j * D + dg;
                    __m256 va = _mm256_load_ps(vr), vb = _mm256_load_ps(vr + 8);
                    for (int i = 0; i < QT; i++) {
                        __m256 bp = _mm256_broadcast_ss(s[i] + j);
                        o[i][0] = _mm256_fmadd_ps(bp, va, o[i][0]);
                        o[i][1] = _mm256_fmadd_ps(bp, vb, o[i][1]);
                    }
                }
                for (int i = 0; i < QT; i++) {
                    _mm256_store_ps(acc + i * DMAX + dg, o[i][0]);
                    _mm256_store_ps(acc + i * DMAX + dg + 8, o[i][1]);
                }
            }
        }
    }
    for (int64_t ti = 0; ti < ntiles; ti++) {
        const tile32_t *tl = tiles + ti;
        for (int i = 0; i < QT && ti * QT + i < nvec; i++) {
            const float *acc = accs + (ti * QT + i) * DMAX;
            const __m256 inv = _mm256_set1_ps(1.0f / tl->l[i]);
            float *dst = out + tl->tpos[i] * out_row + tl->head[i] * D;
            for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_load_ps(acc + d), inv));
        }
    }
}

/* ---- generated tokens ---------------------------------------------------------------------- */

/* Load one vector of every cache line of rows [a, b) (len floats each, at base + slots[t] * slot_row)
 * and discard them: plain loads with nothing depending on them run ahead in the out-of-order
 * window, so the rows come in at the speed of a plain read (on a 2-core Zen 3 guest ~13 GB/s over
 * shuffled arena blocks, where the decode loops reading them as they compute, with software
 * prefetch ahead, got ~7 GB/s: the prefetches did not help, measured with and without). */
TGT static inline void touch_rows(const float *base, const int64_t *slots, int64_t a, int64_t b, int64_t slot_row,
                                  int64_t len) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t t = a; t < b; t++) {
        const float *r = base + slots[t] * slot_row;
        for (int64_t c = 0; c < len; c += 16) acc = _mm256_or_ps(acc, _mm256_loadu_ps(r + c));
    }
    __asm__ volatile("" ::"x"(acc)); /* the loads stay */
}

/* o[i][D] (+)= sum over keys t in [jb, je) of p[i][t] v_t for gi (1..4, a constant once inlined, so
 * the accumulators stay in registers: with a variable height the compiler kept them on the stack,
 * every FMA waiting on a store) query heads of one KV head, 16 dims per register tile; o is read
 * back unless jb == 0. The same FMAs in the same order whatever the key blocks. vh: the KV head's
 * values at slot 0; p: [gi][n]. */
TGT __attribute__((always_inline)) static inline void pv_tile(const int gi, int64_t D, int64_t n, int64_t jb, int64_t je,
                                                              const float *vh, int64_t slot_row, const int64_t *slots,
                                                              const float *p, float *o) {
    for (int64_t dg = 0; dg < D; dg += 16) {
        __m256 acc[4][2];
        for (int i = 0; i < gi; i++) {
            acc[i][0] = jb > 0 ? _mm256_loadu_ps(o + i * D + dg) : _mm256_setzero_ps();
            acc[i][1] = jb > 0 ? _mm256_loadu_ps(o + i * D + dg + 8) : _mm256_setzero_ps();
        }
        for (int64_t t = jb; t < je; t++) {
            const float *vr = vh + slots[t] * slot_row + dg;
            __m256 va = _mm256_loadu_ps(vr), vb = _mm256_loadu_ps(vr + 8);
            for (int i = 0; i < gi; i++) {
                __m256 pt = _mm256_broadcast_ss(p + i * n + t);
                acc[i][0] = _mm256_fmadd_ps(pt, va, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(pt, vb, acc[i][1]);
            }
        }
        for (int i = 0; i < gi; i++) {
            _mm256_storeu_ps(o + i * D + dg, acc[i][0]);
            _mm256_storeu_ps(o + i * D + dg + 8, acc[i][1]);
        }
    }
}

/* pv_tile on 512-bit registers (AVX-512F CPUs, rc32_wide): 32 dims per register tile (16 for a
 * last odd tile), each lane the same FMAs in the same order, so the same bits. */
TGT512 __attribute__((always_inline)) static inline void pv_tile512(const int gi, int64_t D, int64_t n, int64_t jb,
                                                                    int64_t je, const float *vh, int64_t slot_row,
                                                                    const int64_t *slots, const float *p, float *o) {
    int64_t dg = 0;
    for (; dg + 32 <= D; dg += 32) {
        __m512 acc[4][2];
        for (int i = 0; i < gi; i++) {
            acc[i][0] = jb > 0 ? _mm512_loadu_ps(o + i * D + dg) : _mm512_setzero_ps();
            acc[i][1] = jb > 0 ? _mm512_loadu_ps(o + i * D + dg + 16) : _mm512_setzero_ps();
        }
        for (int64_t t = jb; t < je; t++) {
            const float *vr = vh + slots[t] * slot_row + dg;
            __m512 va = _mm512_loadu_ps(vr), vb = _mm512_loadu_ps(vr + 16);
            for (int i = 0; i < gi; i++) {
                __m512 pt = _mm512_set1_ps(p[i * n + t]);
                acc[i][0] = _mm512_fmadd_ps(pt, va, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(pt, vb, acc[i][1]);
            }
        }
        for (int i = 0; i < gi; i++) {
            _mm512_storeu_ps(o + i * D + dg, acc[i][0]);
            _mm512_storeu_ps(o + i * D + dg + 16, acc[i][1]);
        }
    }
    if (dg < D) {
        __m512 acc[4];
        for (int i = 0; i < gi; i++) acc[i] = jb > 0 ? _mm512_loadu_ps(o + i * D + dg) : _mm512_setzero_ps();
        for (int64_t t = jb; t < je; t++) {
            __m512 va = _mm512_loadu_ps(vh + slots[t] * slot_row + dg);
            for (int i = 0; i < gi; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * n + t]), va, acc[i]);
        }
        for (int i = 0; i < gi; i++) _mm512_storeu_ps(o + i * D + dg, acc[i]);
    }
}

/* The value block [jb, je) of one KV head for its g query heads, on 512-bit registers. */
TGT512 static void pv_head512(int64_t g, int64_t D, int64_t n, int64_t jb, int64_t je, const float *vh, int64_t slot_row,
                              const int64_t *slots, const float *scores, float *o) {
    for (int64_t i0 = 0; i0 < g; i0 += 4) {
        const int64_t gi = g - i0 < 4 ? g - i0 : 4;
        const float *sp = scores + i0 * n;
        float *op = o + i0 * D;
        switch (gi) {
        case 1: pv_tile512(1, D, n, jb, je, vh, slot_row, slots, sp, op); break;
        case 2: pv_tile512(2, D, n, jb, je, vh, slot_row, slots, sp, op); break;
        case 3: pv_tile512(3, D, n, jb, je, vh, slot_row, slots, sp, op); break;
        default: pv_tile512(4, D, n, jb, je, vh, slot_row, slots, sp, op); break;
        }
    }
}

/* Keys [j0, j1) of KV heads [h0, h1) for the g query heads per KV head of one generated token: per
 * query head i of KV head h, in head h's chunk block pp[h - h0]: the chunk's max score [2i], its sum
 * of exp(score - max) [2i+1], then at 2g + i*D the unnormalised o[i][D] = sum_j exp(s_j - max) v_j,
 * then g * (j1 - j0) floats of scratch for the scores.
 * The arena is read row by row: the heads of one slot are adjacent ([slots, Hkv, D]), so the keys
 * of every head of 8 slots are read together, and the values in blocks of DVB slots; every DTOUCH
 * keys (and values) are first touched (touch_rows), then computed on from the cache. Each head's
 * arithmetic is the one-head-at-a-time kernel's (the partial outputs are carried between value
 * blocks in o: a float stored and loaded unchanged), so a row's result is the same bits however its
 * heads are grouped, and as before this kernel. A decode step
 * stays memory-bound: on a 2-core Zen 3, 8 sequences of 900 keys over 30 layers read 332 MB in
 * ~31-33 ms with the touch (~10-11 GB/s) and ~43-46 ms without (plainly reading the same rows: ~26 ms). */
#define DVB 16 /* decode: values per block (one arena block of rows) */
#define DTOUCH 64 /* decode: keys (values) touched at a time, 48 KiB of rows at 3 KV heads of 64 */
_Static_assert(DTOUCH % DVB == 0 && DTOUCH % 8 == 0, "a touched block holds whole key and value blocks");
TGT static void decode_heads(const float *q, int64_t D, int64_t g, int64_t h0, int64_t h1, int64_t j0, int64_t j1,
                             const float *kc, const float *vc, int64_t slot_row, const int64_t *slots, float scale,
                             float *const *pp, int wide) {
    const int64_t n = j1 - j0;
    const __m256 sc8 = _mm256_set1_ps(scale);
    for (int64_t h = h0; h < h1; h++)
        for (int64_t i = 0; i < g; i++) pp[h - h0][2 * i] = -INFINITY;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const float *kr[8];
        for (int jj = 0; jj < 8; jj++) kr[jj] = kc + slots[j0 + j + jj] * slot_row;
        if (j % DTOUCH == 0)
            touch_rows(kc + h0 * D, slots + j0, j, j + DTOUCH < n ? j + DTOUCH : n, slot_row, (h1 - h0) * D);
        for (int64_t h = h0; h < h1; h++) {
            float *blk = pp[h - h0];
            for (int64_t i = 0; i < g; i++) {
                const float *qi = q + (h * g + i) * D;
                __m256 a[8];
                for (int jj = 0; jj < 8; jj++) a[jj] = _mm256_setzero_ps();
                for (int64_t c = 0; c < D; c += 8) {
                    __m256 qc = _mm256_loadu_ps(qi + c);
                    for (int jj = 0; jj < 8; jj++) a[jj] = _mm256_fmadd_ps(_mm256_loadu_ps(kr[jj] + h * D + c), qc, a[jj]);
                }
                __m256 sv = _mm256_mul_ps(hsum8(a), sc8);
                _mm256_storeu_ps(blk + g * (2 + D) + i * n + j, sv);
                float m = hmax256(sv);
                if (m > blk[2 * i]) blk[2 * i] = m;
            }
        }
    }
    for (int64_t h = h0; h < h1; h++) {
        float *blk = pp[h - h0], *scores = blk + g * (2 + D);
        for (int64_t i = 0; i < g; i++) {
            const float *qi = q + (h * g + i) * D;
            float *si = scores + i * n, m = blk[2 * i];
            for (int64_t t = j; t < n; t++) {
                const float *kr = kc + slots[j0 + t] * slot_row + h * D;
                __m256 a = _mm256_setzero_ps();
                for (int64_t c = 0; c < D; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(kr + c), _mm256_loadu_ps(qi + c), a);
                si[t] = hsum256(a) * scale;
                if (si[t] > m) m = si[t];
            }
            const __m256 mv = _mm256_set1_ps(m);
            __m256 sum = _mm256_setzero_ps();
            int64_t t = 0;
            for (; t + 8 <= n; t += 8) {
                __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(si + t), mv));
                _mm256_storeu_ps(si + t, e);
                sum = _mm256_add_ps(sum, e);
            }
            float tail = 0.0f;
            for (; t < n; t++) {
                si[t] = expf(si[t] - m);
                tail += si[t];
            }
            blk[2 * i] = m;
            blk[2 * i + 1] = hsum256(sum) + tail;
        }
    }
    /* o[i] = sum_j p[i][j] v_j, in blocks of DVB keys: per block and head, 16 dims x up to 4 query
     * heads per register tile, carried over in o */
    for (int64_t jb = 0; jb < n; jb += DVB) {
        const int64_t je = jb + DVB < n ? jb + DVB : n;
        if (jb % DTOUCH == 0)
            touch_rows(vc + h0 * D, slots + j0, jb, jb + DTOUCH < n ? jb + DTOUCH : n, slot_row, (h1 - h0) * D);
        for (int64_t h = h0; h < h1; h++) {
            float *blk = pp[h - h0], *o = blk + 2 * g;
            const float *scores = blk + g * (2 + D);
            if (wide) {
                pv_head512(g, D, n, jb, je, vc + h * D, slot_row, slots + j0, scores, o);
                continue;
            }
            for (int64_t i0 = 0; i0 < g; i0 += 4) {
                const int64_t gi = g - i0 < 4 ? g - i0 : 4;
                const float *vh = vc + h * D, *sp = scores + i0 * n;
                float *op = o + i0 * D;
                switch (gi) { /* a constant tile height, so the accumulators stay in registers */
                case 1: pv_tile(1, D, n, jb, je, vh, slot_row, slots + j0, sp, op); break;
                case 2: pv_tile(2, D, n, jb, je, vh, slot_row, slots + j0, sp, op); break;
                case 3: pv_tile(3, D, n, jb, je, vh, slot_row, slots + j0, sp, op); break;
                default: pv_tile(4, D, n, jb, je, vh, slot_row, slots + j0, sp, op); break;
                }
            }
        }
    }
}

/* Merge the nc chunk results of one (sequence, KV head) into out[g][D]; chunk c's block starts at
 * part + at[c]: its max and sum per head ([g][2]), then its unnormalised outputs ([g][D]). */
TGT static void decode_merge(int64_t nc, int64_t g, int64_t D, const float *part, const int64_t *at, float *out) {
    for (int64_t i = 0; i < g; i++) {
        float m = -INFINITY, l = 0.0f;
        for (int64_t c = 0; c < nc; c++)
            if (part[at[c] + 2 * i] > m) m = part[at[c] + 2 * i];
        for (int64_t c = 0; c < nc; c++) l += part[at[c] + 2 * i + 1] * expf(part[at[c] + 2 * i] - m);
        const float inv = 1.0f / l;
        for (int64_t d = 0; d < D; d += 8) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t c = 0; c < nc; c++) {
                const __m256 w = _mm256_set1_ps(expf(part[at[c] + 2 * i] - m) * inv);
                acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(part + at[c] + 2 * g + i * D + d), acc);
            }
            _mm256_storeu_ps(out + i * D + d, acc);
        }
    }
}

typedef struct {
    int64_t seq, h, a, b; /* prompt: query positions [a, b); decode: keys [a, b) */
    int64_t chunk;        /* decode: index of this key chunk among its (seq, h)'s; -1 for a prompt item */
    int64_t hn;           /* decode: KV heads h .. h + hn - 1 */
} work32_t;

/* decode work items per (sequence, key chunk): every KV head in one item (whole arena rows, read
 * ~1.4x faster than one head's part of each), or one head per item when whole chunks would leave
 * a thread idle or with under 3/4 of a chunk (a short batch-1 context: keys < 3/4 * nthreads *
 * DCHUNK with fewer than two chunks per thread) or the model has more than HKVMAX KV heads. How the
 * heads are grouped never changes a row's bits. */
static int64_t decode_head_group(int64_t chunks, int64_t keys, int64_t Hkv, int nthreads) {
    if (Hkv > HKVMAX) return 1;
    if (chunks >= 2 * (int64_t)nthreads) return Hkv;
    return chunks >= nthreads && 4 * keys >= 3 * (int64_t)nthreads * DCHUNK ? Hkv : 1;
}

/* Attention of a whole forward step, one call per layer, several sequences.
 * Returns 0 on success, 1 if the arguments are out of range, 2 if out of memory.
 *   q: [N, Hq, D] rows of all sequences in order, row stride q_row (floats);
 *   kc, vc: one layer of the KV arena, [slots, Hkv, D] contiguous (the new keys already written);
 *   slots: the contexts of all sequences concatenated, sequence b's at ctx_off[b] .. ctx_off[b+1];
 *   q_off: [B+1] row offsets (sequence b has T_b = q_off[b+1] - q_off[b] new tokens at the end of
 *     its context, positions P_b .. P_b + T_b - 1 with P_b = S_b - T_b);
 *   decode: [B] 1 where the sequence's one new token is a generated one;
 *   qpos: NULL (every row at its place in the last T_b positions), or [N] the position of every row
 *     in its context: strictly ascending within a sequence, in [0, S_b); a decode row's is S_b - 1;
 *   out: [N, Hq, D] contiguous. */
TGT int rc32_paged_attention(const float *q, int64_t q_row, const float *kc, const float *vc, const int64_t *slots,
                             const int64_t *ctx_off, const int64_t *q_off, const uint8_t *decode, const int64_t *qpos,
                             int64_t B, int64_t Hq, int64_t Hkv, int64_t D, float scale, float *out, int nthreads) {
    if (B < 1 || Hkv < 1 || Hq % Hkv != 0 || D % 16 != 0 || D > DMAX || nthreads < 1) return 1;
    const int64_t g = Hq / Hkv, slot_row = Hkv * D;
    const int wide = rc32_wide(-1);
    int64_t pack_floats = 0, nitems = 0, npack = 0, ndec = 0, dec_keys = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t T = q_off[b + 1] - q_off[b], S = ctx_off[b + 1] - ctx_off[b];
        if (T < 1 || S < T || (decode[b] && T != 1)) return 1;
        if (qpos) { /* explicit positions: checked here, never trusted inside the kernel */
            const int64_t *p = qpos + q_off[b];
            for (int64_t t = 0; t < T; t++)
                if (p[t] < 0 || p[t] >= S || (t > 0 && p[t] <= p[t - 1])) return 1;
            if (decode[b] && p[0] != S - 1) return 1;
        }
        if (decode[b]) {
            ndec++;
            dec_keys += S;
        } else {
            int64_t S_pad = (S + KB - 1) / KB * KB;
            pack_floats += 2 * Hkv * S_pad * D; /* keys, then values */
            npack += S_pad / KB;
            nitems += Hkv * ((T + QPOS - 1) / QPOS);
        }
    }
    /* decode chunks of DCHUNK keys: two threads share even one sequence, and how a row is split
     * depends on its own context length only (the same result in any batch) */
    int64_t *nchunks = calloc((size_t)B, sizeof(int64_t));
    int64_t *dec_at = calloc((size_t)B, sizeof(int64_t));
    if (!nchunks || !dec_at) {
        free(nchunks); free(dec_at);
        return 2;
    }
    int64_t dec_items = 0, part_floats = 0, dec_chunks = 0;
    for (int64_t b = 0; b < B; b++) {
        if (!decode[b]) continue;
        int64_t S = ctx_off[b + 1] - ctx_off[b];
        nchunks[b] = (S + DCHUNK - 1) / DCHUNK;
        dec_at[b] = dec_items;
        dec_items += Hkv * nchunks[b];
        dec_chunks += nchunks[b];
        part_floats += Hkv * nchunks[b] * g * (DCHUNK + 2 + D);
    }
    const int64_t hg = decode_head_group(dec_chunks, dec_keys, Hkv, nthreads);
    const int64_t ntiles = item_tiles(g); /* each thread's prompt-item scratch: tile states and accumulators */
    tile32_t *tstate = nitems ? malloc(sizeof(tile32_t) * (size_t)(nthreads * ntiles)) : NULL;
    float *taccs = nitems ? aligned_alloc(64, sizeof(float) * (size_t)(nthreads * ntiles * QT * DMAX)) : NULL;
    float *pack = pack_floats ? aligned_alloc(64, (size_t)pack_floats * sizeof(float)) : NULL;
    float *part = part_floats ? malloc((size_t)part_floats * sizeof(float)) : NULL;
    int64_t *pack_at = malloc(sizeof(int64_t) * (size_t)B);
    int64_t *part_at = malloc(sizeof(int64_t) * (size_t)(dec_items ? dec_items : 1));
    work32_t *items = malloc(sizeof(work32_t) * (size_t)(nitems + dec_items + 1));
    work32_t *packs = malloc(sizeof(work32_t) * (size_t)(npack ? npack : 1));
    const int64_t nmerge = ndec * Hkv; /* decode results: (sequence, KV head) pairs to merge */
    work32_t *merges = malloc(sizeof(work32_t) * (size_t)(nmerge ? nmerge : 1));
    if ((pack_floats && !pack) || (part_floats && !part) || !pack_at || !part_at || !items || !packs || !merges ||
        (nitems && (!tstate || !taccs))) {
        free(pack); free(part); free(pack_at); free(part_at); free(items); free(packs); free(nchunks); free(dec_at);
        free(merges); free(tstate); free(taccs);
        return 2;
    }
    int64_t at = 0, ni = 0, np = 0, pat = 0;
    for (int64_t b = 0; b < B; b++) { /* decode chunks first: each is short, the prompt items fill in after */
        if (!decode[b]) continue;
        int64_t S = ctx_off[b + 1] - ctx_off[b];
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t c = 0; c < nchunks[b]; c++) {
                part_at[dec_at[b] + h * nchunks[b] + c] = pat;
                pat += g * (DCHUNK + 2 + D);
            }
        for (int64_t c = 0; c < nchunks[b]; c++)
            for (int64_t h = 0; h < Hkv; h += hg)
                items[ni++] = (work32_t){b, h, c * DCHUNK, (c + 1) * DCHUNK < S ? (c + 1) * DCHUNK : S, c, hg};
    }
    for (int64_t b = 0; b < B; b++) {
        pack_at[b] = at;
        if (decode[b]) continue;
        int64_t T = q_off[b + 1] - q_off[b], S = ctx_off[b + 1] - ctx_off[b];
        int64_t S_pad = (S + KB - 1) / KB * KB, nqb = (T + QPOS - 1) / QPOS;
        at += 2 * Hkv * S_pad * D;
        for (int64_t c = 0; c < S_pad / KB; c++) packs[np++] = (work32_t){b, 0, c, 0, -1}; /* every KV head */
        for (int64_t qb = nqb - 1; qb >= 0; qb--) /* the latest query blocks (most keys) first */
            for (int64_t h = 0; h < Hkv; h++)
                items[ni++] = (work32_t){b, h, qb * QPOS, (qb + 1) * QPOS < T ? (qb + 1) * QPOS : T, -1};
    }
    int64_t nm = 0;
    for (int64_t b = 0; b < B; b++)
        if (decode[b])
            for (int64_t h = 0; h < Hkv; h++) merges[nm++] = (work32_t){b, h, 0, 0, 0};
    /* the fewest barriers: each costs a scheduler quantum when the machine is oversubscribed */
#pragma omp parallel num_threads(nthreads)
    {
        if (np > 0) {
#pragma omp for schedule(static)
        for (int64_t w = 0; w < np; w++) {
            work32_t it = packs[w];
            int64_t S = ctx_off[it.seq + 1] - ctx_off[it.seq], S_pad = (S + KB - 1) / KB * KB;
            const int64_t *sl = slots + ctx_off[it.seq];
            const int64_t end = (it.a + 1) * KB < S ? (it.a + 1) * KB : S;
            touch_rows(kc, sl, it.a * KB, end, slot_row, slot_row); /* whole arena rows come in, then are packed */
            for (int64_t h = 0; h < Hkv; h++) {
                float *kp = pack + pack_at[it.seq] + h * S_pad * D;
                pack_keys(kc, slot_row, sl, S, h, D, it.a * KB, (it.a + 1) * KB, wide ? 16 : 8, kp);
            }
            touch_rows(vc, sl, it.a * KB, end, slot_row, slot_row);
            for (int64_t h = 0; h < Hkv; h++) {
                float *kp = pack + pack_at[it.seq] + h * S_pad * D;
                pack_values(vc, slot_row, sl, S, h, D, it.a * KB, (it.a + 1) * KB, kp + Hkv * S_pad * D);
            }
        }
        }
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t w = 0; w < ni; w++) {
            work32_t it = items[w];
            int64_t S = ctx_off[it.seq + 1] - ctx_off[it.seq], T = q_off[it.seq + 1] - q_off[it.seq];
            const float *qs = q + q_off[it.seq] * q_row;
            if (it.chunk >= 0) { /* per head, a block: [g][2] max and sum, [g][D] outputs, then the scores' scratch */
                float *pp[HKVMAX];
                for (int64_t k = 0; k < it.hn; k++) pp[k] = part + part_at[dec_at[it.seq] + (it.h + k) * nchunks[it.seq] + it.chunk];
                decode_heads(qs, D, g, it.h, it.h + it.hn, it.a, it.b, kc, vc, slot_row, slots + ctx_off[it.seq], scale, pp,
                             wide);
            } else {
                int64_t S_pad = (S + KB - 1) / KB * KB, tid = omp_get_thread_num();
                const float *kp = pack + pack_at[it.seq] + it.h * S_pad * D;
                attend_item(qs, q_row, D, g, it.h, it.a, it.b, S - T, qpos ? qpos + q_off[it.seq] : NULL, kp, kp + Hkv * S_pad * D,
                            scale, out + q_off[it.seq] * Hq * D, Hq * D, wide, tstate + tid * ntiles,
                            taccs + tid * ntiles * QT * DMAX);
            }
        }
        if (nmerge > 0) {
#pragma omp barrier
#pragma omp for schedule(static) nowait
        for (int64_t w = 0; w < nmerge; w++) {
            work32_t it = merges[w];
            decode_merge(nchunks[it.seq], g, D, part, part_at + dec_at[it.seq] + it.h * nchunks[it.seq],
                         out + q_off[it.seq] * Hq * D + it.h * g * D);
        }
        }
    }
    free(pack); free(part); free(pack_at); free(part_at); free(items); free(packs); free(nchunks); free(dec_at); free(merges);
    free(tstate); free(taccs);
    return 0;
}

/* ---- attention statistics (Cache-Craft eq. 3-4) ---------------------------------------------- */

/* The softmax mass each query row gives each context segment, for a chunk cache's statistics:
 *   out[t, h, s] = sum over keys j in [seg_off[s], seg_off[s+1]), j <= qpos[t], of
 *                  softmax_j(scale * q[t, h] . K_h[j])   (keys 0 .. qpos[t]).
 *   q: [T, H, D] queries (RoPE applied), row stride q_row and head stride q_head in floats, each
 *      head's D values contiguous; query head h reads KV head h (pass one query head per group);
 *   kc: one layer of the arena, [slots, H, D] contiguous; slots: [S] the context's slots in
 *      position order; qpos: [T] each row's position, in [0, S);
 *   seg_off: [nseg + 1] segment boundaries, 0 = seg_off[0] < ... < seg_off[nseg] = S;
 *   out: [T, H, nseg] contiguous.
 * Scores are the prompt kernel's (packed keys, score_tile16); the softmax is
 * taken in two passes over each row's scores (max, then exp), so no rescaling is needed.
 * Returns 0 on success, 1 if the arguments are out of range, 2 if out of memory. */
TGT int rc32_segment_mass(const float *q, int64_t q_row, int64_t q_head, const float *kc, const int64_t *slots, int64_t S,
                          const int64_t *qpos, int64_t T, int64_t H, int64_t D, const int64_t *seg_off, int64_t nseg,
                          float scale, float *out, int nthreads) {
    if (T < 1 || S < 1 || H < 1 || D % 16 != 0 || D > DMAX || nseg < 1 || nthreads < 1) return 1;
    if (seg_off[0] != 0 || seg_off[nseg] != S) return 1;
    for (int64_t s = 0; s < nseg; s++)
        if (seg_off[s + 1] <= seg_off[s]) return 1;
    for (int64_t t = 0; t < T; t++)
        if (qpos[t] < 0 || qpos[t] >= S) return 1;
    const int64_t slot_row = H * D, S_pad = (S + KB - 1) / KB * KB, nblk = S_pad / KB, ntile = (T + QT - 1) / QT;
    float *pack = aligned_alloc(32, (size_t)(H * S_pad * D) * sizeof(float));
    float *scratch = aligned_alloc(32, (size_t)nthreads * QT * S_pad * sizeof(float));
    if (!pack || !scratch) {
        free(pack); free(scratch);
        return 2;
    }
    const __m256 vscale = _mm256_set1_ps(scale);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t w = 0; w < H * nblk; w++) {
            int64_t h = w / nblk, c = w % nblk;
            pack_keys(kc, slot_row, slots, S, h, D, c * KB, (c + 1) * KB, 8, pack + h * S_pad * D);
        }
        float *sc = scratch + (size_t)omp_get_thread_num() * QT * S_pad;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < H * ntile; w++) {
            const int64_t h = w / ntile, t0 = (w % ntile) * QT;
            const float *kp = pack + h * S_pad * D;
            const float *qv[QT];
            int64_t lim[QT], maxlim = 0;
            for (int i = 0; i < QT; i++) {
                int64_t t = t0 + i < T ? t0 + i : T - 1; /* pad a short tile with its last row */
                qv[i] = q + t * q_row + h * q_head;
                lim[i] = qpos[t];
                if (lim[i] > maxlim) maxlim = lim[i];
            }
            for (int64_t k16 = 0; k16 * 16 <= maxlim; k16++) /* scores, 16 keys at a time */
                score_tile16(kp + 2 * k16 * D * 8, D, qv, vscale, sc + 16 * k16, S_pad);
            for (int i = 0; i < QT && t0 + i < T; i++) {
                float *si = sc + i * S_pad;
                const int64_t valid = lim[i] + 1;
                __m256 bm = _mm256_set1_ps(-INFINITY);
                for (int64_t j = 0; j < valid; j += 8)
                    bm = _mm256_max_ps(bm, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_load_ps(si + j), lanes_below(j, valid)));
                const __m256 mv = _mm256_set1_ps(hmax256(bm));
                for (int64_t j = 0; j < valid; j += 8) /* exp(score - max), 0 past the row's limit */
                    _mm256_store_ps(si + j, _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_load_ps(si + j), mv)), lanes_below(j, valid)));
                float *dst = out + ((t0 + i) * H + h) * nseg, total = 0.0f;
                for (int64_t s = 0; s < nseg; s++) {
                    int64_t a = seg_off[s], b = seg_off[s + 1] < valid ? seg_off[s + 1] : valid;
                    float sum = 0.0f;
                    if (a < b) {
                        __m256 acc = _mm256_setzero_ps();
                        int64_t j = a;
                        for (; j + 8 <= b; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(si + j));
                        sum = hsum256(acc);
                        for (; j < b; j++) sum += si[j];
                    }
                    dst[s] = sum;
                    total += sum;
                }
                const float inv = 1.0f / total;
                for (int64_t s = 0; s < nseg; s++) dst[s] *= inv;
            }
        }
    }
    free(pack); free(scratch);
    return 0;
}

/* ---- fused row-wise steps -------------------------------------------------------------------- */

/* Row n of rc32_rope_write. */
TGT static void rope_write_row(float *x, int64_t Hq, int64_t Hkv, int64_t D, const float *c, const float *s, float *kd,
                               float *vd) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < Hq + Hkv; h++) {
        float *xh = x + h * D;
        for (int64_t d = 0; d < half; d += 8) {
            __m256 a = _mm256_loadu_ps(xh + d), b = _mm256_loadu_ps(xh + half + d);
            /* out[:half] = a cos - b sin; out[half:] = b cos + a sin (x cos + rotate_half(x) sin) */
            __m256 lo = _mm256_fmsub_ps(a, _mm256_loadu_ps(c + d), _mm256_mul_ps(b, _mm256_loadu_ps(s + d)));
            __m256 hi = _mm256_fmadd_ps(b, _mm256_loadu_ps(c + half + d), _mm256_mul_ps(a, _mm256_loadu_ps(s + half + d)));
            _mm256_storeu_ps(xh + d, lo);
            _mm256_storeu_ps(xh + half + d, hi);
        }
    }
    memcpy(kd, x + Hq * D, sizeof(float) * (size_t)(Hkv * D));
    memcpy(vd, x + (Hq + Hkv) * D, sizeof(float) * (size_t)(Hkv * D));
}

/* In place on qkv [N, Hq + 2 Hkv, D] (row stride (Hq + 2 Hkv) D): rotate the Hq query and Hkv key
 * heads of row n by cos/sin [N, D] (HF "rotate_half" layout), then write row n's keys and values
 * to kc/vc [slots, Hkv, D] at slot slots[n]. D % 16 == 0. */
TGT void rc32_rope_write(float *qkv, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, const float *cos, const float *sin,
                         float *kc, float *vc, const int64_t *slots, int nthreads) {
    const int64_t row = (Hq + 2 * Hkv) * D;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N > 16)
    for (int64_t n = 0; n < N; n++)
        rope_write_row(qkv + n * row, Hq, Hkv, D, cos + n * D, sin + n * D, kc + slots[n] * Hkv * D, vc + slots[n] * Hkv * D);
}

/* One row of rc32_add_rms_norm: x [H] += delta (if not NULL), out = weight * x * rsqrt(mean(x^2) + eps). */
TGT static void add_rms_norm_row(float *x, const float *delta, const float *weight, float eps, int64_t H, float *out) {
    __m256 ss = _mm256_setzero_ps();
    for (int64_t i = 0; i < H; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        if (delta) {
            v = _mm256_add_ps(v, _mm256_loadu_ps(delta + i));
            _mm256_storeu_ps(x + i, v);
        }
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum256(ss) / (float)H + eps));
    for (int64_t i = 0; i < H; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), r)));
}

/* h [N, H] += delta (if not NULL), then out = weight * h * rsqrt(mean(h^2) + eps). H % 8 == 0. */
TGT void rc32_add_rms_norm(float *h, const float *delta, const float *weight, float eps, int64_t N, int64_t H, float *out,
                           int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N > 16)
    for (int64_t n = 0; n < N; n++) add_rms_norm_row(h + n * H, delta ? delta + n * H : NULL, weight, eps, H, out + n * H);
}

/* One row of rc32_silu_mul: out [I] = silu(g) * u. */
TGT static void silu_mul_row(const float *gt, const float *u, int64_t I, float *out) {
    for (int64_t i = 0; i < I; i += 8) {
        __m256 x = _mm256_loadu_ps(gt + i);
        __m256 sig = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
    }
}

/* out [N, I] = silu(gate) * up, with gate_up [N, 2I] = [gate | up] per row. I % 8 == 0. */
TGT void rc32_silu_mul(const float *gate_up, int64_t N, int64_t I, float *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N > 16)
    for (int64_t n = 0; n < N; n++) silu_mul_row(gate_up + n * 2 * I, gate_up + n * 2 * I + I, I, out + n * I);
}

/* ---- linear layers for few rows ------------------------------------------------------------ */

#define SEQ_PF 1024 /* seq: how far ahead of its loads (floats: 4 KiB) a weight row stream is prefetched */

/* y[m0 .. m0+MR) rows of x W^T (+ b) for weight rows [n0, n0 + 4): each weight row is loaded once
 * for all MR input rows; one accumulator per (weight row, input row), summed across lanes at the end.
 * seq (a call of at most SEQ_ROWS_F32 rows, decode at batch 1-2: bound by reading W): the four weight
 * rows are read one after another, each start to end: one sequential stream for the hardware
 * prefetcher (on a 2-core Zen 4 a batch-1 decode step 0.58x the time, batch 2 0.63x). More rows keep
 * the four side by side (four FMA chains per input row: there the rows' 256-bit FMAs, not memory,
 * bound them; in sequence a 4-row layer was no faster, 8-16 rows 1.2-1.35x slower). There the
 * next four weight rows (one contiguous block) are prefetched meanwhile, start to end, their lines
 * shared out in order over all the tiles of input rows ([pf_from, pf_to) to this one), so the memory
 * streams while every tile computes (until 2026-11-29 the first tile asked for the whole block and
 * the others computed with the memory idle: on a 2-core Zen 3 SmolLM2's 120 layer GEMMs at 4 rows
 * now 0.86-0.93x the time, 8 rows 0.78-0.88x, 16 rows 0.79-0.90x (five runs, medians of 7-11
 * interleaved rounds, `benchmarks/linear_rows.py`, same bits);
 * two blocks ahead, or into L2 (T1), were 2-5% slower than one block into L1).
 * Each output's sum runs over k in the same order either way: same bits whatever M. The seq path
 * also asks for the line SEQ_PF floats (4 KiB) ahead of its loads, once per line (the hardware
 * prefetcher follows the one stream; where this still gains was not isolated, perhaps where a call
 * or a thread's share begins and the hardware has no history yet): on a
 * 2-core Zen 3, SmolLM2's 120 layer GEMMs at 1 row 0.95-0.97x the time, at 2 rows 0.98-1.01x (two
 * runs, medians of 9 interleaved rounds, `benchmarks/linear_rows.py`; prefetching 1-2 or 8 KiB ahead
 * gained as much or less; two FMA chains per row instead of one gained nothing: not kept). */
TGT static inline __attribute__((always_inline)) void linear_tile(const float *x, int64_t K, const float *W, const float *b,
                                                                    int64_t N, float *y, int64_t n0, int64_t nr, int64_t m0,
                                                                    const int MR, const int64_t pf_from, const int64_t pf_to,
                                                                    const int seq) {
    __m256 acc[4][3];
    const float *w[4];
    for (int r = 0; r < 4; r++) {
        w[r] = W + (n0 + (r < nr ? r : nr - 1)) * K;
        for (int j = 0; j < MR; j++) acc[r][j] = _mm256_setzero_ps();
    }
    /* lines [pf_from, pf_to) of the next 4 weight rows (one contiguous block of 4 K floats) stream in
     * while these are computed, pf_step a step */
    const float *ahead = W + (n0 + 4 < N ? n0 + 4 : n0) * K;
    int64_t pf = pf_from;
    const int64_t steps = K / 8 > 0 ? K / 8 : 1, pf_step = (pf_to - pf_from + steps - 1) / steps;
    if (seq) { /* few rows: each weight row streamed start to end, the tile's rows one after another */
        for (int r = 0; r < 4; r++)
            for (int64_t k = 0; k < K; k += 8) {
                if ((k & 8) == 0) _mm_prefetch((const char *)(w[r] + k + SEQ_PF), _MM_HINT_T0);
                const __m256 wv = _mm256_loadu_ps(w[r] + k);
                for (int j = 0; j < MR; j++) acc[r][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (m0 + j) * K + k), acc[r][j]);
            }
    } else
    for (int64_t k = 0; k < K; k += 8) {
        for (int64_t i = 0; i < pf_step && pf < pf_to; i++, pf++) _mm_prefetch((const char *)(ahead + 16 * pf), _MM_HINT_T0);
        __m256 xv[3];
        for (int j = 0; j < MR; j++) xv[j] = _mm256_loadu_ps(x + (m0 + j) * K + k);
        for (int r = 0; r < 4; r++) {
            __m256 wv = _mm256_loadu_ps(w[r] + k);
            for (int j = 0; j < MR; j++) acc[r][j] = _mm256_fmadd_ps(wv, xv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < MR; j++) y[(m0 + j) * N + n0 + r] = hsum256(acc[r][j]) + (b ? b[n0 + r] : 0.0f);
}

#define SEQ_ROWS_F32 2 /* most input rows for which a tile reads its weight rows one after another */

/* The work of rc32_linear_rows as an orphaned worksharing loop: inside a parallel region the
 * threads share the output columns (and meet at its end), outside one it runs on the caller. */
TGT static void linear_rows_for(const float *x, int64_t M, int64_t K, const float *W, const float *b, int64_t N, float *y) {
    const int seq = M <= SEQ_ROWS_F32;
    /* the next block's K / 4 lines of 16 floats, shared out in order over this block's tiles */
    const int64_t tiles = (M + 2) / 3, lines = K / 4, share = (lines + tiles - 1) / tiles;
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 4) {
        const int64_t nr = N - n0 < 4 ? N - n0 : 4;
        int64_t m0 = 0, t = 0;
        for (; m0 + 3 <= M; m0 += 3, t++)
            linear_tile(x, K, W, b, N, y, n0, nr, m0, 3, t * share, (t + 1) * share < lines ? (t + 1) * share : lines, seq);
        if (M - m0 == 2) linear_tile(x, K, W, b, N, y, n0, nr, m0, 2, t * share, lines, seq);
        else if (M - m0 == 1) linear_tile(x, K, W, b, N, y, n0, nr, m0, 1, t * share, lines, seq);
    }
}

/* y [M, N] = x [M, K] W [N, K]^T (+ b [N]) for few rows M (decode steps, short prompt chunks): the
 * weight streams from memory once per call whatever M is, in rows of 4 per step, threads taking
 * contiguous ranges of output columns. A row's result never depends on M or on the other rows.
 * K % 8 == 0. */
TGT void rc32_linear_rows(const float *x, int64_t M, int64_t K, const float *W, const float *b, int64_t N, float *y,
                          int nthreads) {
#pragma omp parallel num_threads(nthreads)
    linear_rows_for(x, M, K, W, b, N, y);
}

/* ---- a whole decode step ---------------------------------------------------------------------- */

/* One decoder layer's weights and arena part, as rc32_decode_step reads them. */
typedef struct {
    const float *qkv_w, *qkv_b;   /* [(Hq + 2 Hkv) D, H] and its bias or NULL */
    const float *o_w, *o_b;       /* [H, Hq D] */
    const float *gu_w;            /* [2 I, H]: gate rows, then up rows */
    const float *down_w, *down_b; /* [H, I] */
    const float *post_norm;       /* [H]: post-attention RMSNorm */
    const float *next_norm;       /* [H]: the next layer's input RMSNorm, or the final norm */
    float post_eps, next_eps;
} rc32_layer_t;

/* Every decoder layer of a step whose M rows are all generated tokens (M <= 16: the linear layers
 * stream their weights once for all rows), in one call and one parallel region: per layer the
 * QKV, RoPE + KV write, decode attention, O, add + norm, gate/up, SiLU x up, down, add + norm
 * phases run one after the other, the threads meeting between them. The arithmetic of every row
 * is that of the per-operation calls (rc32_linear_rows, rc32_rope_write, rc32_paged_attention's
 * decode path, rc32_add_rms_norm, rc32_silu_mul), so both give the same bits; this removes the
 * calls' dispatch, which a decode step of a small model is otherwise dominated by after its weights.
 *   h: [M, H] residual stream (in: the embeddings; updated in place);
 *   x: [M, H] in: layer 0's input-normed rows; out: the final-normed rows;
 *   cos, sin: [M, D]; k_base, v_base: the arena, layer l at + l * layer_stride ([slots, Hkv, D]);
 *   write: [M] slot of each row's new K/V; slots/ctx_off: each row's context (its new token last).
 * Returns 0, 1 on bad arguments, 2 when out of memory. */
TGT int rc32_decode_step(const rc32_layer_t *layers, int64_t L, float *h, float *x, int64_t M, int64_t H, int64_t Hq,
                         int64_t Hkv, int64_t D, int64_t I, const float *cos, const float *sin, float *k_base,
                         float *v_base, int64_t layer_stride, const int64_t *write, const int64_t *slots,
                         const int64_t *ctx_off, float scale, int nthreads) {
    if (M < 1 || M > 16 || L < 1 || Hkv < 1 || Hq % Hkv || D % 16 || D > DMAX || H % 8 || I % 8 || nthreads < 1) return 1;
    const int64_t g = Hq / Hkv, row = (Hq + 2 * Hkv) * D, slot_row = Hkv * D;
    const int wide = rc32_wide(-1);
    int64_t nitems = 0, nchunks = 0;
    for (int64_t b = 0; b < M; b++) {
        int64_t S = ctx_off[b + 1] - ctx_off[b];
        if (S < 1) return 1;
        nitems += Hkv * ((S + DCHUNK - 1) / DCHUNK);
        nchunks += (S + DCHUNK - 1) / DCHUNK;
    }
    const int64_t hg = decode_head_group(nchunks, ctx_off[M] - ctx_off[0], Hkv, nthreads);
    float *qkv = malloc(sizeof(float) * (size_t)(M * row));
    float *att = malloc(sizeof(float) * (size_t)(M * Hq * D));
    float *tmp = malloc(sizeof(float) * (size_t)(M * H));
    float *gu = malloc(sizeof(float) * (size_t)(M * 2 * I));
    float *act = malloc(sizeof(float) * (size_t)(M * I));
    float *part = malloc(sizeof(float) * (size_t)(nitems * g * (DCHUNK + 2 + D)));
    work32_t *items = malloc(sizeof(work32_t) * (size_t)nitems);
    int64_t *part_at = malloc(sizeof(int64_t) * (size_t)nitems);
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(M * Hkv + 1)); /* each (row, head)'s first item */
    int rc = 0;
    if (!qkv || !att || !tmp || !gu || !act || !part || !items || !part_at || !first) {
        rc = 2;
        goto done;
    }
    int64_t ni = 0, nw = 0; /* part blocks per (row, head, chunk); work items per (row, chunk, head group) */
    for (int64_t b = 0; b < M; b++) {
        int64_t S = ctx_off[b + 1] - ctx_off[b], nc = (S + DCHUNK - 1) / DCHUNK;
        for (int64_t hh = 0; hh < Hkv; hh++) {
            first[b * Hkv + hh] = ni;
            for (int64_t c = 0; c < nc; c++, ni++) part_at[ni] = ni * g * (DCHUNK + 2 + D);
        }
        for (int64_t c = 0; c < nc; c++)
            for (int64_t hh = 0; hh < Hkv; hh += hg)
                items[nw++] = (work32_t){b, hh, c * DCHUNK, (c + 1) * DCHUNK < S ? (c + 1) * DCHUNK : S, c, hg};
    }
    first[M * Hkv] = ni;
#pragma omp parallel num_threads(nthreads)
    for (int64_t l = 0; l < L; l++) {
        const rc32_layer_t *w = layers + l;
        float *kc = k_base + l * layer_stride, *vc = v_base + l * layer_stride;
        linear_rows_for(x, M, H, w->qkv_w, w->qkv_b, row, qkv);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < M; n++)
            rope_write_row(qkv + n * row, Hq, Hkv, D, cos + n * D, sin + n * D, kc + write[n] * slot_row, vc + write[n] * slot_row);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < nw; it++) {
            work32_t wk = items[it];
            float *pp[HKVMAX];
            for (int64_t k = 0; k < wk.hn; k++) pp[k] = part + part_at[first[wk.seq * Hkv + wk.h + k] + wk.chunk];
            decode_heads(qkv + wk.seq * row, D, g, wk.h, wk.h + wk.hn, wk.a, wk.b, kc, vc, slot_row, slots + ctx_off[wk.seq],
                         scale, pp, wide);
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M * Hkv; m++)
            decode_merge(first[m + 1] - first[m], g, D, part, part_at + first[m], att + (m / Hkv) * Hq * D + (m % Hkv) * g * D);
        linear_rows_for(att, M, Hq * D, w->o_w, w->o_b, H, tmp);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < M; n++) add_rms_norm_row(h + n * H, tmp + n * H, w->post_norm, w->post_eps, H, x + n * H);
        linear_rows_for(x, M, H, w->gu_w, NULL, 2 * I, gu);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < M; n++) silu_mul_row(gu + n * 2 * I, gu + n * 2 * I + I, I, act + n * I);
        linear_rows_for(act, M, I, w->down_w, w->down_b, H, tmp);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < M; n++) add_rms_norm_row(h + n * H, tmp + n * H, w->next_norm, w->next_eps, H, x + n * H);
    }
done:
    free(qkv); free(att); free(tmp); free(gu); free(act); free(part); free(items); free(part_at); free(first);
    return rc;
}
