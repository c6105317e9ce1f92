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

/* q: token t = b * Q + i at q + t * q_stride, head h at + h * D. keys, values: [slots, kv_heads, D].
 * slots: [B, C]; positions: [B, Q]; lengths: [B]; out: [B, Q, heads, D]. D % 16 == 0, D <= 128.
 * Run by every thread of the parallel region it is called in (an `omp for`, ending in a barrier). */
static void paged_attention_in_team(const float *q, int64_t q_stride, const float *keys, const float *values,
                                    const int64_t *slots, const int64_t *positions, const int64_t *lengths,
                                    int64_t B, int64_t Q, int64_t C, int64_t heads, int64_t kv_heads, int64_t D,
                                    int64_t window, float scale, float *out) {
  const int threads = omp_get_num_threads();
  const int64_t shared = heads / kv_heads, vectors = D / 16, per_head = Q * shared;
  const int64_t span = C + 2 * CHUNK;  /* the most positions a task's chunks cover */
  /* A task is a row's key/value heads, so that it reads each position's keys (and values) as one
   * contiguous run; with fewer rows than threads, one head each keeps every thread busy. */
  const int64_t group = B >= threads ? kv_heads : 1, per_task = group * per_head;
  /* Per thread, reused by its tasks: where each position's keys and values sit, and the scores
   * (then weights) of each (key/value head, query token, head) at each position. */
  const float **k = malloc(2 * span * sizeof(float *)), **v = k + span;
  float *scores = aligned_floats(per_task * span);
  int64_t *start = malloc(2 * Q * sizeof(int64_t)), *end = start + Q;
#pragma omp for schedule(static)
  for (int64_t task = 0; task < B * kv_heads / group; task++) {
    const int64_t b = task * group / kv_heads, g0 = task * group % kv_heads;
    int64_t first = C, last = 0;
    for (int64_t i = 0; i < Q; i++) {
      visible(positions[b * Q + i], lengths[b], window, &start[i], &end[i]);
      first = start[i] < first ? start[i] : first;
      last = end[i] > last ? end[i] : last;
    }
    const int64_t lo = first - first % CHUNK, hi = last < lo ? lo : round_up(last);
    for (int64_t c = lo; c < hi; c++) {  /* past the context: any slot, those lanes are masked */
      const int64_t at = (slots[b * C + (c < C ? c : C - 1)] * kv_heads + g0) * D;
      k[c - lo] = keys + at;
      v[c - lo] = values + at;
    }
    const int64_t lines = group * vectors;  /* cache lines of one position's keys in this task */
    for (int64_t c0 = lo; c0 < lo + AHEAD * CHUNK && c0 < hi; c0 += CHUNK) prefetch(k + c0 - lo, lines);
    const i32x16 lane = i32x16_lane_index();
    for (int64_t c0 = lo; c0 < hi; c0 += CHUNK) {
      const int64_t t = c0 - lo;
      if (c0 + AHEAD * CHUNK < hi) prefetch(k + t + AHEAD * CHUNK, lines);
      prefetch(v + t, lines);  /* read after every score: by then they are in the caches */
      for (int64_t i = 0; i < Q; i++) {
        if (end[i] <= c0 || start[i] >= c0 + CHUNK) continue;  /* nothing of this chunk is visible */
        const i32x16 offset = i32x16_add(lane, i32x16_broadcast((int)(c0 - start[i])));
        const mask16 seen = i32x16_at_least(offset, i32x16_zero()) &
                            i32x16_less(offset, i32x16_broadcast((int)(end[i] - start[i])));
        for (int64_t g = 0; g < group; g++) {
          const float *query = q + (b * Q + i) * q_stride + (g0 + g) * shared * D;
          for (int64_t r = 0; r < shared; r++) {
            const f32x16 s = f32x16_mul(chunk_scores_any(query + r * D, k + t, g * D, vectors),
                                        f32x16_broadcast(scale));
            f32x16_store(scores + ((g * Q + i) * shared + r) * span + t,
                         f32x16_select(seen, s, f32x16_broadcast(-INFINITY)));
          }
        }
      }
    }
    for (int64_t j = 0; j < per_task; j++) {  /* j = (g * Q + i) * shared + r */
      const int64_t g = j / per_head, i = j % per_head / shared, r = j % shared;
      float *o = out + ((b * Q + i) * heads + (g0 + g) * shared + r) * D;
      const int64_t from = start[i] - start[i] % CHUNK - lo, to = end[i] <= start[i] ? from : round_up(end[i]) - lo;
      float *w = scores + j * span;
      f32x16 top = f32x16_broadcast(-INFINITY), sum = f32x16_zero();
      for (int64_t t = from; t < to; t += CHUNK) top = f32x16_max(top, f32x16_load(w + t));
      const f32x16 best = f32x16_broadcast(f32x16_reduce_max(top));
      for (int64_t t = from; t < to; t += CHUNK) {
        const f32x16 s = f32x16_load(w + t);
        const mask16 seen = f32x16_ordered_not_equal(s, f32x16_broadcast(-INFINITY));
        const f32x16 e = f32x16_keep(seen, exp_nonpositive(f32x16_sub(s, best)));
        f32x16_store(w + t, e);
        sum = f32x16_add(sum, e);
      }
      const float total = f32x16_reduce_add(sum);
      weighted_values_any(w + from, v + from, g * D, to - from, vectors, total > 0.0f ? 1.0f / total : 0.0f, o);
    }
  }
  free(k);
  free(scores);
  free(start);
}

#endif
