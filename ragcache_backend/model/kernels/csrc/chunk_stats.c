/* The chunk-cache mode's per-layer measurements, read from the arena in place (ragcache):
 *
 * - rc_segment_mass: the attention statistics of Cache-Craft eq. 3-4 (the softmax mass each query
 *   row gives each context segment) and the quality guard's last-row masses, on a bf16 arena. The
 *   float32 kernel (rc32_segment_mass, kernels_f32.c) needed a bf16 arena's context keys gathered
 *   and converted to float32 first, and packed every key even for one row (the guard's case: one
 *   row per layer, ~0.3 ms a call for a 1,000-token context, most of it the gather and the pack).
 *   Here the keys are read as bf16 and multiplied on AVX512-BF16 (vdpbf16ps: each product of two
 *   bf16 values is exact in float32, the sums float32), packed only when a tile of rows shares
 *   them; for 64-dim heads where AMX runs (rc_amx), 16 query rows at a time on AMX tiles (the
 *   packed panels are already TDPBF16PS's B operand).
 * - rc_kv_deviation / rc32_kv_deviation: the guard's K/V deviation of recomputed rows, relative
 *   L2 of the arena's new K and V against their values before the layer's write, in one pass
 *   (the torch form converted both to float32, concatenated them and took three norms).
 *
 * Returns 0 on success, 1 if the arguments are out of range, 2 if out of memory. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_common.h" /* bf16_t, TGT_BF16, load_bf16 */
#include "simd_exp.h"    /* exp512 */

#define SM_QT 8    /* query rows per register tile (8 accumulators of 16 keys) */
#define SM_DIRECT 4 /* up to this many rows, keys are read from the arena unpacked */
#define SM_DMAX 256

/* Keys [0, S_pad) of KV head h as panels of 16 keys, [S_pad / 16][D / 2][16] bf16 pairs (the
 * vdpbf16ps operand: lane j holds key j's dims 2p and 2p + 1); keys >= S are zero. */
static void sm_pack(const bf16_t *kc, int64_t slot_row, const int64_t *slots, int64_t S, int64_t h, int64_t D,
                    int64_t start, int64_t end, uint32_t *kp) {
    const int64_t DP = D / 2;
    for (int64_t j = start; j < end; j++) {
        uint32_t *dst = kp + (j / 16) * DP * 16 + (j % 16);
        if (j < S) {
            const bf16_t *row = kc + slots[j] * slot_row + h * D;
            for (int64_t p = 0; p < DP; p++) {
                uint32_t pair;
                memcpy(&pair, row + 2 * p, sizeof pair);
                dst[p * 16] = pair;
            }
        } else {
            for (int64_t p = 0; p < DP; p++) dst[p * 16] = 0;
        }
    }
}

/* The softmax of one row's scores s[0 .. valid) (unscaled dot products; valid >= 1) summed per
 * segment into dst[nseg], normalised: scale and max, then exp(s - max) in place, then the
 * segments' sums. */
TGT_BF16 static void sm_row(float *s, int64_t valid, float scale, const int64_t *seg_off, int64_t nseg, float *dst) {
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 bm = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= valid; j += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), vs);
        _mm512_storeu_ps(s + j, x);
        bm = _mm512_max_ps(bm, x);
    }
    const __mmask16 tail = (__mmask16)((1u << (valid - j)) - 1u);
    if (j < valid) {
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + j), vs);
        _mm512_mask_storeu_ps(s + j, tail, x);
        bm = _mm512_mask_max_ps(bm, tail, bm, x);
    }
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(bm));
    for (j = 0; j + 16 <= valid; j += 16) _mm512_storeu_ps(s + j, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv)));
    if (j < valid) _mm512_mask_storeu_ps(s + j, tail, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), mv)));
    float total = 0.0f;
    for (int64_t g = 0; g < nseg; g++) {
        const int64_t a = seg_off[g], b = seg_off[g + 1] < valid ? seg_off[g + 1] : valid;
        float sum = 0.0f;
        if (a < b) {
            __m512 acc = _mm512_setzero_ps();
            int64_t k = a;
            for (; k + 16 <= b; k += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(s + k));
            if (k < b) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps((__mmask16)((1u << (b - k)) - 1u), s + k));
            sum = _mm512_reduce_add_ps(acc);
        }
        dst[g] = sum;
        total += sum;
    }
    const float inv = 1.0f / total;
    for (int64_t g = 0; g < nseg; g++) dst[g] *= inv;
}

/* Dot products of up to SM_DIRECT rows (qv, each D bf16) with keys [0, n) read from the arena
 * unpacked: 32 dims per vdpbf16ps, one horizontal sum per key. */
TGT_BF16 static void sm_scores_direct(const bf16_t *const *qv, int nq, int64_t D, const bf16_t *kc, int64_t slot_row,
                                      const int64_t *slots, int64_t h, int64_t n, float *sc, int64_t sc_row) {
    const int64_t nc = D / 32, rem = D % 32;
    const __mmask32 tail = (__mmask32)((1ull << rem) - 1ull);
    __m512bh q[SM_DIRECT][SM_DMAX / 32 + 1];
    for (int i = 0; i < nq; i++) {
        for (int64_t c = 0; c < nc; c++) q[i][c] = (__m512bh)_mm512_loadu_si512(qv[i] + 32 * c);
        if (rem) q[i][nc] = (__m512bh)_mm512_maskz_loadu_epi16(tail, qv[i] + 32 * nc);
    }
    for (int64_t j = 0; j < n; j++) {
        const bf16_t *kr = kc + slots[j] * slot_row + h * D;
        __m512bh k[SM_DMAX / 32 + 1];
        for (int64_t c = 0; c < nc; c++) k[c] = (__m512bh)_mm512_loadu_si512(kr + 32 * c);
        if (rem) k[nc] = (__m512bh)_mm512_maskz_loadu_epi16(tail, kr + 32 * nc);
        for (int i = 0; i < nq; i++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; c < nc + (rem != 0); c++) acc = _mm512_dpbf16_ps(acc, k[c], q[i][c]);
            sc[i * sc_row + j] = _mm512_reduce_add_ps(acc);
        }
    }
}

/* Dot products of SM_QT rows (qv; a short tile repeats its last row) with the packed keys of
 * panels [0, npanel): 16 keys per panel, one bf16 pair of every row broadcast per step. */
TGT_BF16 static void sm_scores_packed(const bf16_t *const *qv, int64_t D, const uint32_t *kp, int64_t npanel, float *sc,
                                      int64_t sc_row) {
    const int64_t DP = D / 2;
    for (int64_t b = 0; b < npanel; b++) {
        const uint32_t *panel = kp + b * DP * 16;
        __m512 c[SM_QT];
        for (int i = 0; i < SM_QT; i++) c[i] = _mm512_setzero_ps();
        for (int64_t p = 0; p < DP; p++) {
            const __m512bh k = (__m512bh)_mm512_loadu_si512(panel + p * 16);
            for (int i = 0; i < SM_QT; i++) {
                uint32_t pair;
                memcpy(&pair, qv[i] + 2 * p, sizeof pair);
                c[i] = _mm512_dpbf16_ps(c[i], k, (__m512bh)_mm512_set1_epi32((int)pair));
            }
        }
        for (int i = 0; i < SM_QT; i++) _mm512_storeu_ps(sc + i * sc_row + 16 * b, c[i]);
    }
}

#ifdef RC_HAVE_AMX
/* Dot products of `rows` (1 .. 16) consecutive query rows (q0, row stride q_row elements; D = 64)
 * with the packed keys of panels [0, npanel), on AMX tiles (the caller configured `rows` rows):
 * A tiles t3 / t4 hold the rows' dims 0-31 / 32-63, a panel's pairs 0-15 / 16-31 are its B tiles
 * (t5 / t6: a panel is already the B operand's layout), sums of three panels (48 keys) in t0-t2. */
TGT_AMX static void sm_scores_amx(const bf16_t *q0, int64_t q_row, const uint32_t *kp, int64_t npanel, float *sc,
                                  int64_t sc_row) {
    const int64_t stride = sc_row * (int64_t)sizeof(float);
    _tile_loadd(3, q0, q_row * (int64_t)sizeof(bf16_t));
    _tile_loadd(4, q0 + 32, q_row * (int64_t)sizeof(bf16_t));
    for (int64_t b = 0; b < npanel; b += 3) {
        const uint32_t *p0 = kp + b * 32 * 16;
        _tile_zero(0);
        _tile_loadd(5, p0, 64);
        _tile_loadd(6, p0 + 16 * 16, 64);
        _tile_dpbf16ps(0, 3, 5);
        _tile_dpbf16ps(0, 4, 6);
        if (b + 1 < npanel) {
            _tile_zero(1);
            _tile_loadd(5, p0 + 32 * 16, 64);
            _tile_loadd(6, p0 + 48 * 16, 64);
            _tile_dpbf16ps(1, 3, 5);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (b + 2 < npanel) {
            _tile_zero(2);
            _tile_loadd(5, p0 + 64 * 16, 64);
            _tile_loadd(6, p0 + 80 * 16, 64);
            _tile_dpbf16ps(2, 3, 5);
            _tile_dpbf16ps(2, 4, 6);
        }
        _tile_stored(0, sc + 16 * b, stride);
        if (b + 1 < npanel) _tile_stored(1, sc + 16 * (b + 1), stride);
        if (b + 2 < npanel) _tile_stored(2, sc + 16 * (b + 2), stride);
    }
}

TGT_AMX static void sm_tiles_begin(int rows) { amx_configure_rows(rows); }
TGT_AMX static void sm_tiles_end(void) { _tile_release(); }
#endif

/* out[t, h, s] = sum over keys j of segment s with j <= qpos[t] of softmax_j(scale q[t, h] . K_h[j])
 * (keys 0 .. qpos[t]): rc32_segment_mass's definition and arguments (kernels_f32.c), on bf16
 * queries q ([T, H, D], row stride q_row and head stride q_head in elements, each head's D values
 * contiguous; query head h reads KV head h) and a bf16 arena kc ([slots, H, D]); out float32. D even. */
TGT_BF16 int rc_segment_mass(const bf16_t *q, int64_t q_row, int64_t q_head, const bf16_t *kc, const int64_t *slots, int64_t S,
                             const int64_t *qpos, int64_t T, int64_t H, int64_t D, const int64_t *seg_off, int64_t nseg,
                             float scale, float *out, int nthreads) {
    if (T < 1 || S < 1 || H < 1 || D < 2 || D % 2 != 0 || D > SM_DMAX || nseg < 1 || nthreads < 1) return 1;
    if (seg_off[0] != 0 || seg_off[nseg] != S) return 1;
    for (int64_t s = 0; s < nseg; s++)
        if (seg_off[s + 1] <= seg_off[s]) return 1;
    int64_t maxpos = 0;
    for (int64_t t = 0; t < T; t++) {
        if (qpos[t] < 0 || qpos[t] >= S) return 1;
        if (qpos[t] > maxpos) maxpos = qpos[t];
    }
    const int64_t slot_row = H * D, n = maxpos + 1, S_pad = (n + 15) / 16 * 16;
    const int direct = T <= SM_DIRECT;
#ifdef RC_HAVE_AMX
    const int amx = !direct && D == 64 && rc_amx(-1); /* 16-row tiles of queries on AMX */
#else
    const int amx = 0;
#endif
    const int64_t rows = direct ? SM_DIRECT : amx ? 16 : SM_QT, ntile = direct ? 1 : (T + rows - 1) / rows;
    uint32_t *pack = direct ? NULL : aligned_alloc(64, (size_t)(H * S_pad * (D / 2)) * sizeof(uint32_t));
    float *scratch = aligned_alloc(64, (size_t)nthreads * rows * S_pad * sizeof(float));
    if ((!direct && !pack) || !scratch) {
        free(pack); free(scratch);
        return 2;
    }
    if (H * ntile < nthreads) nthreads = (int)(H * ntile);
#pragma omp parallel num_threads(nthreads)
    {
        if (!direct) {
            const int64_t nblk = S_pad / 64 + (S_pad % 64 != 0);
#pragma omp for schedule(static)
            for (int64_t w = 0; w < H * nblk; w++) {
                const int64_t h = w / nblk, a = (w % nblk) * 64, b = a + 64 < S_pad ? a + 64 : S_pad;
                sm_pack(kc, slot_row, slots, S, h, D, a, b, pack + h * S_pad * (D / 2));
            }
        }
        float *sc = scratch + (size_t)omp_get_thread_num() * rows * S_pad;
        int tile_rows = 0; /* the AMX tiles' configured row count on this thread (0: not configured) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < H * ntile; w++) {
            const int64_t h = w / ntile, t0 = (w % ntile) * rows;
            const bf16_t *qv[16];
            int64_t lim = 0;
            for (int i = 0; i < rows; i++) {
                const int64_t t = t0 + i < T ? t0 + i : T - 1; /* pad a short tile with its last row */
                qv[i] = q + t * q_row + h * q_head;
                if (qpos[t] > lim) lim = qpos[t];
            }
            if (direct) {
                sm_scores_direct(qv, (int)T, D, kc, slot_row, slots, h, lim + 1, sc, S_pad);
            } else if (amx) {
#ifdef RC_HAVE_AMX
                const int n = (int)(T - t0 < 16 ? T - t0 : 16);
                if (n != tile_rows) sm_tiles_begin(tile_rows = n);
                sm_scores_amx(qv[0], q_row, pack + h * S_pad * (D / 2), lim / 16 + 1, sc, S_pad);
#endif
            } else {
                sm_scores_packed(qv, D, pack + h * S_pad * (D / 2), lim / 16 + 1, sc, S_pad);
            }
            for (int i = 0; i < rows && t0 + i < T; i++)
                sm_row(sc + i * S_pad, qpos[t0 + i] + 1, scale, seg_off, nseg, out + ((t0 + i) * H + h) * nseg);
        }
#ifdef RC_HAVE_AMX
        if (tile_rows) sm_tiles_end();
#endif
    }
    free(pack); free(scratch);
    return 0;
}

/* out[t] = |new_t - old_t| / |old_t| (0 where |old_t| = 0; the denominator at least 1e-6), where
 * new_t is the arena's K and V at slot slots[t] (kc, vc: [slots, row] of row = Hkv D values) and
 * old_t those rows' values before this layer's write (old_k, old_v: [T, row] contiguous), K and V
 * taken as one vector; sums in float32. */
#define KV_DEVIATION(T_ELEM, LOAD)                                                                                     \
    if (T < 0 || row < 1 || nthreads < 1) return 1;                                                                    \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (T * row > 32768)")                            \
    for (int64_t t = 0; t < T; t++) {                                                                                  \
        const T_ELEM *nk = kc + slots[t] * row, *nv = vc + slots[t] * row, *ok = old_k + t * row, *ov = old_v + t * row; \
        float diff = 0.0f, ref = 0.0f;                                                                                 \
        _Pragma("omp simd reduction(+ : diff, ref)")                                                                   \
        for (int64_t i = 0; i < row; i++) {                                                                            \
            const float o = LOAD(ok[i]), d = LOAD(nk[i]) - o, o2 = LOAD(ov[i]), d2 = LOAD(nv[i]) - o2;                 \
            diff += d * d + d2 * d2;                                                                                   \
            ref += o * o + o2 * o2;                                                                                    \
        }                                                                                                              \
        out[t] = ref > 0.0f ? sqrtf(diff) / fmaxf(sqrtf(ref), 1e-6f) : 0.0f;                                           \
    }                                                                                                                  \
    return 0;

static inline float bf16_value(bf16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#define F32_VALUE(x) (x)

TGT_BF16 int rc_kv_deviation(const bf16_t *kc, const bf16_t *vc, const int64_t *slots, int64_t T, int64_t row,
                             const bf16_t *old_k, const bf16_t *old_v, float *out, int nthreads) {
    KV_DEVIATION(bf16_t, bf16_value)
}

__attribute__((target("avx2,fma"))) int rc32_kv_deviation(const float *kc, const float *vc, const int64_t *slots, int64_t T,
                                                           int64_t row, const float *old_k, const float *old_v, float *out,
                                                           int nthreads) {
    KV_DEVIATION(float, F32_VALUE)
}
