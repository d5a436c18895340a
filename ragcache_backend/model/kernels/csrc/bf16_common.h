/* What the bf16 kernel files share (ragcache): bf16 loads, stores and roundings on AVX-512 registers,
 * and the row kernels one file defines and another calls (hidden: not exported from the library).
 * Included by paged_attention_bf16.c, fused_bf16.c, decode_bf16.c and linear_amx.c. */
#ifndef RAGCACHE_BF16_COMMON_H
#define RAGCACHE_BF16_COMMON_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd_exp.h" /* exp512 */

typedef uint16_t bf16_t;

#define TGT_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl")))
#define HIDDEN __attribute__((visibility("hidden")))

TGT_BF16 static inline __m512 load_bf16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

TGT_BF16 static inline void store_bf16(bf16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
}

TGT_BF16 static inline __m512 round_bf16(__m512 x) { /* x rounded to bf16, back in float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

/* SiLU(g) * u on 16 lanes, g and u bf16 values (in float32): the activation rounded to bf16 as
 * PyTorch rounds it, the product left to the caller's one rounding (rc_silu_mul_row, and our AMX
 * GEMM's gated epilogue in linear_amx.c: the same bits either way). */
TGT_BF16 __attribute__((always_inline)) static inline __m512 silu_mul16(__m512 g, __m512 u) {
    __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    return _mm512_mul_ps(round_bf16(_mm512_mul_ps(g, sig)), u);
}

/* The sums of a, b, c and d's 16 lanes each, as [sum a, sum b, sum c, sum d] (a fixed order of
 * additions: halves of 256 bits, of 128, then of 64 and 32 bits). */
TGT_BF16 __attribute__((always_inline)) static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), t));
}

/* fused_bf16.c: one row of rc_rope_write (x: [Hq + 2 Hkv, D], kd/vd: its arena slot [Hkv, D]),
 * rc_add_rms_norm (delta may be NULL) and rc_silu_mul (g, u: [I]) */
HIDDEN void rc_rope_write_row(bf16_t *x, int64_t Hq, int64_t Hkv, int64_t D, const float *c, const float *s, bf16_t *kd,
                              bf16_t *vd);
HIDDEN void rc_add_rms_norm_row(bf16_t *x, const bf16_t *delta, const bf16_t *weight, float eps, int64_t H, bf16_t *out);
HIDDEN void rc_silu_mul_row(const bf16_t *g, const bf16_t *u, int64_t I, bf16_t *out);

/* paged_attention_bf16.c: a generated token's attention in chunks of DECODE_CHUNK keys (every KV
 * head; part [Hq][D + 2]: unnormalized output, largest score, sum) and their merge into query head hq */
#define DECODE_CHUNK 256
HIDDEN void rc_decode_chunk(const bf16_t *q, int64_t D, int64_t g, int64_t Hkv, int64_t S, const bf16_t *kc, const bf16_t *vc,
                            int64_t slot_row, const int64_t *slots, float scale, float *part);
HIDDEN void rc_decode_merge(const float *parts, int64_t nc, int64_t Hq, int64_t D, int64_t hq, bf16_t *out);

/* AMX (Intel Sapphire Rapids and later): compiled only where the compiler has AMX intrinsics (GCC,
 * clang >= 11; -DRC_NO_AMX forces it off); rc_amx (paged_attention_bf16.c) says whether it runs. */
#if !defined(RC_NO_AMX) && defined(__x86_64__) && defined(__linux__) && defined(__has_include)
#if __has_include(<amxtileintrin.h>) || __has_include(<amxintrin.h>)
#define RC_HAVE_AMX 1
#endif
#endif
int rc_amx(int request);

#ifdef RC_HAVE_AMX
#define TGT_AMX __attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl,amx-tile,amx-bf16")))

/* Every tile 64 bytes a row: t0-t3 float32 sums (rows x 16), t4-t7 operands: A (rows x 32 bf16) or
 * B (16 bf16 pairs x 16 columns). a_rows (1 .. 16): the rows of t0-t4 (the sums and the first A
 * operand; 16 in amx_configure), t5-t7 always 16. A tile of fewer rows reads and computes only
 * those: each row of a sum is its own A row's, computed the same way whatever the row count.
 * Tile configuration is per thread: every thread that runs tiles configures them first, and calls
 * _tile_release() when done. */
TGT_AMX static inline void amx_configure_rows(int a_rows) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t <= 4 ? (uint8_t)a_rows : 16;
    }
    /* GCC does not see _tile_loadconfig read cfg: without this, it dropped the stores above where the
     * function was not inlined (every tile 0 rows: SIGILL at the first tile instruction) */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

TGT_AMX static inline void amx_configure(void) { amx_configure_rows(16); }
#endif
#endif
