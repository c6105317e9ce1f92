/* Decode and verify attention for float32 that reads keys and values where they sit in the paged cache.
 *
 * For query token i of row b (at position p), head h: softmax over the visible context positions
 * c (c <= p, c < the row's length, c > p - window when there is one) of scale * (q . K[slot]),
 * weighting V[slot], where slot = slots[b, c]. Nothing is gathered or masked first.
 *
 * The time goes in reading the cache, not in arithmetic: at 32 rows the shipped target's keys and
 * values are ~26 MB a step, more than the L3 cache holds once the weights are in it. So a task
 * (one row's key/value heads, so that a position's keys are one contiguous run) first lists where
 * every key and value it reads sits, then prefetches them into L2 AHEAD chunks before it reads
 * them: a block table scatters blocks, which the hardware prefetchers cannot follow. Scores go to
 * a scratch row, in chunks of 16 positions aligned to absolute positions (16 dot products summed
 * in one tree, sum16); each query head then takes its maximum, its weights and their sum in one
 * pass, and sums the weighted values with its accumulators in registers (two banks, even and odd
 * positions, so that the adds do not wait on each other). The heads that share a key/value head
 * and all of a row's query tokens share the reads. A token's chunks and their order depend only on
 * its own visible range: a row alone and in a batch, or a token decoded alone and verified among a
 * draft's, give the same bits. Included by paged_attention.c (the call of its own) and decoder_layers.c
 * (a stage of the forward).
 */
#ifndef PAGED_ATTENTION_H
#define PAGED_ATTENTION_H
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec16_exp.h"

#define CHUNK 16
#define AHEAD 2       /* chunks prefetched before they are read */
#define MAX_VECTORS 8 /* head_dim up to 128 (paged_attention.py checks) */
#define LANES_FROM 12 /* query heads reading one chunk from which they share lanes: fewer, trees cost less */
#define TASK_LANES 64  /* query heads of one key/value head a task takes (at most 32 rows) */
#define MAX_ROWS_SCRATCH (16 << 20) /* bytes of scores a thread holds for a task's rows, past one row's */

#include "query_lanes.h" /* after CHUNK */

/* The 16 sums of 16 lanes each, as one vector: lane c holds the sum of v[c]'s lanes. A tree of
 * in-lane then cross-lane adds, where one reduction per vector costs about three times as much. */
static inline f32x16 sum16(const f32x16 v[CHUNK]) {
  f32x16 quads[4];
  for (int g = 0; g < 4; g++) {  /* each 128-bit quarter Q: the sums over Q of v[4g .. 4g+3] */
    const f32x16 *w = v + 4 * g;
    const f32x16 ab = f32x16_add(f32x16_interleave_lo(w[0], w[1]), f32x16_interleave_hi(w[0], w[1]));
    const f32x16 cd = f32x16_add(f32x16_interleave_lo(w[2], w[3]), f32x16_interleave_hi(w[2], w[3]));
    quads[g] = f32x16_add(f32x16_low_pairs(ab, cd), f32x16_high_pairs(ab, cd));
  }
  const f32x16 low = f32x16_add(f32x16_even_quarters(quads[0], quads[1]),
                                f32x16_odd_quarters(quads[0], quads[1]));
  const f32x16 high = f32x16_add(f32x16_even_quarters(quads[2], quads[3]),
                                 f32x16_odd_quarters(quads[2], quads[3]));
  return f32x16_add(f32x16_even_quarters(low, high), f32x16_odd_quarters(low, high));
}

/* The visible context of the token at position p: [start, end). */
static inline void visible(int64_t p, int64_t length, int64_t window, int64_t *start, int64_t *end) {
  *end = p + 1 < length ? p + 1 : length;
  *start = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

static inline int64_t round_up(int64_t c) { return c + (CHUNK - c % CHUNK) % CHUNK; }

/* The scores of one query head against 16 keys, as one vector. */
ALWAYS_INLINE f32x16 chunk_scores(const float *query, const float *const *k, int64_t offset, const int64_t vectors) {
  f32x16 raw[CHUNK];
  for (int c = 0; c < CHUNK; c++) {
    const float *key = k[c] + offset;
    f32x16 sum = f32x16_mul(f32x16_load(query), f32x16_load(key));
    for (int64_t x = 1; x < vectors; x++)
      sum = f32x16_fmadd(f32x16_load(query + 16 * x), f32x16_load(key + 16 * x), sum);
    raw[c] = sum;
  }
  return sum16(raw);
}

/* o = inverse * sum over n positions (a multiple of CHUNK) of w[c] * v[c]. Inlined with a constant
 * `vectors`, the accumulators live in registers. */
ALWAYS_INLINE void weighted_values(const float *w, const float *const *v, int64_t offset, int64_t n,
                                   const int64_t vectors, float inverse, float *o) {
  f32x16 even[MAX_VECTORS], odd[MAX_VECTORS];
  for (int64_t x = 0; x < vectors; x++) even[x] = odd[x] = f32x16_zero();
  for (int64_t c = 0; c < n; c += 2) {
    const f32x16 w0 = f32x16_broadcast(w[c]), w1 = f32x16_broadcast(w[c + 1]);
    for (int64_t x = 0; x < vectors; x++) {
      even[x] = f32x16_fmadd(w0, f32x16_load(v[c] + offset + 16 * x), even[x]);
      odd[x] = f32x16_fmadd(w1, f32x16_load(v[c + 1] + offset + 16 * x), odd[x]);
    }
  }
  for (int64_t x = 0; x < vectors; x++)
    f32x16_store(o + 16 * x, f32x16_mul(f32x16_add(even[x], odd[x]), f32x16_broadcast(inverse)));
}

static void weighted_values_any(const float *w, const float *const *v, int64_t offset, int64_t n, int64_t vectors,
                                float inverse, float *o) {
  switch (vectors) {  /* the head sizes models use, each with its accumulators in registers */
    case 1: weighted_values(w, v, offset, n, 1, inverse, o); break;
    case 2: weighted_values(w, v, offset, n, 2, inverse, o); break;
    case 4: weighted_values(w, v, offset, n, 4, inverse, o); break;
    case 8: weighted_values(w, v, offset, n, 8, inverse, o); break;
    default: weighted_values(w, v, offset, n, vectors, inverse, o);
  }
}

static f32x16 chunk_scores_any(const float *query, const float *const *k, int64_t offset, int64_t vectors) {
  switch (vectors) {  /* as weighted_values_any */
    case 1: return chunk_scores(query, k, offset, 1);
    case 2: return chunk_scores(query, k, offset, 2);
    case 4: return chunk_scores(query, k, offset, 4);
    case 8: return chunk_scores(query, k, offset, 8);
    default: return chunk_scores(query, k, offset, vectors);
  }
}

/* The first `lines` cache lines at each of 16 positions, into L2 (into L1 the prefetches stalled). */
static inline void prefetch(const float *const *at, int64_t lines) {
  for (int c = 0; c < CHUNK; c++)
    for (int64_t x = 0; x < lines; x++) __builtin_prefetch(at[c] + 16 * x, 0, 2);  /* to read, into L2 */
}

/* Where a row's chunks are: its tokens' visible ranges, the chunk-aligned span [lo, hi) they cover, and
 * where each position's keys and values of key/value head g0 sit (k[c - lo], v[c - lo]). */
struct row_reads {
  int64_t lo, hi, *start, *end;
  const float **k, **v;
  float *scores;  /* [(g * Q + i) * shared + r][span] of the task's heads g */
};

static void find_reads(struct row_reads *w, int64_t b, int64_t g0, const float *keys, const float *values,
                       const int64_t *slots, const int64_t *positions, const int64_t *lengths, int64_t Q, int64_t C,
                       int64_t kv_heads, int64_t D, int64_t window) {
  int64_t first = C, last = 0;
  for (int64_t i = 0; i < Q; i++) {
    visible(positions[b * Q + i], lengths[b], window, &w->start[i], &w->end[i]);
    first = w->start[i] < first ? w->start[i] : first;
    last = w->end[i] > last ? w->end[i] : last;
  }
  w->lo = first - first % CHUNK;
  w->hi = last < w->lo ? w->lo : round_up(last);
  for (int64_t c = w->lo; c < w->hi; c++) {  /* past the context: any slot, those lanes are masked */
    const int64_t at = (slots[b * C + (c < C ? c : C - 1)] * kv_heads + g0) * D;
    w->k[c - w->lo] = keys + at;
    w->v[c - w->lo] = values + at;
  }
}

/* The positions of chunk c0 token i sees. */
ALWAYS_INLINE mask16 seen_at(const struct row_reads *w, int64_t i, int64_t c0) {
  const i32x16 offset = i32x16_add(i32x16_lane_index(), i32x16_broadcast((int)(c0 - w->start[i])));
  return i32x16_at_least(offset, i32x16_zero()) & i32x16_less(offset, i32x16_broadcast((int)(w->end[i] - w->start[i])));
}

/* Query head j's 16 scores at chunk c0, -infinity where unseen. */
ALWAYS_INLINE void store_scores(const struct row_reads *w, int64_t j, int64_t c0, int64_t span, mask16 seen, f32x16 s) {
  f32x16_store(w->scores + j * span + c0 - w->lo, f32x16_select(seen, s, f32x16_broadcast(-INFINITY)));
}

/* Whether two rows read the same 16 positions at chunk c0 (a block both tables hold). */
static inline int same_chunk(const struct row_reads *a, const struct row_reads *b, int64_t c0) {
  for (int c = 0; c < CHUNK; c++)
    if (a->k[c0 - a->lo + c] != b->k[c0 - b->lo + c]) return 0;
  return 1;
}

/* The index of the nth row (from 0) in a set of rows. */
static inline int64_t nth_row(uint32_t rows, int64_t nth) {
  for (; nth > 0; nth--) rows &= rows - 1;
  return __builtin_ctz(rows);
}

/* qt [group][lane_sets][D][LANES]: lane l of set s holds query head l + 16 s of the rows in `sharing`
 * (rows b0 + n, in order; per row token i's heads of key/value head g0 + g, i major); unused lanes 0. */
static void transpose_queries(float *qt, const float *q, int64_t q_stride, int64_t b0, uint32_t sharing, int64_t Q,
                              int64_t shared, int64_t D, int64_t group, int64_t g0, int64_t lane_sets) {
  const int64_t per_head = Q * shared, lanes = __builtin_popcount(sharing) * per_head;
  for (int64_t g = 0; g < group; g++) {
    float *at = qt + g * lane_sets * D * LANES;
    for (int64_t x = 0; x < lane_sets * D * LANES; x++) at[x] = 0.0f;
    for (int64_t l = 0; l < lanes; l++) {
      const int64_t n = nth_row(sharing, l / per_head), i = l % per_head / shared, r = l % shared;
      const float *query = q + ((b0 + n) * Q + i) * q_stride + ((g0 + g) * shared + r) * D;
      float *set = at + l / LANES * D * LANES;
      for (int64_t d = 0; d < D; d++) set[d * LANES + l % LANES] = query[d];
    }
  }
}

/* q: token t = b * Q + i at q + t * q_stride, head h at + h * D. keys, values: [slots, kv_heads, D].
 * slots: [B, C]; positions: [B, Q]; lengths: [B]; out: [B, Q, heads, D]. D % 16 == 0, D <= 128.
 * Run by every thread of the parallel region it is called in (an `omp for`, ending in a barrier). */
static void paged_attention_in_team(const float *q, int64_t q_stride, const float *keys, const float *values,
                                    const int64_t *slots, const int64_t *positions, const int64_t *lengths,
                                    int64_t B, int64_t Q, int64_t C, int64_t heads, int64_t kv_heads, int64_t D,
                                    int64_t window, float scale, float *out) {
  const int threads = omp_get_num_threads();
  const int64_t shared = heads / kv_heads, vectors = D / 16, per_head = Q * shared;
  const int64_t span = C + 2 * CHUNK;  /* the most positions a row's chunks cover */
  /* A task is a run of rows that start on one block (a shared prefix), up to TASK_LANES query heads of one
   * key/value head and within MAX_ROWS_SCRATCH, so that they score the blocks they share in vector
   * lanes (query_lanes.h); any other row is a task of its own. With fewer tasks than threads, one
   * key/value head each keeps every thread busy. */
  const int64_t row_scores = heads * Q * span * (int64_t)sizeof(float);
  int64_t rows = per_head >= TASK_LANES ? 1 : TASK_LANES / per_head;
  if (rows * row_scores > MAX_ROWS_SCRATCH) rows = row_scores >= MAX_ROWS_SCRATCH ? 1 : MAX_ROWS_SCRATCH / row_scores;
  int64_t *runs = malloc((B + 1) * sizeof(int64_t)), row_runs = 0;  /* run k: rows runs[k] .. runs[k + 1] */
  for (int64_t b = 0; b < B; b++)
    if (b == 0 || b - runs[row_runs - 1] == rows || slots[b * C] != slots[runs[row_runs - 1] * C]) runs[row_runs++] = b;
  runs[row_runs] = B;
  const int64_t group = row_runs >= threads ? kv_heads : 1, tasks = row_runs * (kv_heads / group);
  const int64_t per_task = group * per_head, lane_sets = (rows * per_head + LANES - 1) / LANES;
  /* Per thread, reused by its tasks: each row's reads and scores (then weights), and the transposed
   * queries (query_lanes.h) of the rows that read the chunk at hand, for each head and set of 16. */
  struct row_reads *reads = malloc(rows * sizeof *reads);
  const float **pointers = malloc(2 * rows * span * sizeof(float *));
  float *scores = aligned_floats(rows * per_task * span), *qt = aligned_floats(group * lane_sets * D * LANES);
  int64_t *bounds = malloc(2 * rows * Q * sizeof(int64_t));
  for (int64_t n = 0; n < rows; n++)
    reads[n] = (struct row_reads){.k = pointers + 2 * n * span, .v = pointers + (2 * n + 1) * span,
                                  .scores = scores + n * per_task * span, .start = bounds + 2 * n * Q,
                                  .end = bounds + (2 * n + 1) * Q};
#pragma omp for schedule(static)
  for (int64_t task = 0; task < tasks; task++) {
    const int64_t run = task / (kv_heads / group), b0 = runs[run], g0 = task % (kv_heads / group) * group;
    const int64_t count = runs[run + 1] - b0, lines = group * vectors;  /* lines: of a position's keys */
    int64_t from = INT64_MAX, to = 0;
    for (int64_t n = 0; n < count; n++) {
      struct row_reads *w = reads + n;
      find_reads(w, b0 + n, g0, keys, values, slots, positions, lengths, Q, C, kv_heads, D, window);
      for (int64_t c0 = w->lo; c0 < w->lo + AHEAD * CHUNK && c0 < w->hi; c0 += CHUNK) prefetch(w->k + c0 - w->lo, lines);
      from = w->lo < from ? w->lo : from;
      to = w->hi > to ? w->hi : to;
    }
    uint32_t transposed = 0;  /* the rows whose queries qt holds */
    for (int64_t c0 = from; c0 < to; c0 += CHUNK) {
      uint32_t done = 0;
      for (int64_t n = 0; n < count; n++) {
        const struct row_reads *w = reads + n;
        if (done >> n & 1 || c0 < w->lo || c0 >= w->hi) continue;
        uint32_t sharing = 1u << n;  /* the rows that read this chunk's positions where row n does */
        for (int64_t m = n + 1; m < count; m++)
          if (!(done >> m & 1) && c0 >= reads[m].lo && c0 < reads[m].hi && same_chunk(w, reads + m, c0))
            sharing |= 1u << m;
        done |= sharing;
        const int64_t t = c0 - w->lo;
        if (c0 + AHEAD * CHUNK < w->hi) prefetch(w->k + t + AHEAD * CHUNK, lines);
        prefetch(w->v + t, lines);  /* read after every score: by then they are in the caches */
        const int64_t lanes = __builtin_popcount(sharing) * per_head;
        if (lanes >= LANES_FROM && sharing != transposed) {
          transpose_queries(qt, q, q_stride, b0, sharing, Q, shared, D, group, g0, lane_sets);
          transposed = sharing;
        }
        if (lanes >= LANES_FROM) {
          for (int64_t g = 0; g < group; g++) {
            /* Lane l of set s: the (16 s + l)th query head of the rows sharing the chunk, in row order,
             * then token i, then head r. */
            uint32_t left = sharing;
            for (int64_t s = 0, i = 0, r = 0; left; s++) {
              f32x16 by_query[CHUNK];
              chunk_lane_scores(qt + (g * lane_sets + s) * D * LANES, w->k + t, g * D, vectors, scale, by_query);
              for (int l = 0; l < LANES && left; l++) {
                const struct row_reads *x = reads + __builtin_ctz(left);
                store_scores(x, (g * Q + i) * shared + r, c0, span, seen_at(x, i, c0), by_query[l]);
                if (++r == shared && (r = 0, ++i == Q)) i = 0, left &= left - 1;
              }
            }
          }
          continue;
        }
        for (uint32_t left = sharing; left; left &= left - 1) {  /* each row's query heads, in sum trees */
          const int64_t n2 = __builtin_ctz(left);
          const struct row_reads *x = reads + n2;
          for (int64_t i = 0; i < Q; i++) {
            if (x->end[i] <= c0 || x->start[i] >= c0 + CHUNK) continue;  /* nothing of this chunk is visible */
            const mask16 seen = seen_at(x, i, c0);
            for (int64_t g = 0; g < group; g++) {
              const float *query = q + ((b0 + n2) * Q + i) * q_stride + (g0 + g) * shared * D;
              for (int64_t r = 0; r < shared; r++) {
                const f32x16 score = chunk_scores_any(query + r * D, w->k + t, g * D, vectors);
                store_scores(x, (g * Q + i) * shared + r, c0, span, seen, f32x16_mul(score, f32x16_broadcast(scale)));
              }
            }
          }
        }
      }
    }
    for (int64_t n = 0; n < count; n++) {
      const struct row_reads *x = reads + n;
      const int64_t b = b0 + n;
      for (int64_t j = 0; j < per_task; j++) {  /* j = (g * Q + i) * shared + r */
        const int64_t g = j / per_head, i = j % per_head / shared, r = j % shared;
        float *o = out + ((b * Q + i) * heads + (g0 + g) * shared + r) * D;
        const int64_t first = x->start[i] - x->start[i] % CHUNK - x->lo;
        const int64_t last = x->end[i] <= x->start[i] ? first : round_up(x->end[i]) - x->lo;
        float *w = x->scores + j * span;
        f32x16 top = f32x16_broadcast(-INFINITY), sum = f32x16_zero();
        for (int64_t t = first; t < last; t += CHUNK) top = f32x16_max(top, f32x16_load(w + t));
        const f32x16 best = f32x16_broadcast(f32x16_reduce_max(top));
        for (int64_t t = first; t < last; t += CHUNK) {
          const f32x16 s = f32x16_load(w + t);
          const mask16 seen = f32x16_ordered_not_equal(s, f32x16_broadcast(-INFINITY));
          const f32x16 e = f32x16_keep(seen, exp_nonpositive(f32x16_sub(s, best)));
          f32x16_store(w + t, e);
          sum = f32x16_add(sum, e);
        }
        const float total = f32x16_reduce_add(sum);
        weighted_values_any(w + first, x->v + first, g * D, last - first, vectors, total > 0.0f ? 1.0f / total : 0.0f, o);
      }
    }
  }
  free(runs);
  free(reads);
  free(pointers);
  free(scores);
  free(qt);
  free(bounds);
}

#endif
