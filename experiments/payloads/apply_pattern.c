/* What the delta's apply costs the memory, apart from rlsync: a scatter of bf16 values into a 600 MB buffer at
   positions chosen at random (ascending, as delta.c's compaction writes them), beside other ways over the same
   lines, on T threads (each a contiguous share of the positions, as the update's pieces):

     scatter      dst[pos[i]] = val[i]                      (delta.c's rlsync_scatter_w2)
     gather       sum += dst[pos[i]]: the same lines, read only
     permuted     the scatter in a scrambled order within windows of 256 positions (the prefetchers untrained)
     prefetchw    the scatter with a write prefetch 64 positions ahead
     read all     one load in every line of the buffer, in order: what streaming through it costs
     copy         float32 -> bf16 (truncated), 150 M elements: the memory's bandwidth as the copy probe sees it

   Each row: the median of 5 rounds after one warm-up, its bytes per second counted as the delta's floor counts
   them (each touched 64-byte line read and written; the read-only rows their lines once; the copy its 6 bytes an
   element) and its time over the read-all pass's. Results: README.md's "The apply's memory pattern".

     gcc -O3 -march=native -pthread experiments/payloads/apply_pattern.c -o /tmp/apply_pattern
     /tmp/apply_pattern 2            # threads */

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define N 300000000L /* bf16 elements: 600 MB, about half of Qwen3-0.6B's engine weights */
#define ROUNDS 5
#define WINDOW 256

enum { SCATTER, GATHER, PERMUTED, PREFETCHW, READ_ALL, COPY, WAYS };
static const char *NAMES[WAYS] = {"scatter", "gather", "permuted", "prefetchw", "read all", "copy"};

typedef struct {
    int way;
    uint16_t *dst;
    const int32_t *pos;
    const uint16_t *val;
    int64_t n, lo, hi; /* positions; the read-all and copy passes' element range */
    const float *src;
    uint16_t *out;
    uint64_t sum;
} Job;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void *work(void *arg) {
    Job *j = arg;
    uint16_t *d = j->dst;
    const int32_t *p = j->pos;
    const uint16_t *v = j->val;
    uint64_t sum = 0;
    switch (j->way) {
    case SCATTER:
        for (int64_t i = 0; i < j->n; i++) d[p[i]] = v[i];
        break;
    case GATHER:
        for (int64_t i = 0; i < j->n; i++) sum += d[p[i]];
        break;
    case PERMUTED: { /* an odd multiplier modulo a power of two visits every position of the window once */
        int64_t s = 0;
        for (; s + WINDOW <= j->n; s += WINDOW)
            for (int64_t q = 0; q < WINDOW; q++) {
                int64_t i = s + ((q * 2654435761u) & (WINDOW - 1));
                d[p[i]] = v[i];
            }
        for (; s < j->n; s++) d[p[s]] = v[s];
        break;
    }
    case PREFETCHW:
        for (int64_t i = 0; i < j->n; i++) {
            if (i + 64 < j->n) __builtin_prefetch(d + p[i + 64], 1, 0);
            d[p[i]] = v[i];
        }
        break;
    case READ_ALL:
        for (int64_t i = j->lo; i < j->hi; i += 32) sum += d[i];
        break;
    case COPY:
        for (int64_t i = j->lo; i < j->hi; i++) {
            uint32_t bits;
            memcpy(&bits, j->src + i, 4);
            j->out[i] = (uint16_t)(bits >> 16);
        }
        break;
    }
    j->sum = sum;
    return NULL;
}

static double run(int way, int threads, uint16_t *d, const int32_t *p, const uint16_t *v, int64_t k, const float *src,
                  uint16_t *out) {
    pthread_t th[64];
    Job jobs[64];
    int64_t span = way == COPY ? N / 2 : N;
    double t0 = now();
    for (int t = 0; t < threads; t++) {
        int64_t a = k * t / threads, b = k * (t + 1) / threads;
        jobs[t] = (Job){way, d, p + a, v + a, b - a, span * t / threads, span * (t + 1) / threads, src, out, 0};
        pthread_create(th + t, NULL, work, jobs + t);
    }
    for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
    return now() - t0;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    if (threads < 1 || threads > 64) return 2;
    const double shares[] = {0.001, 0.003, 0.01, 0.03, 0.1};
    uint16_t *d = aligned_alloc(64, N * 2), *out = aligned_alloc(64, N);
    float *src = aligned_alloc(64, N * 2);
    int32_t *p = malloc(sizeof(int32_t) * N / 9);
    uint16_t *v = malloc(2 * N / 9);
    memset(d, 1, N * 2);
    memset(out, 0, N);
    for (int64_t i = 0; i < N / 2; i++) src[i] = (float)i;
    for (int64_t i = 0; i < N / 9; i++) v[i] = 7;
    uint64_t state = 1;
    printf("%d threads, %ld bf16 elements (%.0f MB)\n", threads, N, N * 2 / 1e6);
    printf("| changed | lines | way | time, ms | GB/s as the floor counts | time / read all |\n|---|---|---|---|---|---|\n");
    for (size_t s = 0; s < sizeof shares / sizeof *shares; s++) {
        int64_t k = 0, lines = 0, last = -1;
        uint64_t cut = (uint64_t)(shares[s] * 18446744073709551615.0);
        for (int64_t i = 0; i < N; i++) { /* xorshift: each element changed with probability shares[s] */
            state ^= state << 13, state ^= state >> 7, state ^= state << 17;
            if (state < cut) p[k++] = (int32_t)i;
        }
        for (int64_t i = 0; i < k; i++)
            if (p[i] / 32 != last) lines++, last = p[i] / 32;
        double med[WAYS];
        for (int w = 0; w < WAYS; w++) {
            double t[ROUNDS + 1];
            for (int r = 0; r <= ROUNDS; r++) t[r] = run(w, threads, d, p, v, k, src, out);
            qsort(t + 1, ROUNDS, sizeof *t, by_value); /* t[0], the warm-up, left out */
            med[w] = t[1 + ROUNDS / 2];
        }
        for (int w = 0; w < WAYS; w++) {
            double bytes = w == GATHER ? lines * 64.0 : w == READ_ALL ? N * 2.0 : w == COPY ? N / 2 * 6.0 : lines * 128.0;
            printf("| %.1f %% | %.3f | %s | %.1f | %.1f | %.2f |\n", 100 * shares[s], lines / (N / 32.0), NAMES[w],
                   1e3 * med[w], bytes / med[w] / 1e9, med[w] / med[READ_ALL]);
        }
    }
    return d[1] == 0; /* the stores kept */
}
