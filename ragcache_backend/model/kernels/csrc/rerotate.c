/* A reused chunk's KV copied to its new place with its keys moved by delta positions (ragcache):
 * Cache-Craft's RoPE re-rotation (section 3.4.3), R(p + d) k = R(d) R(p) k, for every layer of the
 * arena in one call, float32 or bf16.
 *
 * Why: done with PyTorch ops (gather, float32 copy, rotate-half, two products, a sum, a rounding,
 * a scatter) it allocated and wrote ~5 temporaries of the chunk's size per call: ~0.1 s for the
 * eight reused chunks (~1,250 tokens, 30 layers) of one RAG request on a 2-core Xeon; here each key
 * row is read once, rotated in registers, written once.
 *
 * Arithmetic (the same bits as those ops): out[i] = k[i] c[i] + r[i] s[i] with r = (-k[D/2 ..],
 * k[.. D/2]), the two products and the sum each rounded to float32 (no FMA: PyTorch ran them as
 * three ops), then one rounding to the arena's dtype (bf16: to nearest even, NaN to 0x7FC0 as
 * c10::BFloat16). Values are copied as they are. Plain C: memory-bound, any x86-64 (or other) CPU.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off") /* the products and the sum rounded apart, as PyTorch's three ops */
#endif

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

/* One key row of D values rotated (see above); in/out may not alias. */
static inline void rotate_f32(const float *k, const float *c, const float *s, int64_t D, float *out) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < D; i++) {
        const float r = i < half ? -k[i + half] : k[i - half];
        const float a = k[i] * c[i], b = r * s[i];
        out[i] = a + b;
    }
}

/* Every layer l < L of the arena (k, v: layer l at + l * layer_stride elements, a slot's row Hkv * D
 * elements): for t < T, slot dst[t]'s K = slot src[t]'s K rotated by cos / sin ([D] float32, or
 * [L][D] with per_layer: one table per layer), its V = src[t]'s V. dtype_bf16: the arena is bf16
 * (else float32). Source and destination slots must not overlap. Returns 0, or 1 on bad arguments. */
int rc_rerotate_copy(void *k, void *v, int64_t layer_stride, int64_t L, int64_t Hkv, int64_t D, const int64_t *src,
                     const int64_t *dst, int64_t T, const float *cos, const float *sin, int per_layer, int dtype_bf16,
                     int nthreads) {
    if (L < 1 || Hkv < 1 || D < 2 || D % 2 || D > 512 || T < 0 || nthreads < 1) return 1;
    const int64_t row = Hkv * D;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t w = 0; w < L * T; w++) {
        const int64_t l = w / T, t = w % T;
        const float *c = cos + (per_layer ? l * D : 0), *s = sin + (per_layer ? l * D : 0);
        float kin[512], kout[512];
        if (dtype_bf16) {
            const bf16_t *ks = (const bf16_t *)k + l * layer_stride + src[t] * row;
            bf16_t *kd = (bf16_t *)k + l * layer_stride + dst[t] * row;
            for (int64_t h = 0; h < Hkv; h++) {
                for (int64_t i = 0; i < D; i++) kin[i] = bf16_to_f32(ks[h * D + i]);
                rotate_f32(kin, c, s, D, kout);
                for (int64_t i = 0; i < D; i++) kd[h * D + i] = f32_to_bf16(kout[i]);
            }
            memcpy((bf16_t *)v + l * layer_stride + dst[t] * row, (const bf16_t *)v + l * layer_stride + src[t] * row,
                   sizeof(bf16_t) * (size_t)row);
        } else {
            const float *ks = (const float *)k + l * layer_stride + src[t] * row;
            float *kd = (float *)k + l * layer_stride + dst[t] * row;
            for (int64_t h = 0; h < Hkv; h++) rotate_f32(ks + h * D, c, s, D, kd + h * D);
            memcpy((float *)v + l * layer_stride + dst[t] * row, (const float *)v + l * layer_stride + src[t] * row,
                   sizeof(float) * (size_t)row);
        }
    }
    return 0;
}
