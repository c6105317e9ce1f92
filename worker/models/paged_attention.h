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
 * draft's, give the same bits.
 */
#ifndef PAGED_ATTENTION_H
#define PAGED_ATTENTION_H
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector16.h"

#define CHUNK 16
#define AHEAD 2       /* chunks prefetched before they are read */
#define MAX_VECTORS 8 /* head_dim up to 128 (paged_attention.py checks) */

/* The 16 sums of 16 lanes each, as one vector: lane c holds the sum of v[c]'s lanes. A tree of
 * in-lane then cross-lane adds, where one reduction per vector costs about three times as much. */
static inline __m512 sum16(const __m512 v[CHUNK]) {
  __m512 quads[4];
  for (int g = 0; g < 4; g++) {  /* each 128-bit lane L: the sums over L of v[4g .. 4g+3] */
    const __m512 *w = v + 4 * g;
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
    quads[g] = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

/* The visible context of the token at position p: [start, end). */
static inline void visible(int64_t p, int64_t length, int64_t window, int64_t *start, int64_t *end) {
  *end = p + 1 < length ? p + 1 : length;
  *start = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

static inline int64_t round_up(int64_t c) { return c + (CHUNK - c % CHUNK) % CHUNK; }

/* The scores of one query head against 16 keys, as one vector. */
static inline __attribute__((always_inline)) __m512 chunk_scores(const float *query, const float *const *k,
                                                                 int64_t offset, const int64_t vectors) {
  __m512 raw[CHUNK];
  for (int c = 0; c < CHUNK; c++) {
    const float *key = k[c] + offset;
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(query), _mm512_loadu_ps(key));
    for (int64_t x = 1; x < vectors; x++)
      sum = _mm512_fmadd_ps(_mm512_loadu_ps(query + 16 * x), _mm512_loadu_ps(key + 16 * x), sum);
    raw[c] = sum;
  }
  return sum16(raw);
}

/* o = inverse * sum over n positions (a multiple of CHUNK) of w[c] * v[c]. Inlined with a constant
 * `vectors`, the accumulators live in registers. */
static inline __attribute__((always_inline)) void weighted_values(const float *w, const float *const *v, int64_t offset,
                                                                  int64_t n, const int64_t vectors, float inverse,
                                                                  float *o) {
  __m512 even[MAX_VECTORS], odd[MAX_VECTORS];
  for (int64_t x = 0; x < vectors; x++) even[x] = odd[x] = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 2) {
    const __m512 w0 = _mm512_set1_ps(w[c]), w1 = _mm512_set1_ps(w[c + 1]);
    for (int64_t x = 0; x < vectors; x++) {
      even[x] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v[c] + offset + 16 * x), even[x]);
      odd[x] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v[c + 1] + offset + 16 * x), odd[x]);
    }
  }
  for (int64_t x = 0; x < vectors; x++)
    _mm512_storeu_ps(o + 16 * x, _mm512_mul_ps(_mm512_add_ps(even[x], odd[x]), _mm512_set1_ps(inverse)));
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

static __m512 chunk_scores_any(const float *query, const float *const *k, int64_t offset, int64_t vectors) {
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
    for (int64_t x = 0; x < lines; x++) _mm_prefetch((const char *)(at[c] + 16 * x), _MM_HINT_T1);
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
  float *scores = _mm_malloc(per_task * span * sizeof(float), 64);
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
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t c0 = lo; c0 < hi; c0 += CHUNK) {
      const int64_t t = c0 - lo;
      if (c0 + AHEAD * CHUNK < hi) prefetch(k + t + AHEAD * CHUNK, lines);
      prefetch(v + t, lines);  /* read after every score: by then they are in the caches */
      for (int64_t i = 0; i < Q; i++) {
        if (end[i] <= c0 || start[i] >= c0 + CHUNK) continue;  /* nothing of this chunk is visible */
        const __m512i offset = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(c0 - start[i])));
        const __mmask16 seen = _mm512_cmp_epi32_mask(offset, _mm512_setzero_si512(), _MM_CMPINT_NLT) &
                               _mm512_cmp_epi32_mask(offset, _mm512_set1_epi32((int)(end[i] - start[i])), _MM_CMPINT_LT);
        for (int64_t g = 0; g < group; g++) {
          const float *query = q + (b * Q + i) * q_stride + (g0 + g) * shared * D;
          for (int64_t r = 0; r < shared; r++) {
            const __m512 s = _mm512_mul_ps(chunk_scores_any(query + r * D, k + t, g * D, vectors), _mm512_set1_ps(scale));
            _mm512_storeu_ps(scores + ((g * Q + i) * shared + r) * span + t,
                             _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, s));
          }
        }
      }
    }
    for (int64_t j = 0; j < per_task; j++) {  /* j = (g * Q + i) * shared + r */
      const int64_t g = j / per_head, i = j % per_head / shared, r = j % shared;
      float *o = out + ((b * Q + i) * heads + (g0 + g) * shared + r) * D;
      const int64_t from = start[i] - start[i] % CHUNK - lo, to = end[i] <= start[i] ? from : round_up(end[i]) - lo;
      float *w = scores + j * span;
      __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
      for (int64_t t = from; t < to; t += CHUNK) top = _mm512_max_ps(top, _mm512_loadu_ps(w + t));
      const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(top));
      for (int64_t t = from; t < to; t += CHUNK) {
        const __m512 s = _mm512_loadu_ps(w + t);
        const __mmask16 seen = _mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(seen, exp_nonpositive(_mm512_sub_ps(s, best)));
        _mm512_storeu_ps(w + t, e);
        sum = _mm512_add_ps(sum, e);
      }
      const float total = _mm512_reduce_add_ps(sum);
      weighted_values_any(w + from, v + from, g * D, to - from, vectors, total > 0.0f ? 1.0f / total : 0.0f, o);
    }
  }
  free(k);
  _mm_free(scores);
  free(start);
}

#endif
