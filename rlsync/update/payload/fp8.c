/* FP8's block quantize and dequantize on a CPU (rlsync/update/payload/native.py compiles and loads it;
   kernels.quantize_whole and kernels.dequantize_whole call it). Bit for bit rlsync/update/payload/fp8.py's
   reference: torch's float32 -> e4m3fn and e4m3fn -> float32 conversions (c10's fp8e4m3fn_from_fp32_value and
   fp8e4m3fn_to_fp32_value) and its float32 -> bfloat16 cast, each written without a branch (selects) so that
   gcc vectorises them; the quotient a true IEEE divide (no reciprocal: never built with -ffast-math).

   A tensor is (rows x cols) row-major, both multiples of 128, one float32 scale per 128x128 block (block rows x
   block columns, row-major). Each exported function takes a range of block rows [b0, b1) of the whole tensor,
   so that threads split a tensor by block rows. The quantize reads each 128-row band a group of GROUP block
   columns at a time: first the group's block amaxes, then its divide and conversion from cache, so the source
   crosses from memory once. Bits are read by memcpy (no type punning
   through pointers: strict aliasing holds). */

#include <stdint.h>
#include <string.h>

#define BLOCK 128
/* Block columns a band is read by (up to 128 rows x 8192 float32: 4 MiB, in L3). Measured on this project's
   AMD EPYC (1 MiB L2, 32 MiB L3), Qwen3-0.6B's shapes and a 1024 x 8192, one thread: 0.51 ns an element with 64
   against 0.60 with 4 (2 MiB of L2 bands) and 0.66 with 8: the band's rows read in long runs beat an L2 fit. */
#ifndef GROUP
#define GROUP 64
#endif

#if defined(__GNUC__) || defined(__clang__)
#define INLINE static inline __attribute__((always_inline))
#define OUTLINE static __attribute__((noinline))
#else
#define INLINE static inline
#define OUTLINE static
#endif

INLINE uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

INLINE float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* c10's fp8e4m3fn_from_fp32_value with its branches as selects: every path computed, one kept. */
INLINE uint8_t e4m3_of(float f) {
    const uint32_t fp8_max = UINT32_C(1087) << 20;    /* 480.0f: the first value past e4m3fn's range */
    const uint32_t denorm_mask = UINT32_C(141) << 23; /* ((127 - 7) + (23 - 3) + 1) << 23 */
    uint32_t u = bits_of(f);
    uint32_t sign = u & UINT32_C(0x80000000);
    uint32_t a = u ^ sign;
    /* below 2^-6: e4m3's subnormals, rounded by a float add (round to nearest even) */
    uint32_t small = (bits_of(float_of(a) + float_of(denorm_mask)) - denorm_mask) & 0xFF;
    /* normal: the exponent rebased, rounded to nearest even by a bias, 0x7f (a carry into NaN) saturated */
    uint32_t normal = ((a + (((uint32_t)(7 - 127)) << 23) + UINT32_C(0x7FFFF) + ((a >> 20) & 1)) >> 20) & 0xFF;
    normal = normal == 0x7F ? 0x7E : normal;
    uint32_t r = a < (UINT32_C(121) << 23) ? small : normal;
    r = a >= fp8_max ? (a > UINT32_C(0x7F800000) ? 0x7F : 0x7E) : r; /* NaN stays NaN; inf and overflow: 448 */
    return (uint8_t)(r | (sign >> 24));
}

/* c10's fp8e4m3fn_to_fp32_value's result without its count of leading zeros: a normal value's bits rebased, a
   subnormal's (m/8 * 2^-6, m < 8) through an exact int -> float conversion, 0x7f and 0xff NaN (0x7FF00000). */
INLINE float float_of_e4m3(uint8_t b) {
    uint32_t m = b & 0x7F;
    uint32_t sign = (uint32_t)(b & 0x80) << 24;
    uint32_t sub = bits_of((float)(int32_t)m * 0x1p-9f);
    uint32_t is_sub = -(uint32_t)(m < 8), is_nan = -(uint32_t)(m == 0x7F); /* masks: all ones where true */
    uint32_t r = (sub & is_sub) | (((m << 20) + (UINT32_C(120) << 23)) & ~is_sub);
    r = (UINT32_C(0x7FF00000) & is_nan) | (r & ~is_nan);
    return float_of(r | sign);
}

/* torch's vectorised float32 -> bfloat16 cast on a CPU: round to nearest even, every NaN 0xFFFF. */
INLINE uint16_t bf16_of(float f) {
    uint32_t u = bits_of(f);
    uint32_t r = (u + UINT32_C(0x7FFF) + ((u >> 16) & 1)) >> 16;
    uint32_t is_nan = -(uint32_t)((u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000));
    return (uint16_t)(r | is_nan);
}

/* A block's scale as kernels.scale_of: its largest magnitude over 448, 1 where that is 0 or NaN (torch.where's
   amax > 0 is false for NaN). The amax as the largest of the magnitudes' bits: ordered as the values are, a
   NaN's above infinity's, so a NaN anywhere in the block wins, as torch's amax propagates it. */
INLINE float scale_of(uint32_t amax_bits) {
    float amax = float_of(amax_bits);
    return amax_bits > UINT32_C(0x7F800000) || !(amax > 0.0f) ? 1.0f : amax / 448.0f;
}

/* One block's row: each value over the block's scale (a true divide), as e4m3. Not inlined: inlined into the
   band's loops gcc 12 leaves it scalar ("complicated access pattern"); a call per 128 elements costs nothing. */
OUTLINE void quantize_run(const float *restrict p, uint8_t *restrict o, const float d) {
    for (int k = 0; k < BLOCK; k++)
        o[k] = e4m3_of(p[k] / d);
}

void rlsync_fp8_quantize(const float *x, int64_t rows, int64_t cols, int64_t b0, int64_t b1, uint8_t *q,
                         float *scale) {
    const int64_t bcols = cols / BLOCK;
    (void)rows;
    for (int64_t br = b0; br < b1; br++) {
        const float *band = x + br * BLOCK * cols;
        uint8_t *out = q + br * BLOCK * cols;
        for (int64_t g0 = 0; g0 < bcols; g0 += GROUP) {
            const int64_t g1 = g0 + GROUP < bcols ? g0 + GROUP : bcols;
            uint32_t amax[GROUP] = {0};
            float s[GROUP];
            for (int64_t r = 0; r < BLOCK; r++)
                for (int64_t j = g0; j < g1; j++) {
                    const float *p = band + r * cols + j * BLOCK;
                    uint32_t m = amax[j - g0];
                    for (int k = 0; k < BLOCK; k++) {
                        uint32_t a = bits_of(p[k]) & UINT32_C(0x7FFFFFFF);
                        m = a > m ? a : m;
                    }
                    amax[j - g0] = m;
                }
            for (int64_t j = g0; j < g1; j++) {
                s[j - g0] = scale_of(amax[j - g0]);
                scale[br * bcols + j] = s[j - g0];
            }
            for (int64_t r = 0; r < BLOCK; r++)
                for (int64_t j = g0; j < g1; j++)
                    quantize_run(band + r * cols + j * BLOCK, out + r * cols + j * BLOCK, s[j - g0]);
        }
    }
}

#define DEQUANTIZE(NAME, T, CONVERT)                                                                               \
    INLINE void NAME##_run(const uint8_t *restrict p, T *restrict o, const float d) {                              \
        for (int k = 0; k < BLOCK; k++)                                                                            \
            o[k] = CONVERT(float_of_e4m3(p[k]) * d);                                                               \
    }                                                                                                              \
    void NAME(const uint8_t *q, const float *scale, int64_t rows, int64_t cols, int64_t b0, int64_t b1, T *out) { \
        const int64_t bcols = cols / BLOCK;                                                                        \
        (void)rows;                                                                                                \
        for (int64_t r = b0 * BLOCK; r < b1 * BLOCK; r++) {                                                        \
            const float *s = scale + (r / BLOCK) * bcols;                                                          \
            for (int64_t j = 0; j < bcols; j++)                                                                    \
                NAME##_run(q + r * cols + j * BLOCK, out + r * cols + j * BLOCK, s[j]);                            \
        }                                                                                                          \
    }

#define AS_FLOAT(f) (f)
DEQUANTIZE(rlsync_fp8_dequantize_bf16, uint16_t, bf16_of)
DEQUANTIZE(rlsync_fp8_dequantize_f32, float, AS_FLOAT)

/* The conversions alone, element by element over n (the self-check and the tests). */
void rlsync_fp8_from_float(const float *x, int64_t n, uint8_t *q) {
    for (int64_t i = 0; i < n; i++)
        q[i] = e4m3_of(x[i]);
}

void rlsync_fp8_to_float(const uint8_t *q, int64_t n, float *x) {
    for (int64_t i = 0; i < n; i++)
        x[i] = float_of_e4m3(q[i]);
}
