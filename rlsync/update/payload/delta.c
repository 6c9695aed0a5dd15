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
   buffer in L1, then compacted from there: the trainer's fp32 weights read once, no cast into memory first.

   rlsync_scatter_wW(dst, pos, val, n, origin): the apply, dst[pos[i] - origin] = val[i] for n positions
   (ascending, as the compaction wrote them).

   64 8-byte words (512 bytes) at a time: XOR-ed and OR-ed together first, so an unchanged run costs a few
   instructions a word; in a changed run a bit per changed word (a vectorised compare to bytes, packed to bits
   by a multiply: at 1 % changed nearly every run has a change, and a bit at a time was most of the pass),
   whose words are then visited by their set bits, each word's lanes compared without a branch (a changed
   element at a random place is a mispredicted branch wherever one depends on it: about 5 ns each). All loads
   and stores go through memcpy of a constant size (one instruction each: no strict-aliasing or alignment
   assumption, so any element offset into a tensor works); the elements after the last whole run of words one
   by one, the same way. The byte-to-bit packing assumes little-endian words; elsewhere a bit at a time. */

#include <stdint.h>
#include <string.h>

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

INLINE int64_t compact(const unsigned char *a, unsigned char *b, int64_t n, int64_t base, int32_t *pos,
                       unsigned char *val, const int64_t width) {
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
    int64_t count = 0;
    for (int64_t i = 0; i < n; i += STAGE) {
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
