/* Fused row-wise steps of a Llama decoder layer for bf16 on AVX512-BF16 CPUs (ragcache).
 *
 * Each replaces several PyTorch ops (and their dispatch, which dominates a decode step of a small
 * model): RoPE on Q and K plus the KV arena write; residual add plus RMSNorm; SiLU(gate) * up.
 * Every row is computed alone (float32 inside, one bf16 rounding where PyTorch rounds), so results
 * do not depend on how many rows a call has: the property cache exactness needs.
 * Lengths must be multiples of 16 (the Python side checks and otherwise keeps the torch path).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "bf16_common.h" /* load_bf16, store_bf16, round_bf16, the row kernels' declarations */
#include "simd_exp.h"    /* exp512 */

#define TGT TGT_BF16

/* One row of rc_rope_write: rotate the Hq query and Hkv key heads of x [Hq + 2 Hkv, D] by c/s [D],
 * then copy its keys and values to kd / vd [Hkv, D] (its arena slot). */
TGT HIDDEN void rc_rope_write_row(bf16_t *x, int64_t Hq, int64_t Hkv, int64_t D, const float *c, const float *s, bf16_t *kd,
                                  bf16_t *vd) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < Hq + Hkv; h++) {
        bf16_t *xh = x + h * D;
        for (int64_t d = 0; d < half; d += 16) {
            __m512 a = load_bf16(xh + d), b = load_bf16(xh + half + d);
            /* out[:half] = a cos - b sin; out[half:] = b cos + a sin (rotate_half) */
            __m512 lo = _mm512_fmsub_ps(a, _mm512_loadu_ps(c + d), _mm512_mul_ps(b, _mm512_loadu_ps(s + d)));
            __m512 hi = _mm512_fmadd_ps(b, _mm512_loadu_ps(c + half + d), _mm512_mul_ps(a, _mm512_loadu_ps(s + half + d)));
            store_bf16(xh + d, lo);
            store_bf16(xh + half + d, hi);
        }
    }
    const bf16_t *ks = x + Hq * D, *vs = x + (Hq + Hkv) * D;
    for (int64_t i = 0; i < Hkv * D; i += 32) {
        _mm512_storeu_si512(kd + i, _mm512_loadu_si512(ks + i));
        _mm512_storeu_si512(vd + i, _mm512_loadu_si512(vs + i));
    }
}

/* In place on qkv [N, Hq + 2 Hkv, D] (row stride (Hq + 2 Hkv) D): rotate the Hq query and Hkv key
 * heads of row n by cos/sin [N, D] (float32, HF "rotate_half" layout), then write row n's keys and
 * values to kc/vc [slots, Hkv, D] at slot slots[n]. */
TGT void rc_rope_write(bf16_t *qkv, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, const float *cos,
                       const float *sin, bf16_t *kc, bf16_t *vc, const int64_t *slots, int nthreads) {
    const int64_t row = (Hq + 2 * Hkv) * D;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N > 8)
    for (int64_t n = 0; n < N; n++)
        rc_rope_write_row(qkv + n * row, Hq, Hkv, D, cos + n * D, sin + n * D, kc + slots[n] * Hkv * D, vc + slots[n] * Hkv * D);
}

/* One row of rc_add_rms_norm: x [H] += delta (if not NULL), out [H] = its RMSNorm. */
TGT HIDDEN void rc_add_rms_norm_row(bf16_t *x, const bf16_t *delta, const bf16_t *weight, float eps, int64_t H, bf16_t *out) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < H; i += 16) {
        __m512 v = load_bf16(x + i);
        if (delta) {
            v = round_bf16(_mm512_add_ps(v, load_bf16(delta + i)));
            store_bf16(x + i, v);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));
    for (int64_t i = 0; i < H; i += 16) {
        __m512 v = round_bf16(_mm512_mul_ps(load_bf16(x + i), r));
        store_bf16(out + i, _mm512_mul_ps(v, load_bf16(weight + i)));
    }
}

/* h [N, H] += delta (if not NULL; one bf16 rounding, as h + delta in torch), then
 * out = weight * bf16(h * rsqrt(mean(h^2) + eps)) (HF LlamaRMSNorm's roundings). */
TGT void rc_add_rms_norm(bf16_t *h, const bf16_t *delta, const bf16_t *weight, float eps, int64_t N, int64_t H,
                         bf16_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N > 8)
    for (int64_t n = 0; n < N; n++) rc_add_rms_norm_row(h + n * H, delta ? delta + n * H : NULL, weight, eps, H, out + n * H);
}

/* One row of rc_silu_mul: out [I] = bf16(silu(g)) * u. */
TGT HIDDEN void rc_silu_mul_row(const bf16_t *g, const bf16_t *u, int64_t I, bf16_t *out) {
    for (int64_t i = 0; i < I; i += 16) store_bf16(out + i, silu_mul16(load_bf16(g + i), load_bf16(u + i)));
}

/* out [N, I] = bf16(silu(gate)) * up, with gate_up [N, 2I] = [gate | up] per row. */
TGT void rc_silu_mul(const bf16_t *gate_up, int64_t N, int64_t I, bf16_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N > 8)
    for (int64_t n = 0; n < N; n++) rc_silu_mul_row(gate_up + n * 2 * I, gate_up + n * 2 * I + I, I, out + n * I);
}
