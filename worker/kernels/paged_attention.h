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

/* One call's arguments (as paged_attention_in_team's) and the sizes that follow from them. */
struct paged_call {
  const float *q, *keys, *values;
  const int64_t *slots, *positions, *lengths;
  int64_t q_stride, B, Q, C, heads, kv_heads, D, window;
  float scale;
  float *out;
  int64_t shared, vectors, per_head, span;  /* span: the most positions a row's chunks cover */
};

/* Rows b0 .. b0 + count (a run, or a lone row), key/value heads g0 .. g0 + group. */
struct task { int64_t b0, count, g0, group; };

/* A thread's plan and scratch, reused by its tasks: each row's reads and scores (then weights), and
 * the transposed queries (query_lanes.h) of the rows that read the chunk at hand, for each head and
 * set of 16; for the weighted values, each query head's inverse sum of weights and its sums over the
 * chunks summed in lanes, and the weights transposed. */
struct scratch {
  int64_t *runs;  /* run k: rows runs[k] .. runs[k + 1] */
  struct task *tasks;
  struct row_reads *reads;
  const float **pointers;
  int64_t *bounds;
  float *scores, *qt, *inverses, *sums, *wt;
};

/* Plan, sizes: the most rows of a run, and the fewest. */
static inline void run_sizes(const struct paged_call *c, int64_t *rows, int64_t *fewest) {
  /* Rows that start on one block (a shared prefix) form a run, up to TASK_LANES query heads of one
   * key/value head (but at least kv_heads rows) and within MAX_ROWS_SCRATCH, and score the blocks
   * they share in vector lanes (query_lanes.h). A task is a run's key/value head. Fewer such rows
   * than would fill LANES_FROM lanes or than there are key/value heads are no run: each is a lone
   * row, a task of all its key/value heads where there are at least as many runs and lone rows as
   * threads (of one each otherwise). A thread's scratch is then never more than when every row shares one table,
   * the step the memory profile runs (profile_run.py): a run's rows hold the scores of at least as
   * many query heads as a lone row's. */
  const int64_t row_scores = c->per_head * c->span * (int64_t)sizeof(float);
  int64_t n = LANES_FROM > TASK_LANES ? 1 : larger(TASK_LANES / c->per_head, c->kv_heads);
  if (n * row_scores > MAX_ROWS_SCRATCH) n = MAX_ROWS_SCRATCH / row_scores;
  *rows = n > 32 ? 32 : n < 1 ? 1 : n;  /* a run's rows are the bits of a uint32_t */
  *fewest = larger(larger((LANES_FROM + c->per_head - 1) / c->per_head, c->kv_heads), 2);  /* a run's rows */
}

/* Plan, rows: the rows that start on one block (a shared prefix), runs of up to `rows` of them, each
 * a run where it holds at least `fewest` and lone rows otherwise, into runs (NULL: only counted).
 * Returns how many; *several: how many of them are runs of more than one row. */
static inline int64_t plan_runs(const struct paged_call *c, int64_t rows, int64_t fewest, int64_t *runs,
                                int64_t *several) {
  int64_t row_runs = 0;
  *several = 0;
  for (int64_t b0 = 0, b1; b0 < c->B; b0 = b1) {  /* rows b0 .. b1 start on one block */
    for (b1 = b0 + 1; b1 < c->B && c->slots[b1 * c->C] == c->slots[b0 * c->C]; b1++) {}
    for (int64_t b = b0; b < b1; b += rows)
      if (smaller(b1 - b, rows) >= fewest) {  /* fewest >= 2: a run of several rows */
        if (runs) runs[row_runs] = b;
        row_runs++, (*several)++;
      } else {
        for (int64_t lone = b; lone < b1 && lone < b + rows; lone++, row_runs++)
          if (runs) runs[row_runs] = lone;
      }
  }
  if (runs) runs[row_runs] = c->B;
  return row_runs;
}

/* Plan, tasks: a run's rows take one key/value head a task; a lone row all of them where there are at
 * least as many runs as threads (one each otherwise). The count, known without the runs themselves. */
static inline int64_t count_tasks(const struct paged_call *c, int64_t row_runs, int64_t several, int threads) {
  return row_runs < threads ? row_runs * c->kv_heads : several * c->kv_heads + (row_runs - several);
}

/* The tasks of the runs, and the scratch sizes they need: their most query heads, rows and lane sets. */
static inline void plan_tasks(const struct paged_call *c, const int64_t *runs, int64_t row_runs, int threads,
                              struct task *tasks, int64_t *most_heads, int64_t *most_rows, int64_t *most_sets) {
  int64_t jobs = 0;
  *most_heads = *most_rows = *most_sets = 0;
  for (int64_t k = 0; k < row_runs; k++) {
    const int64_t b0 = runs[k], n = runs[k + 1] - b0;
    const int64_t group = n > 1 || row_runs < threads ? 1 : c->kv_heads;
    for (int64_t g0 = 0; g0 < c->kv_heads; g0 += group) tasks[jobs++] = (struct task){b0, n, g0, group};
    *most_heads = larger(n * group * c->per_head, *most_heads);
    *most_rows = larger(n, *most_rows);
    if (n * c->per_head >= LANES_FROM)  /* it may share lanes */
      *most_sets = larger(group * lane_sets(n * c->per_head), *most_sets);
  }
}

/* The scratch of the tasks' sizes; 0 where some of it cannot be had (what was had stays for free_scratch). */
static inline int take_scratch(struct scratch *s, const struct paged_call *c, int64_t most_heads, int64_t most_rows,
                               int64_t most_sets) {
  s->reads = malloc(most_rows * sizeof *s->reads);
  s->pointers = malloc(2 * most_rows * c->span * sizeof(float *));
  s->bounds = malloc(2 * most_rows * c->Q * sizeof(int64_t));
  s->scores = aligned_floats(most_heads * c->span);
  s->inverses = malloc(most_heads * sizeof(float));
  if (most_sets) {
    s->qt = aligned_floats(most_sets * c->D * LANES);
    s->sums = aligned_floats(most_heads * 2 * c->D);
    s->wt = aligned_floats(c->span * LANES);
  }
  return s->reads && s->pointers && s->bounds && s->scores && s->inverses &&
         (!most_sets || (s->qt && s->sums && s->wt));
}

static inline void free_scratch(struct scratch *s) {
  free(s->runs);
  free(s->tasks);
  free(s->reads);
  free(s->pointers);
  free(s->bounds);
  free(s->scores);
  free(s->qt);
  free(s->inverses);
  free(s->sums);
  free(s->wt);
}

/* Task, step 1: where each row's keys and values sit (unless the run's task before found them), where
 * its scores go, its first chunks' keys prefetched; [*from, *to): the chunks the rows span. */
ALWAYS_INLINE void task_reads(const struct paged_call *c, const struct task *t, struct scratch *s, int64_t *read_run,
                              int64_t *from, int64_t *to) {
  const int64_t per_task = t->group * c->per_head, lines = t->group * c->vectors, head0 = t->g0 * c->D;
  const int64_t span = c->span, Q = c->Q;
  *from = INT64_MAX, *to = 0;
  for (int64_t n = 0; n < t->count; n++) {
    struct row_reads *w = s->reads + n;
    if (*read_run != t->b0) {
      *w = (struct row_reads){.k = s->pointers + 2 * n * span, .v = s->pointers + (2 * n + 1) * span,
                              .start = s->bounds + 2 * n * Q, .end = s->bounds + (2 * n + 1) * Q};
      find_reads(w, t->b0 + n, c->keys, c->values, c->slots, c->positions, c->lengths, Q, c->C, c->kv_heads, c->D,
                 c->window);
    }
    w->scores = s->scores + n * per_task * span;
    for (int64_t c0 = w->lo; c0 < w->lo + AHEAD * CHUNK && c0 < w->hi; c0 += CHUNK)
      prefetch(w->k + c0 - w->lo, head0, lines);
    *from = smaller(w->lo, *from);
    *to = larger(w->hi, *to);
  }
  *read_run = t->b0;
}

/* Task, step 2 in lanes: the scores at chunk c0 (row w's chunk t) of the rows sharing it, from the
 * transposed queries. Lane l of set s: the (16 s + l)th query head of those rows, in row order, then
 * token i, then head r. */
ALWAYS_INLINE void score_in_lanes(const struct paged_call *c, const struct task *t, const struct scratch *s,
                                  const struct row_reads *w, uint32_t sharing, int64_t c0) {
  const int64_t sets = lane_sets(t->count * c->per_head), head0 = t->g0 * c->D, D = c->D;
  const int64_t Q = c->Q, shared = c->shared, span = c->span, at = c0 - w->lo;
  for (int64_t g = 0; g < t->group; g++) {
    uint32_t left = sharing;
    for (int64_t set = 0, i = 0, r = 0; left; set++) {
      f32x16 by_query[CHUNK];
      chunk_lane_scores(s->qt + (g * sets + set) * D * LANES, w->k + at, head0 + g * D, c->vectors, c->scale,
                        by_query);
      for (int l = 0; l < LANES && left; l++) {
        const struct row_reads *x = s->reads + __builtin_ctz(left);
        store_scores(x, (g * Q + i) * shared + r, c0, span, seen_at(x, i, c0), by_query[l]);
        if (++r == shared && (r = 0, ++i == Q)) i = 0, left &= left - 1;
      }
    }
  }
}

/* Task, step 2 in trees: the scores at chunk c0 (row w's chunk t) of each row sharing it, each query
 * head's in sum trees. */
ALWAYS_INLINE void score_in_trees(const struct paged_call *c, const struct task *t, const struct scratch *s,
                                  const struct row_reads *w, uint32_t sharing, int64_t c0) {
  const int64_t head0 = t->g0 * c->D, D = c->D, Q = c->Q, shared = c->shared, span = c->span, at = c0 - w->lo;
  const int64_t vectors = c->vectors;
  const float scale = c->scale;
  for (uint32_t left = sharing; left; left &= left - 1) {
    const int64_t n2 = __builtin_ctz(left);
    const struct row_reads *x = s->reads + n2;
    for (int64_t i = 0; i < Q; i++) {
      if (x->end[i] <= c0 || x->start[i] >= c0 + CHUNK) continue;  /* nothing of this chunk is visible */
      const mask16 seen = seen_at(x, i, c0);
      for (int64_t g = 0; g < t->group; g++) {
        const float *query = c->q + ((t->b0 + n2) * Q + i) * c->q_stride + (t->g0 + g) * shared * D;
        for (int64_t r = 0; r < shared; r++) {
          const f32x16 score = chunk_scores_any(query + r * D, w->k + at, head0 + g * D, vectors);
          store_scores(x, (g * Q + i) * shared + r, c0, span, seen, f32x16_mul(score, f32x16_broadcast(scale)));
        }
      }
    }
  }
}

/* Task, step 2: every query head's scores over [from, to), chunk by chunk, the rows that read a chunk's
 * positions where another does scoring it together (in lanes where they fill enough). Returns the end
 * of the leading chunks every row reads, scored in lanes. */
ALWAYS_INLINE int64_t task_scores(const struct paged_call *c, const struct task *t, const struct scratch *s,
                                  int64_t from, int64_t to) {
  const int64_t lines = t->group * c->vectors, head0 = t->g0 * c->D, count = t->count;
  uint32_t transposed = 0;  /* the rows whose queries qt holds */
  const uint32_t every_row = (uint32_t)((1ull << count) - 1);
  int64_t together = from;
  for (int64_t c0 = from; c0 < to; c0 += CHUNK) {
    uint32_t done = 0;
    for (int64_t n = 0; n < count; n++) {
      const struct row_reads *w = s->reads + n;
      if (done >> n & 1 || c0 < w->lo || c0 >= w->hi) continue;
      uint32_t sharing = 1u << n;  /* the rows that read this chunk's positions where row n does */
      for (int64_t m = n + 1; m < count; m++)
        if (!(done >> m & 1) && c0 >= s->reads[m].lo && c0 < s->reads[m].hi && same_chunk(w, s->reads + m, c0))
          sharing |= 1u << m;
      done |= sharing;
      const int64_t at = c0 - w->lo;
      if (c0 + AHEAD * CHUNK < w->hi) prefetch(w->k + at + AHEAD * CHUNK, head0, lines);
      prefetch(w->v + at, head0, lines);  /* read after every score: by then they are in the caches */
      if (__builtin_popcount(sharing) * c->per_head >= LANES_FROM) {
        if (sharing != transposed) {
          transpose_queries(s->qt, c->q, c->q_stride, t->b0, sharing, c->Q, c->shared, c->D, t->group, t->g0,
                            lane_sets(count * c->per_head));
          transposed = sharing;
        }
        if (sharing == every_row && together == c0) together += CHUNK;
        score_in_lanes(c, t, s, w, sharing, c0);
      } else {
        score_in_trees(c, t, s, w, sharing, c0);
      }
    }
  }
  return together;
}

/* Task, step 3: each query head's weights in place of its scores (softmax less its division), and the
 * inverse of their sum. Returns whether every query head's positions start with the chunks [from,
 * together) (then their weighted values are summed in lanes). */
ALWAYS_INLINE int task_weights(const struct paged_call *c, const struct task *t, const struct scratch *s,
                               int64_t from, int64_t together) {
  const int64_t per_task = t->group * c->per_head, per_head = c->per_head, span = c->span;
  int lanes_fit = together > from;
  for (int64_t n = 0; n < t->count; n++) {
    const struct row_reads *x = s->reads + n;
    for (int64_t j = 0; j < per_task; j++) {  /* j = (g * Q + i) * shared + r */
      int64_t first, last;
      query_chunks(x, j % per_head / c->shared, &first, &last);
      lanes_fit &= x->lo + first == from && x->lo + last >= together;
      float *w = x->scores + j * span;
      f32x16 top = f32x16_broadcast(-INFINITY), sum = f32x16_zero();
      for (int64_t at = first; at < last; at += CHUNK) top = f32x16_max(top, f32x16_load(w + at));
      const f32x16 best = f32x16_broadcast(f32x16_reduce_max(top));
      for (int64_t at = first; at < last; at += CHUNK) {
        const f32x16 sc = f32x16_load(w + at);
        const mask16 seen = f32x16_ordered_not_equal(sc, f32x16_broadcast(-INFINITY));
        const f32x16 e = f32x16_keep(seen, exp_nonpositive(f32x16_sub(sc, best)));
        f32x16_store(w + at, e);
        sum = f32x16_add(sum, e);
      }
      const float total = f32x16_reduce_add(sum);
      s->inverses[n * per_task + j] = total > 0.0f ? 1.0f / total : 0.0f;
    }
  }
  return lanes_fit;
}

/* Task, step 4 (where lanes fit): the weighted values over the chunks [from, together) every row
 * scored in lanes, summed in lanes too, 16 query heads at a time. */
ALWAYS_INLINE void task_lane_sums(const struct paged_call *c, const struct task *t, const struct scratch *s,
                                  int64_t from, int64_t together) {
  const int64_t per_task = t->group * c->per_head, per_head = c->per_head, D = c->D, count = t->count;
  const float *lane_weights[LANES];
  float *lane_sums[LANES];
  for (int64_t g = 0; g < t->group; g++)
    for (int64_t n = 0, in_set = 0; n < count; n++)
      for (int64_t j = g * per_head; j < (g + 1) * per_head; j++) {
        lane_weights[in_set] = s->reads[n].scores + j * c->span;
        lane_sums[in_set++] = s->sums + (n * per_task + j) * 2 * D;
        if (in_set == LANES || (n == count - 1 && j == (g + 1) * per_head - 1)) {
          lane_weighted_sums(lane_weights, in_set, s->reads[0].v, (t->g0 + g) * D, together - from, D, s->wt,
                             lane_sums);
          in_set = 0;
        }
      }
}

/* Task, step 5: each query head's output, its weighted values over its own positions (on from the
 * sums in lanes where they fit), times its inverse sum of weights. */
ALWAYS_INLINE void task_outputs(const struct paged_call *c, const struct task *t, const struct scratch *s,
                                int64_t together, int lanes_fit) {
  const int64_t per_task = t->group * c->per_head, per_head = c->per_head, shared = c->shared, D = c->D;
  for (int64_t n = 0; n < t->count; n++) {
    const struct row_reads *x = s->reads + n;
    for (int64_t j = 0; j < per_task; j++) {
      const int64_t g = j / per_head, i = j % per_head / shared, r = j % shared;
      float *o = c->out + (((t->b0 + n) * c->Q + i) * c->heads + (t->g0 + g) * shared + r) * D;
      int64_t first, last;
      query_chunks(x, i, &first, &last);
      if (lanes_fit) first = together - x->lo;  /* the chunks before, summed in lanes */
      weighted_values_any(x->scores + j * c->span + first, x->v + first, (t->g0 + g) * D, last - first, c->vectors,
                          s->inverses[n * per_task + j], lanes_fit ? s->sums + (n * per_task + j) * 2 * D : NULL, o);
    }
  }
}

/* q: token t = b * Q + i at q + t * q_stride, head h at + h * D. keys, values: [slots, kv_heads, D].
 * slots: [B, C]; positions: [B, Q]; lengths: [B]; out: [B, Q, heads, D]. D % 16 == 0, D <= 128.
 * Run by every thread of the parallel region it is called in (an `omp for`, ending in a barrier).
 * A thread whose plan or scratch cannot be allocated sets *failed (KERNEL_OUT_OF_MEMORY; shared by the
 * team) and skips its tasks, still meeting the others at the barrier; `out` is then not to be read. */
static void paged_attention_in_team(const float *q, int64_t q_stride, const float *keys, const float *values,
                                    const int64_t *slots, const int64_t *positions, const int64_t *lengths,
                                    int64_t B, int64_t Q, int64_t C, int64_t heads, int64_t kv_heads, int64_t D,
                                    int64_t window, float scale, float *out, int *failed) {
  const int threads = omp_get_num_threads();
  const int64_t shared = heads / kv_heads, per_head = Q * shared;
  const struct paged_call c = {q, keys, values, slots, positions, lengths, q_stride, B, Q, C, heads, kv_heads, D,
                               window, scale, out, shared, D / 16, per_head, C + 2 * CHUNK};
  int64_t rows, fewest;
  run_sizes(&c, &rows, &fewest);
  /* Every thread plans the same tasks; the count needs no allocation, so that a thread without
   * memory still runs the same `omp for` as the others. */
  struct scratch s = {.runs = malloc((B + 1) * sizeof(int64_t))};
  int64_t several;
  const int64_t row_runs = plan_runs(&c, rows, fewest, s.runs, &several);
  const int64_t jobs = count_tasks(&c, row_runs, several, threads);
  int ready = jobs == 0;
  if (jobs > 0 && s.runs && (s.tasks = malloc(jobs * sizeof *s.tasks))) {
    int64_t most_heads, most_rows, most_sets;
    plan_tasks(&c, s.runs, row_runs, threads, s.tasks, &most_heads, &most_rows, &most_sets);
    ready = take_scratch(&s, &c, most_heads, most_rows, most_sets);
  }
  if (!ready) {
#pragma omp atomic write
    *failed = KERNEL_OUT_OF_MEMORY;
  }
  int64_t read_run = -1;  /* the run whose rows' reads `s.reads` holds: a run's tasks share them */
#pragma omp for schedule(static)
  for (int64_t task = 0; task < jobs; task++) {
    if (!ready) continue;
    const struct task *t = s.tasks + task;
    int64_t from, to;
    task_reads(&c, t, &s, &read_run, &from, &to);
    const int64_t together = task_scores(&c, t, &s, from, to);
    const int lanes_fit = task_weights(&c, t, &s, from, together);
    if (lanes_fit) task_lane_sums(&c, t, &s, from, together);
    task_outputs(&c, t, &s, together, lanes_fit);
  }
  free_scratch(&s);
}

#endif
