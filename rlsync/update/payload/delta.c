/* The delta's compaction of one chunk in one pass, and its apply (rlsync/update/payload/native.py compiles and
   loads it).

   rlsync_delta_wW(new, old, n, base, pos, val, shift, lines), for n elements of W bytes (1, 2, 4, 8): compares
   `new` with `old` bit for bit (-0.0 against 0.0 and NaNs count as changed: bits are compared, never values);
   for each changed element writes base + its index as an int32 to pos[] and its bits to val[] (both sized by the
   caller for n elements), and its bits into old[]; returns the count. With pos == NULL it counts and copies only
   (a bucket already going whole). No mask in memory, no second pass, positions ascending. Where `lines` is not
   NULL, lines[0..2] receive how many memory lines of 2^shift bytes the changed elements fall in (counted from
   the bucket's start: the delta's floor, rlsync/update/payload/delta.py), the first one's and the last one's
   (a line a chunk shares with the next is then counted once by the caller).

   rlsync_delta_f32_bf16(new, old, ...): the same for float32 `new` against bfloat16 `old`, each element cast as
   torch casts float32 to bfloat16 on a CPU (round to nearest even, every NaN 0xFFFF) a stage at a time into a
   buffer in L1, then compacted from there (with AVX-512 the whole runs in registers, the stage for the tail): the
   trainer's fp32 weights read once, no cast into memory first.

   rlsync_scatter_wW(dst, pos, val, n, origin): the apply, dst[pos[i] - origin] = val[i] for n positions
   (ascending, as the compaction wrote them).

   64 8-byte words (512 bytes) at a time: XOR-ed and OR-ed together first, so an unchanged run costs a few
   instructions a word; in a changed run a bit per changed word (a vectorised compare to bytes, packed to bits
   by a multiply: at 1 % changed nearly every run has a change, and a bit at a time was most of the pass),
   whose words are then visited by their set bits, each word's lanes compared without a branch (a changed
   element at a random place is a mispredicted branch wherever one depends on it: about 5 ns each). All loads
   and stores go through memcpy of a constant size (one instruction each: no strict-aliasing or alignment
   assumption, so any element offset into a tensor works); the elements after the last whole run of words one
   by one, the same way. The byte-to-bit packing assumes little-endian words; elsewhere a bit at a time.

   Where the build's -march has AVX-512 (F, BW, VBMI2) widths 2 and 4 take vectors instead (compact_w2, _w4: a
   vector's changes compressed in registers, no loop per changed word) and rlsync_delta_f32_bf16 casts in registers
   (no stage in memory): on this project's AMD EPYC (Zen 4), one thread, 1 Mi chunks, float32 against bf16, 0.23
   ns an element at 1 to 18 % changed against 0.33 to 0.97 ns for the portable C. rlsync_delta_paths() says which
   this build holds; the portable C stays the fallback and the reference. */

#include <stdint.h>
#include <string.h>

/* The AVX-512 compaction of 2- and 4-byte elements where this build's -march has it (VBMI2's 16-bit compress);
   RLSYNC_DELTA_PORTABLE forces the portable C (the tests build both, to check both). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI2__) && !defined(RLSYNC_DELTA_PORTABLE)
#define DELTA_AVX512 1
#include <immintrin.h>
#else
#define DELTA_AVX512 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define INLINE static inline __attribute__((always_inline))
#define LOWEST_BIT(m) __builtin_ctzll(m)
#else
#define INLINE static inline
static int LOWEST_BIT(uint64_t m) {
    int i = 0;
    while (!(m & 1)) m >>= 1, i++;
    return i;
}
#endif

#define WORD 8
#define RUN 64 /* words compared before any is looked at alone: one bit each in a uint64_t */

INLINE uint64_t word(const unsigned char *p, int64_t w) {
    uint64_t x;
    memcpy(&x, p + w * WORD, WORD);
    return x;
}

/* The elements [first, first + k): each changed one's position and bits appended (written unconditionally,
   kept by advancing the count: pos[] and val[] hold n), then all k copied into old. */
INLINE int64_t lanes(const unsigned char *a, unsigned char *b, int64_t first, int64_t k, int64_t base, int32_t *pos,
                     unsigned char *val, int64_t count, const int64_t width) {
    for (int64_t i = first; i < first + k; i++) {
        int changed = memcmp(a + i * width, b + i * width, width) != 0;
        if (pos) {
            pos[count] = (int32_t)(base + i);
            memcpy(val + count * width, a + i * width, width);
        }
        count += changed;
    }
    memcpy(b + first * width, a + first * width, k * width);
    return count;
}

#if DELTA_AVX512
/* The AVX-512 compaction of width 2 and 4: the same 64-word runs, XOR-ed and OR-ed first; in a changed run each
   vector's lanes (32 of 2 bytes, 16 of 4) compared to a mask, the changed ones' values compressed in a register
   then stored whole (the compress-to-memory form is microcoded on Zen 4, slow), their positions (base + index)
   compressed alike from an iota, the count advanced by the mask's popcount, and `old` written by a store masked
   to the changed lanes (the lines no change falls in stay clean). No branch on a vector's mask: at 1 % changed a
   quarter of the vectors hold one, a branch on it mispredicted at random. A whole vector's stores at the count
   stay within n (the count is at most the vector's first index, pos[] and val[] hold n); the last, partial
   vector's loads are masked to the elements left and its stores to the changed ones. */

INLINE int64_t vector_w2(__m512i x, __m512i y, __mmask32 valid, unsigned char *b, int32_t at, int32_t *pos,
                         unsigned char *val, int64_t count, const int tail) {
    const __mmask32 m = _mm512_mask_cmpneq_epi16_mask(valid, x, y);
    _mm512_mask_storeu_epi16(b, m, x);
    if (pos) {
        const __m512i v = _mm512_maskz_compress_epi16(m, x), first = _mm512_set1_epi32(at);
        const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __mmask16 lo = (__mmask16)m, hi = (__mmask16)(m >> 16);
        const int n_lo = __builtin_popcount(lo), n_hi = __builtin_popcount(hi);
        const __m512i p_lo = _mm512_maskz_compress_epi32(lo, _mm512_add_epi32(first, iota));
        const __m512i p_hi = _mm512_maskz_compress_epi32(hi, _mm512_add_epi32(first, _mm512_add_epi32(iota,
                                                                               _mm512_set1_epi32(16))));
        if (tail) {
            _mm512_mask_storeu_epi16(val + count * 2, (__mmask32)((UINT64_C(1) << (n_lo + n_hi)) - 1), v);
            _mm512_mask_storeu_epi32(pos + count, (__mmask16)((1u << n_lo) - 1), p_lo);
            _mm512_mask_storeu_epi32(pos + count + n_lo, (__mmask16)((1u << n_hi) - 1), p_hi);
        } else {
            _mm512_storeu_si512(val + count * 2, v);
            _mm512_storeu_si512(pos + count, p_lo);
            _mm512_storeu_si512(pos + count + n_lo, p_hi);
        }
    }
    return count + __builtin_popcount(m);
}

INLINE int64_t vector_w4(__m512i x, __m512i y, __mmask16 valid, unsigned char *b, int32_t at, int32_t *pos,
                         unsigned char *val, int64_t count, const int tail) {
    const __mmask16 m = _mm512_mask_cmpneq_epi32_mask(valid, x, y);
    _mm512_mask_storeu_epi32(b, m, x);
    if (pos) {
        const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i v = _mm512_maskz_compress_epi32(m, x);
        const __m512i p = _mm512_maskz_compress_epi32(m, _mm512_add_epi32(_mm512_set1_epi32(at), iota));
        const __mmask16 kept = (__mmask16)((1u << __builtin_popcount(m)) - 1);
        if (tail) {
            _mm512_mask_storeu_epi32(val + count * 4, kept, v);
            _mm512_mask_storeu_epi32(pos + count, kept, p);
        } else {
            _mm512_storeu_si512(val + count * 4, v);
            _mm512_storeu_si512(pos + count, p);
        }
    }
    return count + __builtin_popcount(m);
}

#define VECTORS (RUN * WORD / 64) /* a run's 64-byte vectors */

/* One width's compaction: whole runs (the pre-check, then their vectors), whole vectors, the masked last one. */
#define COMPACT_AVX512(W, LANES, MASK, FULL, LOAD)                                                                \
    INLINE int64_t compact_w##W(const unsigned char *a, unsigned char *b, int64_t n, int64_t base, int32_t *pos,  \
                                unsigned char *val) {                                                             \
        int64_t count = 0, i = 0;                                                                                 \
        for (; i + VECTORS * LANES <= n; i += VECTORS * LANES) {                                                  \
            __m512i x[VECTORS], y[VECTORS], diff = _mm512_setzero_si512();                                        \
            for (int j = 0; j < VECTORS; j++) {                                                                   \
                x[j] = _mm512_loadu_si512(a + (i + j * LANES) * W);                                               \
                y[j] = _mm512_loadu_si512(b + (i + j * LANES) * W);                                               \
                diff = _mm512_or_si512(diff, _mm512_xor_si512(x[j], y[j]));                                       \
            }                                                                                                     \
            if (!_mm512_test_epi64_mask(diff, diff))                                                              \
                continue;                                                                                         \
            for (int j = 0; j < VECTORS; j++)                                                                     \
                count = vector_w##W(x[j], y[j], FULL, b + (i + j * LANES) * W, (int32_t)(base + i + j * LANES),   \
                                    pos, val, count, 0);                                                          \
        }                                                                                                         \
        for (; i + LANES <= n; i += LANES)                                                                        \
            count = vector_w##W(_mm512_loadu_si512(a + i * W), _mm512_loadu_si512(b + i * W), FULL, b + i * W,    \
                                (int32_t)(base + i), pos, val, count, 0);                                         \
        if (i < n) {                                                                                              \
            const MASK left = (MASK)((UINT64_C(1) << (n - i)) - 1);                                               \
            count = vector_w##W(LOAD(left, a + i * W), LOAD(left, b + i * W), left, b + i * W,                    \
                                (int32_t)(base + i), pos, val, count, 1);                                         \
        }                                                                                                         \
        return count;                                                                                             \
    }

COMPACT_AVX512(2, 32, __mmask32, 0xFFFFFFFFu, _mm512_maskz_loadu_epi16)
COMPACT_AVX512(4, 16, __mmask16, 0xFFFF, _mm512_maskz_loadu_epi32)

/* 32 float32 at p cast to bfloat16 as bf16_of (below) does, in a register: each 16's lanes rounded, NaNs to
   0xFFFF, then the two halves' low 16 bits packed in order. */
INLINE __m512i bf16_of_32(const unsigned char *p) {
    const __m512i idx = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26,
                                         24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    __m512i half[2];
    for (int h = 0; h < 2; h++) {
        const __m512i u = _mm512_loadu_si512(p + h * 64);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
        const __mmask16 nan =
            _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
        half[h] = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0xFFFF));
    }
    return _mm512_permutex2var_epi16(half[0], idx, half[1]);
}

/* rlsync_delta_f32_bf16's whole runs: the cast in registers, compared and compacted as compact_w2 does (no
   stage in memory); returns the elements done (the rest go through the stage). */
INLINE int64_t cast_runs(const unsigned char *src, unsigned char *b, int64_t n, int64_t base, int32_t *pos,
                         unsigned char *val, int64_t *count_) {
    int64_t count = 0, i = 0;
    for (; i + VECTORS * 32 <= n; i += VECTORS * 32) {
        __m512i x[VECTORS], y[VECTORS], diff = _mm512_setzero_si512();
        for (int j = 0; j < VECTORS; j++) {
            x[j] = bf16_of_32(src + (i + j * 32) * 4);
            y[j] = _mm512_loadu_si512(b + (i + j * 32) * 2);
            diff = _mm512_or_si512(diff, _mm512_xor_si512(x[j], y[j]));
        }
        if (!_mm512_test_epi64_mask(diff, diff))
            continue;
        for (int j = 0; j < VECTORS; j++)
            count = vector_w2(x[j], y[j], 0xFFFFFFFFu, b + (i + j * 32) * 2, (int32_t)(base + i + j * 32), pos, val,
                              count, 0);
    }
    *count_ = count;
    return i;
}
#endif

INLINE int64_t compact(const unsigned char *a, unsigned char *b, int64_t n, int64_t base, int32_t *pos,
                       unsigned char *val, const int64_t width) {
#if DELTA_AVX512
    if (width == 2)
        return compact_w2(a, b, n, base, pos, val);
    if (width == 4)
        return compact_w4(a, b, n, base, pos, val);
#endif
    const int64_t per_word = WORD / width;
    const int64_t words = n / per_word;
    int64_t count = 0, w = 0;
    for (; w + RUN <= words; w += RUN) {
        uint64_t diff = 0;
        for (int j = 0; j < RUN; j++)
            diff |= word(a, w + j) ^ word(b, w + j);
        if (!diff)
            continue;
        uint64_t changed = 0; /* bit j: word w + j differs */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        unsigned char ne[RUN]; /* a byte per word first (vectorised), then 8 bytes to 8 bits by one multiply */
        for (int j = 0; j < RUN; j++)
            ne[j] = word(a, w + j) != word(b, w + j);
        for (int g = 0; g < RUN / 8; g++) {
            uint64_t x;
            memcpy(&x, ne + 8 * g, 8);
            changed |= ((x * 0x0102040810204080ULL) >> 56) << (8 * g); /* byte j's 0 or 1 to bit 56 + j */
        }
#else
        for (int j = 0; j < RUN; j++)
            changed |= (uint64_t)(word(a, w + j) != word(b, w + j)) << j;
#endif
        while (changed) {
            int j = LOWEST_BIT(changed);
            changed &= changed - 1;
            count = lanes(a, b, (w + j) * per_word, per_word, base, pos, val, count, width);
        }
    }
    for (int64_t i = w * per_word; i < n; i++) /* the tail: its changed elements one at a time */
        if (memcmp(a + i * width, b + i * width, width) != 0)
            count = lanes(a, b, i, 1, base, pos, val, count, width);
    return count;
}

/* The distinct lines of 2^shift bytes among `count` ascending positions of W-byte elements: counted by
   comparing each line with the one before (no branch: vectorised; the positions were just written, in cache). */
INLINE void count_lines(const int32_t *pos, int64_t count, const int64_t width, int shift, int64_t *lines) {
    if (!count) {
        lines[0] = 0, lines[1] = lines[2] = -1;
        return;
    }
    int64_t distinct = 1;
    for (int64_t i = 1; i < count; i++)
        distinct += ((int64_t)pos[i] * width) >> shift != ((int64_t)pos[i - 1] * width) >> shift;
    lines[0] = distinct;
    lines[1] = ((int64_t)pos[0] * width) >> shift;
    lines[2] = ((int64_t)pos[count - 1] * width) >> shift;
}

/* The apply: each position's element written from val[] (loads and stores of W bytes through memcpy, as above). */
INLINE void scatter(unsigned char *dst, const int32_t *pos, const unsigned char *val, int64_t n, int64_t origin,
                    const int64_t width) {
    for (int64_t i = 0; i < n; i++)
        memcpy(dst + ((int64_t)pos[i] - origin) * width, val + i * width, width);
}

/* torch's vectorised float32 -> bfloat16 cast on a CPU (ATen's cvtfp32_bf16): round to nearest even, NaN 0xFFFF. */
INLINE uint16_t bf16_of(uint32_t u) {
    uint32_t r = (u + UINT32_C(0x7FFF) + ((u >> 16) & 1)) >> 16;
    uint32_t is_nan = -(uint32_t)((u & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000));
    return (uint16_t)(r | is_nan);
}

#define STAGE 2048 /* elements cast at a time: 4 KiB of bf16 in L1 (2048 to 8192 measured alike) */

int64_t rlsync_delta_f32_bf16(const void *new_, void *old_, int64_t n, int64_t base, int32_t *pos, void *val, int shift,
                              int64_t *lines) {
    const unsigned char *src = (const unsigned char *)new_;
    unsigned char *old = (unsigned char *)old_, *out = (unsigned char *)val;
    unsigned char stage[STAGE * 2];
    int64_t count = 0, i = 0;
#if DELTA_AVX512
    i = cast_runs(src, old, n, base, pos, out, &count);
#endif
    for (; i < n; i += STAGE) {
        const int64_t k = n - i < STAGE ? n - i : STAGE;
        for (int64_t j = 0; j < k; j++) {
            uint32_t u;
            memcpy(&u, src + (i + j) * 4, 4);
            uint16_t b = bf16_of(u);
            memcpy(stage + j * 2, &b, 2);
        }
        count += compact(stage, old + i * 2, k, base + i, pos ? pos + count : NULL, pos ? out + count * 2 : NULL, 2);
    }
    if (pos && lines)
        count_lines(pos, count, 2, shift, lines);
    return count;
}

#define EXPORT(W)                                                                                                  \
    int64_t rlsync_delta_w##W(const void *new_, void *old_, int64_t n, int64_t base, int32_t *pos, void *val,     \
                              int shift, int64_t *lines) {                                                         \
        int64_t count =                                                                                            \
            compact((const unsigned char *)new_, (unsigned char *)old_, n, base, pos, (unsigned char *)val, W);    \
        if (pos && lines)                                                                                          \
            count_lines(pos, count, W, shift, lines);                                                              \
        return count;                                                                                              \
    }                                                                                                              \
    void rlsync_scatter_w##W(void *dst, const int32_t *pos, const void *val, int64_t n, int64_t origin) {         \
        scatter((unsigned char *)dst, pos, (const unsigned char *)val, n, origin, W);                              \
    }

EXPORT(1)
EXPORT(2)
EXPORT(4)
EXPORT(8)

/* Which compaction this build holds: 1 the AVX-512 one of widths 2 and 4, 0 the portable C throughout. */
int rlsync_delta_paths(void) {
    return DELTA_AVX512;
}
