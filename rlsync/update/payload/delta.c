/* The delta's compaction of one chunk in one pass (rlsync/update/payload/native.py compiles and loads it).

   rlsync_delta_wW(new, old, n, base, pos, val), for n elements of W bytes (1, 2, 4, 8): compares `new` with
   `old` bit for bit (-0.0 against 0.0 and NaNs count as changed: bits are compared, never values); for each
   changed element writes base + its index as an int32 to pos[] and its bits to val[] (both sized by the caller
   for n elements), and its bits into old[]; returns the count. With pos == NULL it counts and copies only (a
   bucket already going whole). No mask in memory, no second pass, positions ascending.

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

#define EXPORT(W)                                                                                                  \
    int64_t rlsync_delta_w##W(const void *new_, void *old_, int64_t n, int64_t base, int32_t *pos, void *val) {   \
        return compact((const unsigned char *)new_, (unsigned char *)old_, n, base, pos, (unsigned char *)val, W); \
    }

EXPORT(1)
EXPORT(2)
EXPORT(4)
EXPORT(8)
