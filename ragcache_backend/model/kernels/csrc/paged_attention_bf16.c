/* Attention over paged KV for bf16 on x86 CPUs with AVX512-BF16 (ragcache): one call per layer
 * for every sequence of a forward step (rc_paged_attention).
 *
 * Prompt tokens (attend_item) compute, for T new queries at absolute positions P .. P+T-1 (GQA: query head hq reads KV head
 * hq / g), causal attention over context slots[0 .. P+T-1] read straight from the KV arena (no
 * gather, no concatenation): out[t, hq] = softmax(scale * q[t, hq] . K[0..P+t]^T) V[0..P+t]; or, for
 * rows at explicit positions p_t inside the context (chunk-cache recomputation: ascending, < S;
 * qpos), over K[0..p_t], V[0..p_t].
 *
 * Arithmetic: QK^T and PV with VDPBF16PS (bf16 pairs, float32 accumulation), or on CPUs with AMX
 * with TDPBF16PS on tiles whose rows are keys, 16 queries across (attend_item_amx, rc_amx); online softmax in
 * float32 over key blocks of 64 starting at key 0; probabilities rounded to bf16 for PV as in
 * FlashAttention; output rounded once to bf16.
 *
 * Exactness: every query row is computed with the same operations in the same order whatever the
 * other rows of the call are, because (1) key blocks are fixed at absolute key positions, (2) a
 * block past a row's causal limit leaves that row bit-for-bit unchanged (rescale factor exactly 1,
 * probabilities exactly 0), (3) rows are only tiled side by side, never reduced together. So a
 * prompt's attention output is the same whether its prefix came from the cache (small T, large P)
 * or was computed in the same call (P = 0): the reason this kernel exists (bf16 cache exactness).
 * A row at an explicit position is computed exactly as the row at that position of an ordinary
 * prompt over the same keys (its limit is all that differs between the two).
 *
 * Generated tokens (rc_decode_chunk, rc_decode_merge) read the arena without packing and keep float32
 * probabilities, in chunks of DECODE_CHUNK keys fixed by position, each chunk every KV head, merged
 * afterwards (as FlashDecoding's split-KV): a batch-1 step has as many work items as chunks, not
 * KV heads (3 for SmolLM2, on 2 threads). They never serve a prompt token, so the prompt exactness
 * above is unaffected.
 *
 * Threads: OpenMP over (sequence, KV head, query block) and (generated token, key chunk), then the
 * chunks' merges; linked against the libgomp that torch has already loaded, so it shares torch's
 * thread pool.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16_common.h" /* bf16_t, DECODE_CHUNK, rc_decode_chunk's and rc_decode_merge's declarations */
#include "simd_exp.h"    /* exp512 */

#define KB 64      /* keys per block */
#define QT 4       /* query vectors per register tile */
#define QPOS 16    /* query positions per work item */
#define DECODE_PF 16 /* keys ahead whose whole arena rows a generated token's first head prefetches */

int rc_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

/* One query row's online-softmax step over a key block (attend_item): c holds its
 * 64 unscaled scores, the first valid (1 .. KB) inside its causal limit. Updates the row's largest
 * score *m and its sum *l, stores its probabilities rounded to bf16 (32 pairs of consecutive keys)
 * in pb, and returns the factor its earlier output sum is to be rescaled by (exactly 1 when the
 * largest score did not move). */
TGT_BF16 __attribute__((always_inline)) static inline float softmax_block(const __m512 c[4], int64_t valid, float scale,
                                                                        float *m, float *l, uint32_t *pb) {
    __m512 s[4];
    __m512 bm = _mm512_set1_ps(-INFINITY);
    __mmask16 mk[4];
    for (int j = 0; j < 4; j++) {
        int64_t left = valid - j * 16;
        mk[j] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
        s[j] = _mm512_mul_ps(c[j], _mm512_set1_ps(scale));
        bm = _mm512_mask_max_ps(bm, mk[j], bm, s[j]);
    }
    float bmax = _mm512_reduce_max_ps(bm);
    float mnew = bmax > *m ? bmax : *m;
    float alpha = mnew == *m ? 1.0f : expf(*m - mnew);
    __m512 mv = _mm512_set1_ps(mnew);
    __m512 sum = _mm512_setzero_ps();
    __m512 pr[4];
    for (int j = 0; j < 4; j++) {
        pr[j] = _mm512_maskz_mov_ps(mk[j], exp512(_mm512_sub_ps(s[j], mv)));
        sum = _mm512_add_ps(sum, pr[j]);
    }
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = mnew;
    _mm512_store_si512(pb, (__m512i)_mm512_cvtne2ps_pbh(pr[1], pr[0]));
    _mm512_store_si512(pb + 16, (__m512i)_mm512_cvtne2ps_pbh(pr[3], pr[2]));
    return alpha;
}

/* One work item: query rows [t0, t1) of KV head h, row t at position P + t, or qpos[t] (qpos: the
 * sequence's row positions, NULL: the last T). kp: packed keys of this head, [S_pad/16][D/2][16]
 * uint32 (bf16 pairs); vp: packed values, [S_pad/2][D] uint32 (bf16 pairs of consecutive keys). */
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl")))
static void attend_item(const bf16_t *q, int64_t q_row, int64_t D, int64_t g, int64_t h,
                        int64_t t0, int64_t t1, int64_t P, const int64_t *qpos, const uint32_t *kp,
                        const uint32_t *vp, float scale, bf16_t *out, int64_t out_row) {
    const int64_t nvec = (t1 - t0) * g;
    const int64_t DP = D / 2;
    float acc[QT][256] __attribute__((aligned(64)));
    uint32_t pb[QT][KB / 2] __attribute__((aligned(64)));
    for (int64_t v0 = 0; v0 < nvec; v0 += QT) {
        int64_t lim[QT], head[QT], tpos[QT];
        float m[QT], l[QT], alpha[QT];
        const uint32_t *qv[QT];
        int64_t maxlim = 0;
        for (int i = 0; i < QT; i++) {
            int64_t v = v0 + i < nvec ? v0 + i : nvec - 1; /* pad a short tile with its last row */
            tpos[i] = t0 + v / g;
            head[i] = h * g + v % g;
            lim[i] = qpos ? qpos[tpos[i]] : P + tpos[i];
            if (lim[i] > maxlim) maxlim = lim[i];
            qv[i] = (const uint32_t *)(q + tpos[i] * q_row + head[i] * D);
            m[i] = -INFINITY;
            l[i] = 0.0f;
            memset(acc[i], 0, sizeof(float) * D);
        }
        const int64_t nblocks = maxlim / KB + 1;
        for (int64_t kb = 0; kb < nblocks; kb++) {
            /* scores: 4 query vectors x 64 keys */
            __m512 c[QT][4];
            for (int i = 0; i < QT; i++)
                for (int j = 0; j < 4; j++) c[i][j] = _mm512_setzero_ps();
            const uint32_t *kblk = kp + kb * 4 * DP * 16;
            for (int64_t p = 0; p < DP; p++) {
                __m512bh kv[4];
                for (int j = 0; j < 4; j++) kv[j] = (__m512bh)_mm512_loadu_si512(kblk + (j * DP + p) * 16);
                for (int i = 0; i < QT; i++) {
                    __m512bh bq = (__m512bh)_mm512_set1_epi32((int)qv[i][p]);
                    for (int j = 0; j < 4; j++) c[i][j] = _mm512_dpbf16_ps(c[i][j], kv[j], bq);
                }
            }
            int64_t maxvalid = 0;
            for (int i = 0; i < QT; i++) {
                int64_t valid = lim[i] - kb * KB + 1;
                if (valid > KB) valid = KB;
                if (valid <= 0) { /* past this row's causal limit: leave it untouched */
                    alpha[i] = 1.0f;
                    memset(pb[i], 0, sizeof(pb[i]));
                    continue;
                }
                if (valid > maxvalid) maxvalid = valid;
                alpha[i] = softmax_block(c[i], valid, scale, &m[i], &l[i], pb[i]);
            }
            if (maxvalid == 0) continue;
            /* PV: acc[i] = acc[i] * alpha[i] + p[i] . V[block], 64 dims at a time */
            const int64_t npairs = (maxvalid + 1) / 2;
            const uint32_t *vblk = vp + kb * (KB / 2) * D;
            for (int64_t dg = 0; dg < D; dg += 64) {
                __m512 o[QT][4];
                for (int i = 0; i < QT; i++) {
                    __m512 a = _mm512_set1_ps(alpha[i]);
                    for (int j = 0; j < 4; j++) o[i][j] = _mm512_mul_ps(_mm512_load_ps(acc[i] + dg + 16 * j), a);
                }
                for (int64_t jp = 0; jp < npairs; jp++) {
                    __m512bh vv[4];
                    for (int j = 0; j < 4; j++) vv[j] = (__m512bh)_mm512_loadu_si512(vblk + jp * D + dg + 16 * j);
                    for (int i = 0; i < QT; i++) {
                        __m512bh bp = (__m512bh)_mm512_set1_epi32((int)pb[i][jp]);
                        for (int j = 0; j < 4; j++) o[i][j] = _mm512_dpbf16_ps(o[i][j], vv[j], bp);
                    }
                }
                for (int i = 0; i < QT; i++)
                    for (int j = 0; j < 4; j++) _mm512_store_ps(acc[i] + dg + 16 * j, o[i][j]);
            }
        }
        for (int i = 0; i < QT && v0 + i < nvec; i++) {
            __m512 inv = _mm512_set1_ps(1.0f / l[i]);
            bf16_t *dst = out + tpos[i] * out_row + head[i] * D;
            for (int64_t d = 0; d < D; d += 32) {
                __m512bh r = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_load_ps(acc[i] + d + 16), inv),
                                                 _mm512_mul_ps(_mm512_load_ps(acc[i] + d), inv));
                _mm512_storeu_si512(dst + d, (__m512i)r);
            }
        }
    }
}

/* AMX (Intel Sapphire Rapids and later): attend_item's work item on tiles. rc_amx says whether the
 * CPU has AMX-TILE and AMX-BF16 and Linux granted this process the tile state (arch_prctl
 * ARCH_REQ_XCOMP_PERM; oneDNN asks for the same); request 0 or 1 sets it for the process (1 only
 * where it can run), -1 only asks. Every prompt row of every call takes the same kernel, so the
 * exactness above holds on either; the two kernels' rows differ in rounding (another summation
 * order of the same bf16 products). linear_amx.c's GEMM runs only where this says 1 as well. */
static int amx_on = -1;
int rc_amx(int request) {
    if (request < 0 && amx_on >= 0) return amx_on; /* every call asks: no probe then */
    int can = 0;
#ifdef RC_HAVE_AMX
    unsigned a, b, c, d;
    if (rc_supported() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 22 & 1)) /* AMX-TILE, AMX-BF16 */
        can = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#endif
    amx_on = request >= 0 ? (request && can) : can;
    return amx_on;
}

#ifdef RC_HAVE_AMX
/* 2^t on 16 lanes for t <= 0 (finite), the AMX item's softmax exponentials: t = n + f with n the
 * nearest integer, 2^f by its Taylor polynomial of degree 5 (relative error < 3e-6 on |f| <= 1/2;
 * a probability is rounded to bf16, 2^-9, before P V), times 2^n by VSCALEFPS (0 below the float
 * range). 9 instructions with the argument's FMA, against exp512's 17 + 1: the exponentials are
 * most of a prompt's attention. */
TGT_AMX __attribute__((always_inline)) static inline __m512 exp2_neg(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.3333558146e-3f), f, _mm512_set1_ps(9.6181291076e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* attend_item on AMX tiles, transposed: one query head of the group at a time, its QPOS (16) query
 * positions the 16 lanes of every vector (a missing row's lane zero and never written out), keys
 * the rows of the tiles. Per key block of KB (64): S^T = K Q^T in four 16 x 16 tiles (A: 16 keys'
 * head-size values, 32 at a time, in d order; B: the queries' bf16 pairs), so that a key's scores
 * for the 16 queries are one vector; the online softmax then runs on vectors only (the block's
 * largest score per lane: maxima over the keys, no horizontal reduction; masked past each lane's
 * causal limit; probabilities 2^(log2(e) scale (s - m)) in float32 (exp2_neg), their sum per lane, rounded to bf16
 * and interleaved in pairs of consecutive keys: the B operand of O^T = V^T P^T, computed from zero
 * in D / 16 tiles (A: 16 dims' value pairs) and added to the lane's rescaled sum (one FMA). A lane
 * past its causal limit in a block is left untouched (masked updates), so a row's result depends on
 * its own query, position and keys only: TDPBF16PS computes each output element from its own row of
 * A and column of B, and the rest is per lane. Tiles (amx_configure): the scores in t0-t3 (then the
 * outputs), B in t4 (queries; then probabilities of keys 0-31) and t5 (keys 32-63), A in t6-t7.
 * Against the row-major item it replaced (scores as 16 query rows, a row's softmax with horizontal
 * reductions and scalar bookkeeping): see docs/benchmarks.md (2026-11-28, the transposed AMX item). */
TGT_AMX static void attend_item_amx(const bf16_t *q, int64_t q_row, int64_t D, int64_t g, int64_t h,
                                    int64_t t0, int64_t t1, int64_t P, const int64_t *qpos, const uint32_t *kp,
                                    const uint32_t *vp, float scale, bf16_t *out, int64_t out_row) {
    const int64_t n = t1 - t0, DP = D / 2;
    int32_t limv[QPOS] __attribute__((aligned(64)));
    for (int64_t r = 0; r < QPOS; r++) limv[r] = r < n ? (int32_t)(qpos ? qpos[t0 + r] : P + t0 + r) : -1;
    const int64_t first = limv[0], nblocks = limv[n - 1] / KB + 1; /* positions ascend */
    const __m512i lim = _mm512_load_si512(limv);
    const __m512i pair_lanes = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                                5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512 vscale = _mm512_set1_ps(scale), vscale2 = _mm512_set1_ps(scale * 1.44269504088896341f); /* the exponent base 2 */
    const bf16_t *kt = (const bf16_t *)kp;
    uint32_t qt[128 * QPOS] __attribute__((aligned(64))); /* [D/2][16]: the queries' bf16 pairs */
    float sc[KB * QPOS] __attribute__((aligned(64)));     /* [KB][16] scores, then [64][16] a P V part */
    uint32_t pb[KB / 2 * QPOS] __attribute__((aligned(64)));
    float acc[256 * QPOS] __attribute__((aligned(64)));   /* [D][16] */
    amx_configure();
    for (int64_t i = 0; i < g; i++) {
        const int64_t hq = h * g + i;
        for (int64_t r = 0; r < QPOS; r++) {
            const uint32_t *qr = (const uint32_t *)(q + (t0 + r) * q_row + hq * D);
            for (int64_t p = 0; p < DP; p++) qt[p * QPOS + r] = r < n ? qr[p] : 0;
        }
        memset(acc, 0, sizeof(float) * (size_t)(D * QPOS));
        __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
        for (int64_t kb = 0; kb < nblocks; kb++) {
            const int64_t k0 = kb * KB;
            const __mmask16 live = _mm512_cmpge_epi32_mask(lim, _mm512_set1_epi32((int)k0)); /* lanes with a key here */
            /* S^T: keys k0 + 16 j .. + 15 in tile j */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t c = 0; c < D / 32; c++) {
                const bf16_t *ka = kt + k0 * D + 32 * c;
                const int64_t ks = D * (int64_t)sizeof(bf16_t);
                _tile_loadd(4, qt + 16 * c * QPOS, 64);
                _tile_loadd(6, ka, ks);
                _tile_dpbf16ps(0, 6, 4);
                _tile_loadd(7, ka + 16 * D, ks);
                _tile_dpbf16ps(1, 7, 4);
                _tile_loadd(6, ka + 32 * D, ks);
                _tile_dpbf16ps(2, 6, 4);
                _tile_loadd(7, ka + 48 * D, ks);
                _tile_dpbf16ps(3, 7, 4);
            }
            _tile_stored(0, sc, 64);
            _tile_stored(1, sc + 16 * QPOS, 64);
            _tile_stored(2, sc + 32 * QPOS, 64);
            _tile_stored(3, sc + 48 * QPOS, 64);
            /* keys past some lane's limit: only in blocks reaching past the item's first row */
            const int masked = k0 + KB - 1 > first;
            __mmask16 valid[KB];
            for (int j = 0; j < KB; j++)
                valid[j] = masked ? _mm512_cmpge_epi32_mask(lim, _mm512_set1_epi32((int)(k0 + j))) & live : live;
            __m512 b0 = _mm512_set1_ps(-INFINITY), b1 = b0, b2 = b0, b3 = b0; /* four chains, keys j % 4 */
            for (int j = 0; j < KB; j += 4) {
                b0 = _mm512_mask_max_ps(b0, valid[j], b0, _mm512_load_ps(sc + j * QPOS));
                b1 = _mm512_mask_max_ps(b1, valid[j + 1], b1, _mm512_load_ps(sc + (j + 1) * QPOS));
                b2 = _mm512_mask_max_ps(b2, valid[j + 2], b2, _mm512_load_ps(sc + (j + 2) * QPOS));
                b3 = _mm512_mask_max_ps(b3, valid[j + 3], b3, _mm512_load_ps(sc + (j + 3) * QPOS));
            }
            const __m512 mx = _mm512_max_ps(_mm512_max_ps(b0, b1), _mm512_max_ps(b2, b3));
            const __mmask16 grow = _mm512_mask_cmp_ps_mask(live, mx, m, _CMP_GT_OQ);
            const __m512 mnew = _mm512_mask_mov_ps(m, grow, mx);
            /* exactly 1 where the largest score did not move; m = -inf (a lane's first keys): its sums are 0 */
            const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), grow,
                                                    exp512(_mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(m, mnew), vscale), _mm512_set1_ps(-87.0f))));
            m = mnew;
            const __m512 negm = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(m, vscale2));
            __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0; /* four chains, keys j % 4 */
            for (int j = 0; j < KB; j += 4) { /* keys j .. j + 3: two rows of B (16 lanes' pairs each) */
                const __m512 p0 = _mm512_maskz_mov_ps(valid[j], exp2_neg(_mm512_fmadd_ps(_mm512_load_ps(sc + j * QPOS), vscale2, negm)));
                const __m512 p1 = _mm512_maskz_mov_ps(valid[j + 1], exp2_neg(_mm512_fmadd_ps(_mm512_load_ps(sc + (j + 1) * QPOS), vscale2, negm)));
                const __m512 p2 = _mm512_maskz_mov_ps(valid[j + 2], exp2_neg(_mm512_fmadd_ps(_mm512_load_ps(sc + (j + 2) * QPOS), vscale2, negm)));
                const __m512 p3 = _mm512_maskz_mov_ps(valid[j + 3], exp2_neg(_mm512_fmadd_ps(_mm512_load_ps(sc + (j + 3) * QPOS), vscale2, negm)));
                s0 = _mm512_add_ps(s0, p0);
                s1 = _mm512_add_ps(s1, p1);
                s2 = _mm512_add_ps(s2, p2);
                s3 = _mm512_add_ps(s3, p3);
                _mm512_store_si512(pb + j / 2 * QPOS, _mm512_permutexvar_epi16(pair_lanes, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
                _mm512_store_si512(pb + (j / 2 + 1) * QPOS, _mm512_permutexvar_epi16(pair_lanes, (__m512i)_mm512_cvtne2ps_pbh(p3, p2)));
            }
            l = _mm512_mask_fmadd_ps(l, live, alpha, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
            /* O^T for the block: dims 16 e .. + 15 in tile e (of four), B the probabilities of keys 0-31 (t4), 32-63 (t5) */
            const uint32_t *vblk = vp + kb * D * (KB / 2);
            _tile_loadd(4, pb, 64);
            _tile_loadd(5, pb + 16 * QPOS, 64);
            for (int64_t dg = 0; dg < D; dg += 64) {
                const int64_t vs = KB / 2 * (int64_t)sizeof(uint32_t);
                const uint32_t *va = vblk + dg * (KB / 2);
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                _tile_loadd(6, va, vs);
                _tile_dpbf16ps(0, 6, 4);
                _tile_loadd(7, va + 16, vs);
                _tile_dpbf16ps(0, 7, 5);
                _tile_loadd(6, va + 16 * (KB / 2), vs);
                _tile_dpbf16ps(1, 6, 4);
                _tile_loadd(7, va + 16 * (KB / 2) + 16, vs);
                _tile_dpbf16ps(1, 7, 5);
                _tile_loadd(6, va + 32 * (KB / 2), vs);
                _tile_dpbf16ps(2, 6, 4);
                _tile_loadd(7, va + 32 * (KB / 2) + 16, vs);
                _tile_dpbf16ps(2, 7, 5);
                _tile_loadd(6, va + 48 * (KB / 2), vs);
                _tile_dpbf16ps(3, 6, 4);
                _tile_loadd(7, va + 48 * (KB / 2) + 16, vs);
                _tile_dpbf16ps(3, 7, 5);
                _tile_stored(0, sc, 64);
                _tile_stored(1, sc + 16 * QPOS, 64);
                _tile_stored(2, sc + 32 * QPOS, 64);
                _tile_stored(3, sc + 48 * QPOS, 64);
                for (int64_t d = 0; d < 64; d++) {
                    float *ad = acc + (dg + d) * QPOS;
                    _mm512_store_ps(ad, _mm512_mask_fmadd_ps(_mm512_load_ps(ad), live, alpha, _mm512_load_ps(sc + d * QPOS)));
                }
            }
        }
        /* out[r] = acc[., r] / l[r], one bf16 rounding */
        float inv[QPOS] __attribute__((aligned(64)));
        _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
        for (int64_t r = 0; r < n; r++) {
            bf16_t *dst = out + (t0 + r) * out_row + hq * D;
            const __m512 iv = _mm512_set1_ps(inv[r]);
            const __m512i col = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                                    _mm512_set1_epi32(QPOS)), _mm512_set1_epi32((int)r));
            for (int64_t d = 0; d < D; d += 32) {
                const __m512 lo = _mm512_i32gather_ps(col, acc + d * QPOS, 4), hi = _mm512_i32gather_ps(col, acc + (d + 16) * QPOS, 4);
                _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, iv), _mm512_mul_ps(lo, iv)));
            }
        }
    }
    _tile_release();
}

/* pack_keys for attend_item_amx: keys [start, end) of KV head h as kt [S_pad][D] bf16 (a key's
 * values contiguous: 16 keys' 32 values are an A tile of S^T) in kp, and per key block of KB, vt
 * [D][KB / 2] bf16 pairs of consecutive keys (16 dims' pairs an A tile of O^T) in vp; keys >= S zero. */
static void pack_keys_amx(const bf16_t *kc, const bf16_t *vc, int64_t slot_row, const int64_t *slots, int64_t S,
                          int64_t h, int64_t D, int64_t start, int64_t end, uint32_t *kp, uint32_t *vp) {
    bf16_t *kt = (bf16_t *)kp;
    for (int64_t j = start; j < end; j++) {
        bf16_t *vd = (bf16_t *)(vp + (j / KB) * D * (KB / 2)) + j % KB; /* dim d at vd[d * KB] */
        if (j < S) {
            memcpy(kt + j * D, kc + slots[j] * slot_row + h * D, sizeof(bf16_t) * (size_t)D);
            const bf16_t *vrow = vc + slots[j] * slot_row + h * D;
            for (int64_t d = 0; d < D; d++) vd[d * KB] = vrow[d];
        } else {
            memset(kt + j * D, 0, sizeof(bf16_t) * (size_t)D);
            for (int64_t d = 0; d < D; d++) vd[d * KB] = 0;
        }
    }
}
#else
#define attend_item_amx attend_item /* a compiler without AMX intrinsics: never chosen (rc_amx is 0) */
#define pack_keys_amx pack_keys
#endif

/* Pack keys [start, end) of KV head h into kp / vp (see attend_item); keys >= S are zero. */
static void pack_keys(const bf16_t *kc, const bf16_t *vc, int64_t slot_row, const int64_t *slots, int64_t S,
                      int64_t h, int64_t D, int64_t start, int64_t end, uint32_t *kp, uint32_t *vp) {
    const int64_t DP = D / 2;
    for (int64_t j = start; j < end; j++) {
        uint32_t *kdst = kp + (j / 16) * DP * 16 + (j % 16);
        bf16_t *vdst = (bf16_t *)(vp + (j / 2) * D) + (j % 2);
        if (j < S) {
            const uint32_t *krow = (const uint32_t *)(kc + slots[j] * slot_row + h * D);
            const bf16_t *vrow = vc + slots[j] * slot_row + h * D;
            for (int64_t p = 0; p < DP; p++) kdst[p * 16] = krow[p];
            for (int64_t d = 0; d < D; d++) vdst[2 * d] = vrow[d];
        } else {
            for (int64_t p = 0; p < DP; p++) kdst[p * 16] = 0;
            for (int64_t d = 0; d < D; d++) vdst[2 * d] = 0;
        }
    }
}

/* scale * q . k of query heads h g + i0 .. h g + i0 + NI - 1 (NI a constant after inlining) for the S
 * context keys of KV head h, into scores [g][S]: four keys at a time, each key's D values read once
 * for the NI heads, the four keys' sums reduced together (sum4); the last S % 4 keys one by one.
 * KV head 0's pass prefetches whole arena rows (every head's keys) DECODE_PF keys ahead: the other
 * heads' passes over the chunk then read the cache (with a head's part alone fetched, ~10% slower). */
TGT_BF16 __attribute__((always_inline)) static inline void decode_scores(const bf16_t *q, int64_t D, int64_t g, int64_t h,
                                                                         int64_t i0, int64_t S, const bf16_t *kc,
                                                                         int64_t slot_row, const int64_t *slots, float scale,
                                                                         float *scores, const int NI) {
    const int64_t nq = D / 32;
    __m512bh qv[4][8];
    for (int i = 0; i < NI; i++)
        for (int64_t c = 0; c < nq; c++) qv[i][c] = (__m512bh)_mm512_loadu_si512(q + (h * g + i0 + i) * D + 32 * c);
    const __m128 sc = _mm_set1_ps(scale);
    int64_t j = 0;
    for (; j + 4 <= S; j += 4) {
        const bf16_t *kr[4];
        for (int t = 0; t < 4; t++) kr[t] = kc + slots[j + t] * slot_row + h * D;
        if (h == 0 && i0 == 0 && j + DECODE_PF + 4 <= S) /* the first head's pass fetches whole rows (every head) ahead */
            for (int t = 0; t < 4; t++) {
                const char *row = (const char *)(kc + slots[j + DECODE_PF + t] * slot_row);
                for (int64_t off = 0; off < slot_row * 2; off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
            }
        __m512 acc[4][4];
        for (int i = 0; i < NI; i++)
            for (int t = 0; t < 4; t++) acc[i][t] = _mm512_setzero_ps();
        for (int64_t c = 0; c < nq; c++) {
            __m512bh kv[4];
            for (int t = 0; t < 4; t++) kv[t] = (__m512bh)_mm512_loadu_si512(kr[t] + 32 * c);
            for (int i = 0; i < NI; i++)
                for (int t = 0; t < 4; t++) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], kv[t], qv[i][c]);
        }
        for (int i = 0; i < NI; i++)
            _mm_storeu_ps(scores + (i0 + i) * S + j, _mm_mul_ps(sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), sc));
    }
    for (; j < S; j++) {
        const bf16_t *kr = kc + slots[j] * slot_row + h * D;
        for (int i = 0; i < NI; i++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; c < nq; c++) acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(kr + 32 * c), qv[i][c]);
            scores[(i0 + i) * S + j] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
}

/* po[i] = sum_j p[i][j] v[j] (i < G, a constant after inlining) for the G query heads of KV head h
 * over S keys: weights p [G][S] in float32, each value row read once for the G heads, 64 dims at
 * a time, float32 FMAs; po [G][D + 2] float32 (the first D of each row). KV head 0's pass prefetches
 * whole value rows ahead, as decode_scores does keys. */
TGT_BF16 __attribute__((always_inline)) static inline void decode_pv(const float *scores, int64_t D, int64_t h, int64_t S,
                                                                     const bf16_t *vc, int64_t slot_row, const int64_t *slots,
                                                                     float *po, const int G) {
    for (int64_t dg = 0; dg < D; dg += 64) {
        __m512 o[8][4];
        for (int i = 0; i < G; i++)
            for (int c = 0; c < 4; c++) o[i][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < S; j++) {
            const bf16_t *vr = vc + slots[j] * slot_row + h * D + dg;
            if (h == 0 && dg == 0 && j + DECODE_PF < S) {
                const char *row = (const char *)(vc + slots[j + DECODE_PF] * slot_row);
                for (int64_t off = 0; off < slot_row * 2; off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
            }
            __m512 vv[4];
            for (int c = 0; c < 4; c++) vv[c] = load_bf16(vr + 16 * c);
            for (int i = 0; i < G; i++) {
                __m512 p = _mm512_set1_ps(scores[i * S + j]);
                for (int c = 0; c < 4; c++) o[i][c] = _mm512_fmadd_ps(p, vv[c], o[i][c]);
            }
        }
        for (int i = 0; i < G; i++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(po + i * (D + 2) + dg + 16 * c, o[i][c]);
    }
}

/* One generated token's keys c0 .. c0 + S - 1 (one chunk of at most DECODE_CHUNK keys of its
 * context, in position order), every KV head: per query head hq, into part [Hq][D + 2], the chunk's
 * unnormalized output sum_j e_j v_j (D floats), its largest score m and sum_j e_j, with e_j =
 * exp(s_j - m) and s_j = scale * q . k_j (VDPBF16PS dot products, float32). A chunk covers every
 * KV head, one after the other; KV head 0's pass prefetches the chunk's whole arena rows, which the
 * other heads' passes then find in the cache (against one work item per KV head over the whole
 * context: attention 0.76-0.92x the time, on a 2-core Zen 4, docs/benchmarks.md).
 * rc_decode_merge combines the chunks. */
TGT_BF16 HIDDEN void rc_decode_chunk(const bf16_t *q, int64_t D, int64_t g, int64_t Hkv, int64_t S, const bf16_t *kc,
                                     const bf16_t *vc, int64_t slot_row, const int64_t *slots, float scale, float *part) {
    float scores[8 * DECODE_CHUNK];
    for (int64_t h = 0; h < Hkv; h++) {
        for (int64_t i0 = 0; i0 < g; i0 += 4) { /* heads i0 .. i0 + 3: each key read once for them */
            switch (g - i0 < 4 ? g - i0 : 4) {
            case 1: decode_scores(q, D, g, h, i0, S, kc, slot_row, slots, scale, scores, 1); break;
            case 2: decode_scores(q, D, g, h, i0, S, kc, slot_row, slots, scale, scores, 2); break;
            case 3: decode_scores(q, D, g, h, i0, S, kc, slot_row, slots, scale, scores, 3); break;
            default: decode_scores(q, D, g, h, i0, S, kc, slot_row, slots, scale, scores, 4); break;
            }
        }
        float *ph = part + h * g * (D + 2);
        for (int64_t i = 0; i < g; i++) {
            float *si = scores + i * S;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            int64_t j = 0;
            for (; j + 16 <= S; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(si + j));
            if (j < S) {
                const __mmask16 tail = (__mmask16)((1u << (S - j)) - 1u);
                mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, si + j));
            }
            const float m = _mm512_reduce_max_ps(mx);
            __m512 mv = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
            for (j = 0; j + 16 <= S; j += 16) {
                __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(si + j), mv));
                _mm512_storeu_ps(si + j, e);
                sum = _mm512_add_ps(sum, e);
            }
            if (j < S) {
                __mmask16 mk = (__mmask16)((1u << (S - j)) - 1u);
                __m512 e = _mm512_maskz_mov_ps(mk, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, si + j), mv)));
                _mm512_mask_storeu_ps(si + j, mk, e);
                sum = _mm512_add_ps(sum, e);
            }
            ph[i * (D + 2) + D] = m;
            ph[i * (D + 2) + D + 1] = _mm512_reduce_add_ps(sum);
        }
        switch (g) { /* the heads' count a constant: their accumulators stay in registers */
        case 1: decode_pv(scores, D, h, S, vc, slot_row, slots, ph, 1); break;
        case 2: decode_pv(scores, D, h, S, vc, slot_row, slots, ph, 2); break;
        case 3: decode_pv(scores, D, h, S, vc, slot_row, slots, ph, 3); break;
        case 4: decode_pv(scores, D, h, S, vc, slot_row, slots, ph, 4); break;
        case 5: decode_pv(scores, D, h, S, vc, slot_row, slots, ph, 5); break;
        case 6: decode_pv(scores, D, h, S, vc, slot_row, slots, ph, 6); break;
        case 7: decode_pv(scores, D, h, S, vc, slot_row, slots, ph, 7); break;
        default: decode_pv(scores, D, h, S, vc, slot_row, slots, ph, 8); break;
        }
    }
}

/* Query head hq of one generated token from its nc chunks' parts (rc_decode_chunk, [nc][Hq][D + 2]):
 * out [D] = sum_c w_c o_c / sum_c w_c l_c with w_c = exp(m_c - max_c m_c), chunks in order, float32,
 * one bf16 rounding. The chunks are fixed by position (DECODE_CHUNK keys from key 0), so a token's
 * bits depend on its context only: never on the other rows of the step or the thread count. */
TGT_BF16 HIDDEN void rc_decode_merge(const float *parts, int64_t nc, int64_t Hq, int64_t D, int64_t hq, bf16_t *out) {
    float mx = -INFINITY;
    for (int64_t c = 0; c < nc; c++) mx = fmaxf(mx, parts[(c * Hq + hq) * (D + 2) + D]);
    float l = 0.0f;
    __m512 o[16];
    for (int64_t d = 0; d < D; d += 16) o[d / 16] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nc; c++) {
        const float *pc = parts + (c * Hq + hq) * (D + 2);
        const float w = _mm512_cvtss_f32(exp512(_mm512_set1_ps(pc[D] - mx)));
        l += w * pc[D + 1];
        const __m512 wv = _mm512_set1_ps(w);
        for (int64_t d = 0; d < D; d += 16) o[d / 16] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(pc + d), o[d / 16]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / l);
    for (int64_t d = 0; d < D; d += 32)
        _mm512_storeu_si512(out + d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(o[d / 16 + 1], inv), _mm512_mul_ps(o[d / 16], inv)));
}

typedef struct {
    int64_t seq, h, t0, t1; /* a prompt item: KV head h, query positions [t0, t1) (a pack: key block t0);
                             * t1 < 0: a generated token's key chunk from key t0, its parts at offset h;
                             * a merge: query head h, its token's parts from offset t0, t1 chunks */
} work_t;

/* Attention of a whole forward step, one call per layer, several sequences.
 * Returns 0 on success, 1 if the arguments are out of range, 2 if out of memory.
 *   q: [N, Hq, D] rows of all sequences in order, row stride q_row (elements);
 *   kc, vc: one layer of the KV arena, [slots, Hkv, D] contiguous (the new keys already written);
 *   slots: the contexts of all sequences concatenated, sequence b's at ctx_off[b] .. ctx_off[b+1];
 *   q_off: [B+1] row offsets (sequence b has T_b = q_off[b+1] - q_off[b] new tokens at the end of
 *     its context, positions P_b .. P_b + T_b - 1 with P_b = S_b - T_b);
 *   decode: [B] 1 where the sequence's one new token is a generated one;
 *   qpos: NULL (every row at its place in the last T_b positions), or [N] the position of every row
 *     in its context: strictly ascending within a sequence, in [0, S_b); a decode row's is S_b - 1;
 *   out: [N, Hq, D] contiguous. */
/* Present in every library whose rc_paged_attention takes qpos (library.py sets the ctypes signature
 * by it: an older revision's library, built by benchmarks/kernel_ab.py, has neither). */
int rc_takes_positions(void) { return 1; }

int rc_paged_attention(const bf16_t *q, int64_t q_row, const bf16_t *kc, const bf16_t *vc, const int64_t *slots,
                       const int64_t *ctx_off, const int64_t *q_off, const uint8_t *decode, const int64_t *qpos, int64_t B, int64_t Hq,
                       int64_t Hkv, int64_t D, float scale, bf16_t *out, int nthreads) {
    if (B < 1 || Hkv < 1 || Hq % Hkv != 0 || D % 64 != 0 || D > 256 || nthreads < 1 || Hq / Hkv > 8) return 1;
    const int64_t g = Hq / Hkv;
    const int amx = rc_amx(-1);
    int64_t pack_words = 0, nitems = 0, npack = 0, part_floats = 0, nmerge = 0;
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
            const int64_t nc = (S + DECODE_CHUNK - 1) / DECODE_CHUNK;
            nitems += nc;
            part_floats += nc * Hq * (D + 2);
            nmerge += Hq;
        } else {
            int64_t S_pad = (S + KB - 1) / KB * KB;
            pack_words += 2 * Hkv * S_pad * D / 2;
            npack += Hkv * (S_pad / KB);
            nitems += Hkv * ((T + QPOS - 1) / QPOS);
        }
    }
    uint32_t *pack = pack_words ? aligned_alloc(64, (size_t)(pack_words * 4)) : NULL;
    int64_t *pack_at = malloc(sizeof(int64_t) * (size_t)B);
    work_t *items = malloc(sizeof(work_t) * (size_t)nitems);
    work_t *packs = malloc(sizeof(work_t) * (size_t)(npack ? npack : 1));
    float *parts = part_floats ? malloc(sizeof(float) * (size_t)part_floats) : NULL;
    work_t *merges = malloc(sizeof(work_t) * (size_t)(nmerge ? nmerge : 1));
    if ((pack_words && !pack) || !pack_at || !items || !packs || (part_floats && !parts) || !merges) {
        free(pack); free(pack_at); free(items); free(packs); free(parts); free(merges);
        return 2;
    }
    int64_t at = 0, ni = 0, np = 0, pa = 0, nm = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t T = q_off[b + 1] - q_off[b], S = ctx_off[b + 1] - ctx_off[b];
        pack_at[b] = at;
        if (decode[b]) { /* chunks of DECODE_CHUNK keys (t0: the first key; h: where its parts start), then the merges */
            const int64_t nc = (S + DECODE_CHUNK - 1) / DECODE_CHUNK;
            for (int64_t c = 0; c < nc; c++) items[ni++] = (work_t){b, pa + c * Hq * (D + 2), c * DECODE_CHUNK, -1};
            for (int64_t hq = 0; hq < Hq; hq++) merges[nm++] = (work_t){b, hq, pa, nc};
            pa += nc * Hq * (D + 2);
            continue;
        }
        int64_t S_pad = (S + KB - 1) / KB * KB, nqb = (T + QPOS - 1) / QPOS;
        at += 2 * Hkv * S_pad * D / 2;
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t c = 0; c < S_pad / KB; c++) packs[np++] = (work_t){b, h, c, 0};
        for (int64_t qb = nqb - 1; qb >= 0; qb--) /* the latest query blocks (most keys) first */
            for (int64_t h = 0; h < Hkv; h++) items[ni++] = (work_t){b, h, qb * QPOS, (qb + 1) * QPOS < T ? (qb + 1) * QPOS : T};
    }
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t w = 0; w < np; w++) {
            work_t it = packs[w];
            int64_t S = ctx_off[it.seq + 1] - ctx_off[it.seq], S_pad = (S + KB - 1) / KB * KB;
            uint32_t *kp = pack + pack_at[it.seq] + it.h * S_pad * D / 2;
            uint32_t *vp = pack + pack_at[it.seq] + (Hkv + it.h) * S_pad * D / 2;
            (amx ? pack_keys_amx : pack_keys)(kc, vc, Hkv * D, slots + ctx_off[it.seq], S, it.h, D, it.t0 * KB, (it.t0 + 1) * KB, kp, vp);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < ni; w++) {
            work_t it = items[w];
            int64_t S = ctx_off[it.seq + 1] - ctx_off[it.seq], T = q_off[it.seq + 1] - q_off[it.seq];
            const bf16_t *qs = q + q_off[it.seq] * q_row;
            bf16_t *os = out + q_off[it.seq] * Hq * D;
            if (it.t1 < 0) {
                const int64_t n = S - it.t0 < DECODE_CHUNK ? S - it.t0 : DECODE_CHUNK;
                rc_decode_chunk(qs, D, g, Hkv, n, kc, vc, Hkv * D, slots + ctx_off[it.seq] + it.t0, scale, parts + it.h);
            } else {
                int64_t S_pad = (S + KB - 1) / KB * KB;
                const uint32_t *kp = pack + pack_at[it.seq] + it.h * S_pad * D / 2;
                const uint32_t *vp = pack + pack_at[it.seq] + (Hkv + it.h) * S_pad * D / 2;
                (amx ? attend_item_amx : attend_item)(qs, q_row, D, g, it.h, it.t0, it.t1, S - T,
                                                     qpos ? qpos + q_off[it.seq] : NULL, kp, vp, scale, os, Hq * D);
            }
        }
#pragma omp for schedule(static)
        for (int64_t w = 0; w < nm; w++) {
            work_t it = merges[w];
            rc_decode_merge(parts + it.t0, it.t1, Hq, D, it.h, out + (q_off[it.seq] * Hq + it.h) * D);
        }
    }
    free(pack); free(pack_at); free(items); free(packs); free(parts); free(merges);
    return 0;
}
