/* FP8's block quantize and dequantize on a CPU (rlsync/update/payload/native.py compiles and loads it;
   kernels.native_quantize and kernels.native_dequantize call it). Bit for bit rlsync/update/payload/fp8.py's
   reference: torch's float32 -> e4m3fn and e4m3fn -> float32 conversions (c10's fp8e4m3fn_from_fp32_value and
   fp8e4m3fn_to_fp32_value) and its float32 -> bfloat16 cast, each written without a branch (selects); the
   quotient a true IEEE divide (no reciprocal: never built with -ffast-math).

   A tensor is (rows x cols) row-major, any sizes, one float32 scale per 128x128 block (ceil(rows / 128) block rows
   x ceil(cols / 128) block columns, row-major): the reference's blocks of the tensor zero-padded, the padding never
   read or written (a zero adds nothing to an amax). The last block row's rows stop at the tensor's last row; a
   partial last block column (cols % 128 values a row) runs in its own code after the whole ones (masked loads and
   stores in AVX-512, their masks computed once), so whole blocks run the loops they ran before. Each exported
   function takes a range of block rows [b0, b1) of the whole tensor, so that threads split a tensor by block rows.
   The quantize reads each 128-row band a group of block columns at a time: first the group's block amaxes, then
   its divide and conversion from cache, so the source crosses from memory once. Bits are read by memcpy (no type
   punning through pointers: strict aliasing holds).

   Two implementations of each function: the portable C (gcc vectorises its loops), and where the build's -march
   has AVX-512 the same arithmetic written in its intrinsics (below), faster 1.5x (quantize) and 1.9x (bf16
   dequantize) on this project's AMD EPYC (Zen 4). rlsync_fp8_paths() says which this build holds. */

#include <stdint.h>
#include <string.h>

/* The AVX-512 paths where this build's -march has them; RLSYNC_FP8_PORTABLE forces the portable C, and
   RLSYNC_FP8_NO_VBMI the portable bf16 dequantize beside the AVX-512 rest (the tests build both so, to check
   them too). The bf16 dequantize's lookup needs VBMI's byte permutes besides. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    !defined(RLSYNC_FP8_PORTABLE)
#define FP8_AVX512 1
#include <immintrin.h>
#else
#define FP8_AVX512 0
#endif
#if FP8_AVX512 && defined(__AVX512VBMI__) && !defined(RLSYNC_FP8_NO_VBMI)
#define FP8_VBMI 1
#else
#define FP8_VBMI 0
#endif

#define BLOCK 128
/* Block columns a band is read by (up to 128 rows x 8192 float32: 4 MiB, in L3). Measured on this project's
   AMD EPYC (1 MiB L2, 32 MiB L3), Qwen3-0.6B's shapes and a 1024 x 8192, one thread: 0.51 ns an element with 64
   against 0.60 with 4 (2 MiB of L2 bands) and 0.66 with 8: the band's rows read in long runs beat an L2 fit. */
#ifndef GROUP
#define GROUP 64
#endif

/* Rows of block row `br`: 128, fewer in a partial last one. */
#define BAND_ROWS(rows, br) ((rows) - (br) * BLOCK < BLOCK ? (rows) - (br) * BLOCK : BLOCK)

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

#if !FP8_AVX512
/* One block's row: each value over the block's scale (a true divide), as e4m3. Not inlined: inlined into the
   band's loops gcc 12 leaves it scalar ("complicated access pattern"); a call per 128 elements costs nothing. */
OUTLINE void quantize_run(const float *restrict p, uint8_t *restrict o, const float d) {
    for (int k = 0; k < BLOCK; k++)
        o[k] = e4m3_of(p[k] / d);
}

/* A partial last block column (n < 128 values a row) of a band of h rows: its amax, scale and values. */
OUTLINE void quantize_edge(const float *restrict p, uint8_t *restrict o, int64_t cols, int64_t h, int64_t n,
                           float *s) {
    uint32_t m = 0;
    for (int64_t r = 0; r < h; r++)
        for (int64_t k = 0; k < n; k++) {
            uint32_t a = bits_of(p[r * cols + k]) & UINT32_C(0x7FFFFFFF);
            m = a > m ? a : m;
        }
    const float d = *s = scale_of(m);
    for (int64_t r = 0; r < h; r++)
        for (int64_t k = 0; k < n; k++)
            o[r * cols + k] = e4m3_of(p[r * cols + k] / d);
}

void rlsync_fp8_quantize(const float *x, int64_t rows, int64_t cols, int64_t b0, int64_t b1, uint8_t *q,
                         float *scale) {
    const int64_t whole = cols / BLOCK, part = cols % BLOCK, bcols = whole + (part > 0);
    for (int64_t br = b0; br < b1; br++) {
        const float *band = x + br * BLOCK * cols;
        uint8_t *out = q + br * BLOCK * cols;
        const int64_t h = BAND_ROWS(rows, br);
        for (int64_t g0 = 0; g0 < whole; g0 += GROUP) {
            const int64_t g1 = g0 + GROUP < whole ? g0 + GROUP : whole;
            uint32_t amax[GROUP] = {0};
            float s[GROUP];
            for (int64_t r = 0; r < h; r++)
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
            for (int64_t r = 0; r < h; r++)
                for (int64_t j = g0; j < g1; j++)
                    quantize_run(band + r * cols + j * BLOCK, out + r * cols + j * BLOCK, s[j - g0]);
        }
        if (part > 0)
            quantize_edge(band + whole * BLOCK, out + whole * BLOCK, cols, h, part, scale + br * bcols + whole);
    }
}

#endif

/* The rows' whole blocks, then where cols % 128 != 0 their partial last block's `part` values (the right edge) in a
   loop of their own: no call inside the whole blocks' loop (one there made it 2 % slower, measured). */
#define DEQUANTIZE(NAME, T, CONVERT)                                                                               \
    INLINE void NAME##_run(const uint8_t *restrict p, T *restrict o, const float d) {                              \
        for (int k = 0; k < BLOCK; k++)                                                                            \
            o[k] = CONVERT(float_of_e4m3(p[k]) * d);                                                               \
    }                                                                                                              \
    OUTLINE void NAME##_part(const uint8_t *restrict p, T *restrict o, const float d, const int64_t n) {           \
        for (int64_t k = 0; k < n; k++)                                                                            \
            o[k] = CONVERT(float_of_e4m3(p[k]) * d);                                                               \
    }                                                                                                              \
    void NAME(const uint8_t *q, const float *scale, int64_t rows, int64_t cols, int64_t b0, int64_t b1, T *out) { \
        const int64_t whole = cols / BLOCK, part = cols % BLOCK, bcols = whole + (part > 0);                      \
        const int64_t end = b1 * BLOCK < rows ? b1 * BLOCK : rows;                                                 \
        for (int64_t r = b0 * BLOCK; r < end; r++) {                                                               \
            const float *s = scale + (r / BLOCK) * bcols;                                                          \
            for (int64_t j = 0; j < whole; j++)                                                                    \
                NAME##_run(q + r * cols + j * BLOCK, out + r * cols + j * BLOCK, s[j]);                            \
        }                                                                                                          \
        for (int64_t r = b0 * BLOCK; r < end && part > 0; r++)                                                     \
            NAME##_part(q + r * cols + whole * BLOCK, out + r * cols + whole * BLOCK,                              \
                        scale[(r / BLOCK) * bcols + whole], part);                                                 \
    }

#define AS_FLOAT(f) (f)
#if !FP8_VBMI
DEQUANTIZE(rlsync_fp8_dequantize_bf16, uint16_t, bf16_of)
#endif
#if !FP8_AVX512
DEQUANTIZE(rlsync_fp8_dequantize_f32, float, AS_FLOAT)
#endif


#if FP8_AVX512
/* ---- AVX-512 (F, BW, DQ, VL): the arithmetic above on 16 lanes. Measured beside the portable C in one process
   (one 1024 x 16384, 3072 x 4096 and 2048 x 8192, 2 threads, a copy probe of 35 GB/s): the quantize 0.33 ns an
   element a thread against 0.49, the bf16 dequantize 0.16 against 0.32, the float32 one 0.30 against 0.32. */

#define SPLAT(v) _mm512_set1_epi32((int)(v))
/* Block columns the quantize reads a band by (128 rows x 512 float32: 256 KiB, in L2), the next group's rows
   prefetched (T2) while this one converts, so that its amax pass reads from cache and the memory's reads overlap
   the arithmetic: 0.33 to 0.36 ns an element a thread (four runs), against 0.34 to 0.38 with 2 block columns,
   0.36 to 0.41 with 8, 0.42 to 0.47 prefetching into L1 (T0), 0.46 with no prefetch and 64 (the portable C's). */
#define VGROUP 4

/* Streaming (non-temporal) stores for the whole blocks' outputs where every row of a block starts 64-byte aligned
   (the output is, and a row's bytes are a multiple of 64: always where cols are whole blocks): a regular store
   first reads the line it writes, so the bf16 dequantize's 3 bytes an element of traffic were 5. The quantize's
   e4m3 0.33 ns an element against 0.39 stored regularly, the bf16 dequantize 0.16 against 0.31. A partial block
   column's masked stores are regular ones. An sfence before returning orders them before the caller's next
   access. */
#define STREAM_OK(p, cols, size) (((uintptr_t)(p) & 63) == 0 && ((cols) * (size)) % 64 == 0)

/* A partial block column's lanes, n < 128 values a row: 16 a vector, the vectors past n all off. Computed once a
   call (not per row or element); returns the vectors that hold any lane, (n + 15) / 16. */
INLINE int edge_masks(int64_t n, __mmask16 m[8]) {
    for (int k = 0; k < 8; k++) {
        const int64_t left = n - 16 * k;
        m[k] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
    }
    return (int)((n + 15) / 16);
}

INLINE void store64(void *p, __m512i v, int stream) {
    if (stream)
        _mm512_stream_si512((__m512i *)p, v);
    else
        _mm512_storeu_si512(p, v);
}

/* e4m3_of on 16 lanes, every path: the conversions alone and the blocks whose scale is not a normal float. The
   round-to-even bit of the normal path as a masked add (one op fewer than its shift and mask). */
INLINE __m512i e4m3_of_v(__m512 y) {
    const __m512i u = _mm512_castps_si512(y);
    const __m512i a = _mm512_and_si512(u, SPLAT(0x7FFFFFFF));
    const __m512i small = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(SPLAT(141u << 23)))),
        SPLAT(141u << 23));
    const __m512i t = _mm512_add_epi32(a, SPLAT(0xC407FFFFu)); /* a + ((7 - 127) << 23) + 0x7FFFF */
    __m512i r = _mm512_srli_epi32(_mm512_mask_add_epi32(t, _mm512_test_epi32_mask(a, SPLAT(1u << 20)), t, SPLAT(1)),
                                  20);
    r = _mm512_min_epu32(r, SPLAT(0x7E)); /* where the normal path is kept, 0x7F only from [464, 480) */
    r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epu32_mask(a, SPLAT(121u << 23)), small);
    r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epu32_mask(a, SPLAT(1087u << 20)), SPLAT(0x7E));
    r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epu32_mask(a, SPLAT(0x7F800000)), SPLAT(0x7F));
    return _mm512_ternarylogic_epi32(r, _mm512_srli_epi32(u, 24), SPLAT(0x80), 0xF8); /* r | (u >> 24 & 0x80) */
}

/* Four vectors of bytes in dwords (each <= 0xFF) as 64 bytes in order: two unsigned-saturating packs leave them
   interleaved by 128-bit lane (lane L: 4 of each vector), one dword permute puts them back. */
INLINE __m512i pack_bytes(const __m512i r[4]) {
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i w = _mm512_packus_epi16(_mm512_packus_epi32(r[0], r[1]), _mm512_packus_epi32(r[2], r[3]));
    return _mm512_permutexvar_epi32(order, w);
}

/* One block's row of 128: over the scale (vdivps: a true IEEE divide), as e4m3, 2 x 64 bytes out. */
INLINE void quantize_run_v(const float *p, uint8_t *o, __m512 d, int stream) {
    for (int h = 0; h < 2; h++) {
        __m512i r[4];
        for (int k = 0; k < 4; k++)
            r[k] = e4m3_of_v(_mm512_div_ps(_mm512_loadu_ps(p + 64 * h + 16 * k), d));
        store64(o + 64 * h, pack_bytes(r), stream);
    }
}

/* The same where every quotient is finite and below 464 (a block whose scale is a normal float: |x| <= amax, so
   |x / scale| <= 448 (1 + 2^-23)): no saturation or NaN, and e4m3's subnormal results computed only for the 64
   values that hold one (a test of four masks): 9 vector ops for 16 values, the divide's among them, not 17. */
INLINE void quantize_run_bounded(const float *p, uint8_t *o, __m512 d, int stream) {
    for (int h = 0; h < 2; h++) {
        __m512i u[4], a[4], r[4];
        __mmask16 tiny[4];
        for (int k = 0; k < 4; k++) {
            u[k] = _mm512_castps_si512(_mm512_div_ps(_mm512_loadu_ps(p + 64 * h + 16 * k), d));
            a[k] = _mm512_and_si512(u[k], SPLAT(0x7FFFFFFF));
            const __m512i t = _mm512_add_epi32(a[k], SPLAT(0xC407FFFFu));
            r[k] = _mm512_srli_epi32(
                _mm512_mask_add_epi32(t, _mm512_test_epi32_mask(a[k], SPLAT(1u << 20)), t, SPLAT(1)), 20);
            tiny[k] = _mm512_cmplt_epu32_mask(a[k], SPLAT(121u << 23));
        }
        if (__builtin_expect((tiny[0] | tiny[1] | tiny[2] | tiny[3]) != 0, 0))
            for (int k = 0; k < 4; k++) {
                const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(a[k]), _mm512_castsi512_ps(SPLAT(141u << 23)));
                const __m512i small = _mm512_sub_epi32(_mm512_castps_si512(sum), SPLAT(141u << 23));
                r[k] = _mm512_mask_mov_epi32(r[k], tiny[k], small);
            }
        for (int k = 0; k < 4; k++)
            r[k] = _mm512_ternarylogic_epi32(r[k], _mm512_srli_epi32(u[k], 24), SPLAT(0x80), 0xF8);
        store64(o + 64 * h, pack_bytes(r), stream);
    }
}

/* A partial last block column of a band of h rows (masked loads and stores, the lanes `m`, `vectors` of them): its
   amax (the masked-off lanes read as 0, as the reference's padding), scale and values, by the general conversion. */
OUTLINE void quantize_edge(const float *p, uint8_t *o, int64_t cols, int64_t h, const __mmask16 m[8], int vectors,
                           float *s) {
    __m512i amax = _mm512_setzero_si512();
    for (int64_t r = 0; r < h; r++)
        for (int k = 0; k < vectors; k++)
            amax = _mm512_max_epu32(
                amax, _mm512_and_si512(_mm512_maskz_loadu_epi32(m[k], p + r * cols + 16 * k), SPLAT(0x7FFFFFFF)));
    const float scale = *s = scale_of(_mm512_reduce_max_epu32(amax));
    const __m512 d = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < h; r++)
        for (int k = 0; k < vectors; k++) {
            const __m512 y = _mm512_div_ps(_mm512_maskz_loadu_ps(m[k], p + r * cols + 16 * k), d);
            _mm512_mask_cvtepi32_storeu_epi8(o + r * cols + 16 * k, m[k], e4m3_of_v(y));
        }
}

/* A band's whole block columns, h of its rows (inlined twice: h the constant 128 for every band but a partial last
   one, so that whole blocks run the loops they ran before), its scales into `s`; `after` the next band (NULL: none
   to prefetch). */
INLINE void quantize_band(const float *band, uint8_t *out, float *s, int64_t cols, int64_t whole, int64_t h,
                          const float *after, int stream) {
    for (int64_t g0 = 0; g0 < whole; g0 += VGROUP) {
        const int64_t n = g0 + VGROUP < whole ? VGROUP : whole - g0;
        __m512i amax[VGROUP];
        __m512 d[VGROUP];
        int bounded[VGROUP];
        for (int64_t j = 0; j < n; j++)
            amax[j] = _mm512_setzero_si512();
        for (int64_t r = 0; r < h; r++)
            for (int64_t j = 0; j < n; j++) {
                const float *p = band + r * cols + (g0 + j) * BLOCK;
                __m512i m = amax[j];
                for (int k = 0; k < BLOCK; k += 16)
                    m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_loadu_si512(p + k), SPLAT(0x7FFFFFFF)));
                amax[j] = m;
            }
        for (int64_t j = 0; j < n; j++) {
            const uint32_t bits = _mm512_reduce_max_epu32(amax[j]);
            const float scale = scale_of(bits);
            s[g0 + j] = scale;
            d[j] = _mm512_set1_ps(scale);
            bounded[j] = bits < UINT32_C(0x7F800000) && scale >= 0x1p-126f; /* finite amax, a normal scale */
        }
        /* the next group, this band's or the next band's first: its rows fetched as this group's convert, one
           prefetch a line */
        const int64_t g1 = g0 + n, at_next = g1 < whole ? g1 : 0;
        const float *next = g1 < whole ? band + g1 * BLOCK : after;
        const int64_t next_n = at_next + VGROUP < whole ? VGROUP : whole - at_next;
        for (int64_t r = 0; r < h; r++) {
            for (int64_t j = 0; j < n; j++) {
                const int64_t at = r * cols + (g0 + j) * BLOCK;
                if (bounded[j])
                    quantize_run_bounded(band + at, out + at, d[j], stream);
                else
                    quantize_run_v(band + at, out + at, d[j], stream);
            }
            if (next != NULL)
                for (int64_t k = 0; k < next_n * BLOCK; k += 16)
                    _mm_prefetch((const char *)(next + r * cols + k), _MM_HINT_T2);
        }
    }
}

void rlsync_fp8_quantize(const float *x, int64_t rows, int64_t cols, int64_t b0, int64_t b1, uint8_t *q,
                         float *scale) {
    const int64_t whole = cols / BLOCK, part = cols % BLOCK, bcols = whole + (part > 0);
    const int stream = STREAM_OK(q, cols, 1);
    __mmask16 edge[8];
    const int vectors = edge_masks(part, edge);
    for (int64_t br = b0; br < b1; br++) {
        const float *band = x + br * BLOCK * cols;
        uint8_t *out = q + br * BLOCK * cols;
        const int64_t h = BAND_ROWS(rows, br);
        /* the next band within [b0, b1) to prefetch, where whole (a partial last one has fewer rows than this) */
        const float *after = br + 1 < b1 && BAND_ROWS(rows, br + 1) == BLOCK ? band + BLOCK * cols : NULL;
        if (h == BLOCK)
            quantize_band(band, out, scale + br * bcols, cols, whole, BLOCK, after, stream);
        else
            quantize_band(band, out, scale + br * bcols, cols, whole, h, after, stream);
    }
    /* the partial last block column after every band's whole ones: no call inside the whole blocks' loops (a call
       there made them 1.5 to 3 % slower, measured: no zmm register survives a call) */
    for (int64_t br = b0; br < b1 && part > 0; br++)
        quantize_edge(x + br * BLOCK * cols + whole * BLOCK, q + br * BLOCK * cols + whole * BLOCK, cols,
                      BAND_ROWS(rows, br), edge, vectors, scale + br * bcols + whole);
    if (stream)
        _mm_sfence();
}

/* float_of_e4m3 on 16 lanes of bytes in dwords. */
INLINE __m512 float_of_e4m3_v(__m512i b) {
    const __m512i m = _mm512_and_si512(b, SPLAT(0x7F));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, SPLAT(0x80)), 24);
    const __m512i sub = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0x1p-9f)));
    __m512i r = _mm512_add_epi32(_mm512_slli_epi32(m, 20), SPLAT(120u << 23));
    r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epu32_mask(m, SPLAT(8)), sub);
    r = _mm512_mask_mov_epi32(r, _mm512_cmpeq_epu32_mask(m, SPLAT(0x7F)), SPLAT(0x7FF00000));
    return _mm512_castsi512_ps(_mm512_or_si512(r, sign));
}

/* A partial last block column's rows [r0, r1) (n < 128 values a row from column `at`, block column at / 128),
   its lanes loaded and stored under masks computed once; a function of its own, so that the whole blocks' loop
   compiles as it did before partial blocks (the edge's loop inside the caller: it ran 2 to 4 % slower). */
OUTLINE void dequantize_f32_edge(const uint8_t *q, const float *scale, int64_t cols, int64_t bcols, int64_t at,
                                 int64_t n, int64_t r0, int64_t r1, float *out) {
    __mmask16 edge[8];
    const int vectors = edge_masks(n, edge);
    for (int64_t r = r0; r < r1; r++) {
        const __m512 d = _mm512_set1_ps(scale[(r / BLOCK) * bcols + at / BLOCK]);
        const uint8_t *p = q + r * cols + at;
        float *o = out + r * cols + at;
        for (int k = 0; k < vectors; k++) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(edge[k], p + 16 * k));
            _mm512_mask_storeu_ps(o + 16 * k, edge[k], _mm512_mul_ps(float_of_e4m3_v(b), d));
        }
    }
}

void rlsync_fp8_dequantize_f32(const uint8_t *q, const float *scale, int64_t rows, int64_t cols, int64_t b0,
                               int64_t b1, float *out) {
    const int64_t whole = cols / BLOCK, part = cols % BLOCK, bcols = whole + (part > 0);
    const int64_t end = b1 * BLOCK < rows ? b1 * BLOCK : rows;
    const int stream = STREAM_OK(out, cols, 4);
    for (int64_t r = b0 * BLOCK; r < end; r++) {
        const float *s = scale + (r / BLOCK) * bcols;
        for (int64_t j = 0; j < whole; j++) {
            const __m512 d = _mm512_set1_ps(s[j]);
            const uint8_t *p = q + r * cols + j * BLOCK;
            float *o = out + r * cols + j * BLOCK;
            for (int k = 0; k < BLOCK; k += 16) {
                const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + k)));
                store64(o + k, _mm512_castps_si512(_mm512_mul_ps(float_of_e4m3_v(b), d)), stream);
            }
        }
    }
    if (part > 0)
        dequantize_f32_edge(q, scale, cols, bcols, whole * BLOCK, part, b0 * BLOCK, end, out);
    if (stream)
        _mm_sfence();
}

#if FP8_VBMI
/* bf16_of on 16 lanes. */
INLINE __m512i bf16_of_v(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), SPLAT(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, SPLAT(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, SPLAT(0x7FFFFFFF)), SPLAT(0x7F800000));
    return _mm512_mask_mov_epi32(r, nan, SPLAT(0xFFFF));
}

/* The bf16 dequantize as a lookup: a block has one scale, so its 256 possible e4m3 bytes have 256 bf16 results,
   computed once a block (256 conversions for 16384 values, by the same arithmetic) as two 256-byte tables (the
   results' low and high bytes), looked up 64 bytes at a time by VBMI byte permutes over each table's two
   128-byte halves, chosen by the byte's top bit. */
typedef struct {
    __m512i lo[4], hi[4];
} table_t;

INLINE void table_of(float d, table_t *t) {
    const __m512 dv = _mm512_set1_ps(d);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    uint8_t lo[256] __attribute__((aligned(64))), hi[256] __attribute__((aligned(64)));
    for (int b = 0; b < 256; b += 16) {
        const __m512i v = bf16_of_v(_mm512_mul_ps(float_of_e4m3_v(_mm512_add_epi32(SPLAT(b), lanes)), dv));
        _mm_store_si128((__m128i *)(lo + b), _mm512_cvtepi32_epi8(v));
        _mm_store_si128((__m128i *)(hi + b), _mm512_cvtepi32_epi8(_mm512_srli_epi32(v, 8)));
    }
    for (int k = 0; k < 4; k++) {
        t->lo[k] = _mm512_load_si512(lo + 64 * k);
        t->hi[k] = _mm512_load_si512(hi + 64 * k);
    }
}

/* 64 e4m3 bytes as 64 bf16 (128 bytes) from a block's table, `r[0]` the first 32 and `r[1]` the rest. The bytes
   are first reordered (lane L: bytes 8L to 8L + 7, then 32 + 8L to 32 + 8L + 7) so that the in-lane interleave of
   the low and high bytes (unpacklo, unpackhi) leaves the 64 results in order. */
INLINE void looked_up(__m512i bytes, const table_t *t, __m512i order, __m512i r[2]) {
    const __m512i idx = _mm512_permutexvar_epi8(order, bytes);
    const __mmask64 top = _mm512_movepi8_mask(idx);
    const __m512i lo = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(t->lo[0], idx, t->lo[1]),
                                              _mm512_permutex2var_epi8(t->lo[2], idx, t->lo[3]));
    const __m512i hi = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(t->hi[0], idx, t->hi[1]),
                                              _mm512_permutex2var_epi8(t->hi[2], idx, t->hi[3]));
    r[0] = _mm512_unpacklo_epi8(lo, hi);
    r[1] = _mm512_unpackhi_epi8(lo, hi);
}

INLINE void lookup64(const uint8_t *p, uint16_t *o, const table_t *t, __m512i order, int stream) {
    __m512i r[2];
    looked_up(_mm512_loadu_si512(p), t, order, r);
    store64(o, r[0], stream);
    store64(o + 32, r[1], stream);
}

/* lookup64 of a partial block column's first bytes of 64, those of mask `m`: loaded and stored under it. */
INLINE void lookup_edge(const uint8_t *p, uint16_t *o, const table_t *t, __m512i order, __mmask64 m) {
    __m512i r[2];
    looked_up(_mm512_maskz_loadu_epi8(m, p), t, order, r);
    _mm512_mask_storeu_epi16(o, (__mmask32)m, r[0]);
    _mm512_mask_storeu_epi16(o + 32, (__mmask32)(m >> 32), r[1]);
}

/* A block column at a time down its 128 rows (the tables stay in registers), fewer in a partial last block row;
   a partial last block column through lookup_edge, its two 64-byte halves' masks computed once. */
void rlsync_fp8_dequantize_bf16(const uint8_t *q, const float *scale, int64_t rows, int64_t cols, int64_t b0,
                                int64_t b1, uint16_t *out) {
    const int64_t whole = cols / BLOCK, part = cols % BLOCK, bcols = whole + (part > 0);
    const int stream = STREAM_OK(out, cols, 2);
    const __mmask64 first = part >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << part) - 1;
    const __mmask64 second = part > 64 ? ((__mmask64)1 << (part - 64)) - 1 : 0;
    const __m512i order = _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 31, 30, 29, 28, 27, 26, 25, 24, 55, 54,
                                          53, 52, 51, 50, 49, 48, 23, 22, 21, 20, 19, 18, 17, 16, 47, 46, 45, 44, 43,
                                          42, 41, 40, 15, 14, 13, 12, 11, 10, 9, 8, 39, 38, 37, 36, 35, 34, 33, 32, 7,
                                          6, 5, 4, 3, 2, 1, 0);
    for (int64_t br = b0; br < b1; br++) {
        const int64_t r1 = br * BLOCK + BAND_ROWS(rows, br);
        for (int64_t j = 0; j < whole; j++) {
            table_t t;
            table_of(scale[br * bcols + j], &t);
            for (int64_t r = br * BLOCK; r < r1; r++) {
                const int64_t at = r * cols + j * BLOCK;
                lookup64(q + at, out + at, &t, order, stream);
                lookup64(q + at + 64, out + at + 64, &t, order, stream);
            }
        }
        if (part > 0) {
            table_t t;
            table_of(scale[br * bcols + whole], &t);
            for (int64_t r = br * BLOCK; r < r1; r++) {
                const int64_t at = r * cols + whole * BLOCK;
                lookup_edge(q + at, out + at, &t, order, first);
                if (second)
                    lookup_edge(q + at + 64, out + at + 64, &t, order, second);
            }
        }
    }
    if (stream)
        _mm_sfence();
}
#endif /* FP8_VBMI */
#endif /* FP8_AVX512 */

/* Which implementations this build holds: 1 the AVX-512 quantize and float32 dequantize, 2 the VBMI lookup of
   the bf16 dequantize (0: the portable C throughout). */
int rlsync_fp8_paths(void) {
    return FP8_AVX512 | FP8_VBMI << 1;
}

/* The conversions alone, element by element over n (the self-check and the tests): the AVX-512 ones where built,
   the scalar ones for the rest. */
void rlsync_fp8_from_float(const float *x, int64_t n, uint8_t *q) {
    int64_t i = 0;
#if FP8_AVX512
    for (; i + 16 <= n; i += 16)
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(e4m3_of_v(_mm512_loadu_ps(x + i))));
#endif
    for (; i < n; i++)
        q[i] = e4m3_of(x[i]);
}

void rlsync_fp8_to_float(const uint8_t *q, int64_t n, float *x) {
    int64_t i = 0;
#if FP8_AVX512
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(x + i, float_of_e4m3_v(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + i)))));
#endif
    for (; i < n; i++)
        x[i] = float_of_e4m3(q[i]);
}
