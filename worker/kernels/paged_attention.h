/* Decode and verify attention for float32 that reads keys and values where they sit in the paged cache.
 *
 * For query token i of row b (at position p), head h: softmax over the visible context positions
 * c (c <= p, c < the row's length, c > p - window when there is one) of scale * (q . K[slot]),
 * weighting V[slot], where slot = slots[b, c]. Nothing is gathered or masked first.
 *
 * Unshared rows' time goes in reading the cache: at 32 rows the shipped target's keys and values are
 * ~26 MB a step, more than the L3 cache holds once the weights are in it. So a task first lists
 * where every key and value it reads sits, then prefetches them into L2 AHEAD chunks before it reads
 * them: a block table scatters blocks, which the hardware prefetchers cannot follow. Scores go to a
 * scratch row, in chunks of 16 positions aligned to absolute positions (16 dot products summed in
 * one tree, sum16); each query head then takes its maximum, its weights and their sum in one pass,
 * and sums the weighted values with its accumulators in registers (two banks, even and odd
 * positions, so that the adds do not wait on each other). The heads that share a key/value head and
 * all of a row's query tokens share the reads.
 *
 * Rows decoding after one cached prefix read the same blocks, from the caches, and their time goes in
 * arithmetic: such rows form a run, and a chunk that several rows' tables share is scored for all of
 * their query heads at once, one query in each vector lane (query_lanes.h); over the leading chunks
 * every row shares, the weighted values are summed in lanes too. Lanes and trees take the same sums
 * in the same order: a token's chunks and their order depend only on its own visible range, so a row
 * alone and in a batch, beside rows of its prefix or not, or a token decoded alone and verified among
 * a draft's, give the same bits. Included by paged_attention.c (the call of its own) and
 * decoder_layers.c (a stage of the forward).
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
/* Query heads reading one chunk from which they share lanes (fewer: trees cost less); on AVX2, whose
 * 16 registers the lanes' passes overflow, never, and every row is a lone row (below). */
#if F32X16_REGISTERS >= 32
#define LANES_FROM 12
#else
#define LANES_FROM (1 << 30) /* more query heads than any task has */
#endif
#define TASK_LANES 32  /* query heads of one key/value head a run of rows holds */
#define MAX_ROWS_SCRATCH (16 << 20) /* bytes of scores a thread holds for a run's rows, past one row's */

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
static inline int64_t larger(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

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

/* o = inverse * sum over n positions (a multiple of CHUNK) of w[c] * v[c], summed on from `sums` (the
 * even positions' sums, then the odd ones', of the positions before; NULL: none). Inlined with a
 * constant `vectors`, the accumulators live in registers. */
ALWAYS_INLINE void weighted_values(const float *w, const float *const *v, int64_t offset, int64_t n,
                                   const int64_t vectors, float inverse, const float *sums, float *o) {
  f32x16 even[MAX_VECTORS], odd[MAX_VECTORS];
  for (int64_t x = 0; x < vectors; x++) {
    even[x] = sums ? f32x16_load(sums + 16 * x) : f32x16_zero();
    odd[x] = sums ? f32x16_load(sums + 16 * (vectors + x)) : f32x16_zero();
  }
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
                                float inverse, const float *sums, float *o) {
  switch (vectors) {  /* the head sizes models use, each with its accumulators in registers */
    case 1: weighted_values(w, v, offset, n, 1, inverse, sums, o); break;
    case 2: weighted_values(w, v, offset, n, 2, inverse, sums, o); break;
    case 4: weighted_values(w, v, offset, n, 4, inverse, sums, o); break;
    case 8: weighted_values(w, v, offset, n, 8, inverse, sums, o); break;
    default: weighted_values(w, v, offset, n, vectors, inverse, sums, o);
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

/* `lines` cache lines from offset at each of 16 positions, into L2 (into L1 the prefetches stalled). */
static inline void prefetch(const float *const *at, int64_t offset, int64_t lines) {
  for (int c = 0; c < CHUNK; c++)
    for (int64_t x = 0; x < lines; x++) __builtin_prefetch(at[c] + offset + 16 * x, 0, 2);  /* to read, into L2 */
}

/* Where a row's chunks are: its tokens' visible ranges, the chunk-aligned span [lo, hi) they cover, and
 * where each position's keys and values sit (k[c - lo], v[c - lo]: key/value head 0's; head g's are
 * g * D on). */
struct row_reads {
  int64_t lo, hi, *start, *end;
  const float **k, **v;
  float *scores;  /* [(g * Q + i) * shared + r][span] of the task's heads g */
};

static void find_reads(struct row_reads *w, int64_t b, const float *keys, const float *values,
                       const int64_t *slots, const int64_t *positions, const int64_t *lengths, int64_t Q, int64_t C,
                       int64_t kv_heads, int64_t D, int64_t window) {
  int64_t first = C, last = 0;
  for (int64_t i = 0; i < Q; i++) {
    visible(positions[b * Q + i], lengths[b], window, &w->start[i], &w->end[i]);
    first = smaller(w->start[i], first);
    last = larger(w->end[i], last);
  }
  w->lo = first - first % CHUNK;
  w->hi = last < w->lo ? w->lo : round_up(last);
  for (int64_t c = w->lo; c < w->hi; c++) {  /* past the context: any slot, those lanes are masked */
    const int64_t at = slots[b * C + (c < C ? c : C - 1)] * kv_heads * D;
    w->k[c - w->lo] = keys + at;
    w->v[c - w->lo] = values + at;
  }
}

/* Token i's chunks, [first, last) in its row's span. */
static inline void query_chunks(const struct row_reads *w, int64_t i, int64_t *first, int64_t *last) {
  *first = w->start[i] - w->start[i] % CHUNK - w->lo;
  *last = w->end[i] <= w->start[i] ? *first : round_up(w->end[i]) - w->lo;
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

/* qt [group][sets][D][LANES]: lane l of set s holds query head l + 16 s of the rows in `sharing`
 * (rows b0 + n, in order; per row token i's heads of key/value head g0 + g, i major); unused lanes 0. */
static void transpose_queries(float *qt, const float *q, int64_t q_stride, int64_t b0, uint32_t sharing, int64_t Q,
                              int64_t shared, int64_t D, int64_t group, int64_t g0, int64_t sets) {
  const int64_t per_head = Q * shared, lanes = __builtin_popcount(sharing) * per_head;
  for (int64_t g = 0; g < group; g++) {
    float *at = qt + g * sets * D * LANES;
    for (int64_t x = 0; x < sets * D * LANES; x++) at[x] = 0.0f;
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
  /* Rows that start on one block (a shared prefix) form a run, up to TASK_LANES query heads of one
   * key/value head (but at least kv_heads rows) and within MAX_ROWS_SCRATCH, and score the blocks
   * they share in vector lanes (query_lanes.h). A task is a run's key/value head. Fewer such rows
   * than would fill LANES_FROM lanes or than there are key/value heads are no run: each is a lone
   * row, a task of all its key/value heads where there are at least as many runs and lone rows as
   * threads (of one each otherwise). A thread's scratch is then never more than when every row shares one table,
   * the step the memory profile runs (profile_run.py): a run's rows hold the scores of at least as
   * many query heads as a lone row's. */
  const int64_t row_scores = per_head * span * (int64_t)sizeof(float);
  int64_t rows = LANES_FROM > TASK_LANES ? 1 : larger(TASK_LANES / per_head, kv_heads);
  if (rows * row_scores > MAX_ROWS_SCRATCH) rows = MAX_ROWS_SCRATCH / row_scores;
  rows = rows > 32 ? 32 : rows < 1 ? 1 : rows;  /* a run's rows are the bits of a uint32_t */
  const int64_t fewest = larger(larger((LANES_FROM + per_head - 1) / per_head, kv_heads), 2);  /* a run's rows */
  int64_t *runs = malloc((B + 1) * sizeof(int64_t)), row_runs = 0;  /* run k: rows runs[k] .. runs[k + 1] */
  for (int64_t b0 = 0, b1; b0 < B; b0 = b1) {  /* rows b0 .. b1 start on one block */
    for (b1 = b0 + 1; b1 < B && slots[b1 * C] == slots[b0 * C]; b1++) {}
    for (int64_t b = b0; b < b1; b += rows)
      if (smaller(b1 - b, rows) >= fewest) runs[row_runs++] = b;
      else for (int64_t lone = b; lone < b1 && lone < b + rows; lone++) runs[row_runs++] = lone;
  }
  runs[row_runs] = B;
  struct task { int64_t b0, count, g0, group; } *tasks = malloc(row_runs * kv_heads * sizeof *tasks);
  int64_t jobs = 0, most_heads = 0, most_rows = 0, most_sets = 0;  /* tasks; their most query heads, rows, lane sets */
  for (int64_t k = 0; k < row_runs; k++) {
    const int64_t b0 = runs[k], n = runs[k + 1] - b0;
    const int64_t group = n > 1 || row_runs < threads ? 1 : kv_heads;
    for (int64_t g0 = 0; g0 < kv_heads; g0 += group) tasks[jobs++] = (struct task){b0, n, g0, group};
    most_heads = larger(n * group * per_head, most_heads);
    most_rows = larger(n, most_rows);
    if (n * per_head >= LANES_FROM) most_sets = larger(group * lane_sets(n * per_head), most_sets);  /* it may share lanes */
  }
  /* Per thread, reused by its tasks: each row's reads and scores (then weights), and the transposed
   * queries (query_lanes.h) of the rows that read the chunk at hand, for each head and set of 16;
   * for the weighted values, each query head's inverse sum of weights and its sums over the chunks
   * summed in lanes, the weights transposed, and one set of lanes' weights and sums. */
  struct row_reads *reads = malloc(most_rows * sizeof *reads);
  const float **pointers = malloc(2 * most_rows * span * sizeof(float *));
  float *scores = aligned_floats(most_heads * span), *qt = most_sets ? aligned_floats(most_sets * D * LANES) : NULL;
  int64_t *bounds = malloc(2 * most_rows * Q * sizeof(int64_t));
  float *inverses = malloc(most_heads * sizeof(float));
  float *sums = most_sets ? aligned_floats(most_heads * 2 * D) : NULL, *wt = most_sets ? aligned_floats(span * LANES) : NULL;
  const float *lane_weights[LANES];
  float *lane_sums[LANES];
  int64_t read_run = -1;  /* the run whose rows' reads `reads` holds: a run's tasks share them */
#pragma omp for schedule(static)
  for (int64_t task = 0; task < jobs; task++) {
    const int64_t b0 = tasks[task].b0, count = tasks[task].count, g0 = tasks[task].g0, group = tasks[task].group;
    const int64_t per_task = group * per_head, lines = group * vectors;  /* lines: of a position's keys */
    const int64_t sets = lane_sets(count * per_head), head0 = g0 * D;  /* head0: the task's heads' offset */
    int64_t from = INT64_MAX, to = 0;
    for (int64_t n = 0; n < count; n++) {
      struct row_reads *w = reads + n;
      if (read_run != b0) {
        *w = (struct row_reads){.k = pointers + 2 * n * span, .v = pointers + (2 * n + 1) * span,
                                .start = bounds + 2 * n * Q, .end = bounds + (2 * n + 1) * Q};
        find_reads(w, b0 + n, keys, values, slots, positions, lengths, Q, C, kv_heads, D, window);
      }
      w->scores = scores + n * per_task * span;
      for (int64_t c0 = w->lo; c0 < w->lo + AHEAD * CHUNK && c0 < w->hi; c0 += CHUNK)
        prefetch(w->k + c0 - w->lo, head0, lines);
      from = smaller(w->lo, from);
      to = larger(w->hi, to);
    }
    read_run = b0;
    uint32_t transposed = 0;  /* the rows whose queries qt holds */
    const uint32_t every_row = (uint32_t)((1ull << count) - 1);
    int64_t together = from;  /* the end of the leading chunks every row reads, scored in lanes */
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
        if (c0 + AHEAD * CHUNK < w->hi) prefetch(w->k + t + AHEAD * CHUNK, head0, lines);
        prefetch(w->v + t, head0, lines);  /* read after every score: by then they are in the caches */
        const int64_t lanes = __builtin_popcount(sharing) * per_head;
        if (lanes >= LANES_FROM) {
          if (sharing != transposed) {
            transpose_queries(qt, q, q_stride, b0, sharing, Q, shared, D, group, g0, sets);
            transposed = sharing;
          }
          if (sharing == every_row && together == c0) together += CHUNK;
          for (int64_t g = 0; g < group; g++) {
            /* Lane l of set s: the (16 s + l)th query head of the rows sharing the chunk, in row order,
             * then token i, then head r. */
            uint32_t left = sharing;
            for (int64_t s = 0, i = 0, r = 0; left; s++) {
              f32x16 by_query[CHUNK];
              chunk_lane_scores(qt + (g * sets + s) * D * LANES, w->k + t, head0 + g * D, vectors, scale,
                                by_query);
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
                const f32x16 score = chunk_scores_any(query + r * D, w->k + t, head0 + g * D, vectors);
                store_scores(x, (g * Q + i) * shared + r, c0, span, seen, f32x16_mul(score, f32x16_broadcast(scale)));
              }
            }
          }
        }
      }
    }
    /* Each query head's weights, in place of its scores, and the inverse of their sum. */
    int lanes_fit = together > from;  /* whether every query head's positions start with those chunks */
    for (int64_t n = 0; n < count; n++) {
      const struct row_reads *x = reads + n;
      for (int64_t j = 0; j < per_task; j++) {  /* j = (g * Q + i) * shared + r */
        int64_t first, last;
        query_chunks(x, j % per_head / shared, &first, &last);
        lanes_fit &= x->lo + first == from && x->lo + last >= together;
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
        inverses[n * per_task + j] = total > 0.0f ? 1.0f / total : 0.0f;
      }
    }
    /* The weighted values over the chunks every row scored in lanes, summed in lanes too (16 query
     * heads at a time), then each query head's own positions on from those sums. */
    for (int64_t g = 0; lanes_fit && g < group; g++)
      for (int64_t n = 0, in_set = 0; n < count; n++)
        for (int64_t j = g * per_head; j < (g + 1) * per_head; j++) {
          lane_weights[in_set] = reads[n].scores + j * span;
          lane_sums[in_set++] = sums + (n * per_task + j) * 2 * D;
          if (in_set == LANES || (n == count - 1 && j == (g + 1) * per_head - 1)) {
            lane_weighted_sums(lane_weights, in_set, reads[0].v, head0 + g * D, together - from, D, wt, lane_sums);
            in_set = 0;
          }
        }
    for (int64_t n = 0; n < count; n++) {
      const struct row_reads *x = reads + n;
      for (int64_t j = 0; j < per_task; j++) {
        const int64_t g = j / per_head, i = j % per_head / shared, r = j % shared;
        float *o = out + (((b0 + n) * Q + i) * heads + (g0 + g) * shared + r) * D;
        int64_t first, last;
        query_chunks(x, i, &first, &last);
        if (lanes_fit) first = together - x->lo;  /* the chunks before, summed in lanes */
        weighted_values_any(x->scores + j * span + first, x->v + first, head0 + g * D, last - first, vectors,
                            inverses[n * per_task + j], lanes_fit ? sums + (n * per_task + j) * 2 * D : NULL, o);
      }
    }
  }
  free(runs);
  free(tasks);
  free(reads);
  free(pointers);
  free(scores);
  free(qt);
  free(bounds);
  free(inverses);
  free(sums);
  free(wt);
}

#endif
