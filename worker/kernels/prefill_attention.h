/* Prefill attention for float32: a prompt's chunk, many query tokens a row, over the paged cache (the
 * cached prefix, earlier chunks and the chunk's own keys, stored before), read where it sits.
 *
 * What it computes is paged_attention.h's: for query token i of row b (at position p), head h, softmax
 * over the visible positions c of scale * (q . K[slot]), weighting V[slot], slot = slots[b, c]. That
 * kernel sums each score's dot product in a tree, cheap for the few tokens of a decode or verify step;
 * for hundreds of tokens a row the work is two matmuls, and here it is done as matmuls. A task is a
 * tile of up to TILE_ROWS query rows (a token's head each) that read one key/value head, a row a lane:
 * their scores against POSITIONS keys at a time take each key element broadcast times each d of the
 * queries as one vector; the softmax runs down the positions with every row in its own lane (maximum,
 * e^x and sum, no reduction across lanes); the weighted values are a second small matmul, a few rows x
 * head_dim accumulators in registers, each value vector loaded once for them all.
 *
 * A row's bits depend on its own visible range only: scores sum over d in order, the softmax and the
 * values run over positions in order, and positions a row does not see (its tile's other rows see them)
 * add exact zeros. So a token prefilled in one chunk or another, alone or in a batch, on one thread or
 * two, gives the same bits (not the decode kernel's, whose sums are trees). Included by
 * prefill_attention.c (the call of its own) and decoder_layers.c (a stage of the forward).
 */
#ifndef PREFILL_ATTENTION_H
#define PREFILL_ATTENTION_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "paged_attention.h"
#include "vec16_exp.h"

#if F32X16_REGISTERS >= 32
#define LANE_VECTORS 2        /* a tile's rows: two vectors of lanes */
#define POSITIONS 12          /* keys a score step takes: 12 x 2 accumulators */
#define VALUE_ACCUMULATORS 16 /* rows x head_dim / 16 of a values pass */
#else
#define LANE_VECTORS 1 /* AVX2's registers hold 8 vectors */
#define POSITIONS 4
#define VALUE_ACCUMULATORS 4
#endif
#define TILE_ROWS (16 * LANE_VECTORS)

/* acc[p] = the scores (unscaled) of the tile's queries qt [D][TILE_ROWS] against key k[p] (D floats). */
ALWAYS_INLINE void score_step(const float *qt, const float *const *k, int64_t D,
                              f32x16 acc[POSITIONS][LANE_VECTORS]) {
  for (int p = 0; p < POSITIONS; p++)
    for (int v = 0; v < LANE_VECTORS; v++) acc[p][v] = f32x16_zero();
  for (int64_t d = 0; d < D; d++) {
    f32x16 query[LANE_VECTORS];
    for (int v = 0; v < LANE_VECTORS; v++) query[v] = f32x16_load(qt + d * TILE_ROWS + 16 * v);
    for (int p = 0; p < POSITIONS; p++) {
      const f32x16 key = f32x16_broadcast(k[p][d]);
      for (int v = 0; v < LANE_VECTORS; v++) acc[p][v] = f32x16_fmadd(key, query[v], acc[p][v]);
    }
  }
}

/* scores [n][TILE_ROWS]: position lo + c of lane j is scale * (q_j . k[c]) where first[j] <= lo + c <
 * end[j], else -inf. n is a multiple of POSITIONS. */
static void tile_scores(const float *qt, const float *const *k, int64_t n, int64_t lo, int64_t D, float scale,
                        const float *first, const float *end, float *scores) {
  f32x16 firsts[LANE_VECTORS], ends[LANE_VECTORS];
  for (int v = 0; v < LANE_VECTORS; v++) {
    firsts[v] = f32x16_load(first + 16 * v);
    ends[v] = f32x16_load(end + 16 * v);
  }
  for (int64_t c = 0; c < n; c += POSITIONS) {
    f32x16 acc[POSITIONS][LANE_VECTORS];
    score_step(qt, k + c, D, acc);
    for (int p = 0; p < POSITIONS; p++) {
      const f32x16 at = f32x16_broadcast((float)(lo + c + p));
      for (int v = 0; v < LANE_VECTORS; v++) {
        const mask16 seen = (mask16)~f32x16_less(at, firsts[v]) & f32x16_less(at, ends[v]);
        f32x16_store(scores + (c + p) * TILE_ROWS + 16 * v,
                     f32x16_select(seen, f32x16_mul(acc[p][v], f32x16_broadcast(scale)),
                                   f32x16_broadcast(-INFINITY)));
      }
    }
  }
}

/* The scores of n positions become weights e^(s - max), in place; inverse[j] = 1 / lane j's sum (0 for
 * a lane that sees nothing). */
static void tile_softmax(float *scores, int64_t n, float *inverse) {
  f32x16 top[LANE_VECTORS], sum[LANE_VECTORS];
  for (int v = 0; v < LANE_VECTORS; v++) {
    top[v] = f32x16_broadcast(-INFINITY);
    sum[v] = f32x16_zero();
  }
  for (int64_t c = 0; c < n; c++)
    for (int v = 0; v < LANE_VECTORS; v++) top[v] = f32x16_max(top[v], f32x16_load(scores + c * TILE_ROWS + 16 * v));
  for (int64_t c = 0; c < n; c++)
    for (int v = 0; v < LANE_VECTORS; v++) {
      float *at = scores + c * TILE_ROWS + 16 * v;
      const f32x16 s = f32x16_load(at);
      const mask16 seen = f32x16_ordered_not_equal(s, f32x16_broadcast(-INFINITY));
      const f32x16 e = f32x16_keep(seen, exp_nonpositive(f32x16_sub(s, top[v])));
      f32x16_store(at, e);
      sum[v] = f32x16_add(sum[v], e);
    }
  for (int v = 0; v < LANE_VECTORS; v++) f32x16_store(inverse + 16 * v, sum[v]);
  for (int j = 0; j < TILE_ROWS; j++) inverse[j] = inverse[j] > 0.0f ? 1.0f / inverse[j] : 0.0f;
}

/* out[r] = inverse[j0 + r] * sum over n positions of weights[c][j0 + r] * v[c], for `rows` rows (at most
 * VALUE_ACCUMULATORS / vectors, or 1) of `vectors` x 16 values. Inlined with constant rows and vectors,
 * the accumulators live in registers. */
ALWAYS_INLINE void weigh_values(const float *weights, const float *const *v, int64_t n, int64_t j0, const int64_t rows,
                                const int64_t vectors, const float *inverse, float *const *out) {
  f32x16 acc[16];
  for (int64_t a = 0; a < rows * vectors; a++) acc[a] = f32x16_zero();
  for (int64_t c = 0; c < n; c++) {
    f32x16 value[8];
    for (int64_t x = 0; x < vectors; x++) value[x] = f32x16_load(v[c] + 16 * x);
    for (int64_t r = 0; r < rows; r++) {
      const f32x16 w = f32x16_broadcast(weights[c * TILE_ROWS + j0 + r]);
      for (int64_t x = 0; x < vectors; x++) acc[r * vectors + x] = f32x16_fmadd(w, value[x], acc[r * vectors + x]);
    }
  }
  for (int64_t r = 0; r < rows; r++)
    if (out[r])
      for (int64_t x = 0; x < vectors; x++)
        f32x16_store(out[r] + 16 * x, f32x16_mul(acc[r * vectors + x], f32x16_broadcast(inverse[j0 + r])));
}

/* Rows a values pass takes: a power of two (so that passes tile TILE_ROWS), at most
 * VALUE_ACCUMULATORS / vectors, at least 1. */
static inline int64_t value_rows(int64_t vectors) {
  int64_t rows = 1;
  while (2 * rows * vectors <= VALUE_ACCUMULATORS) rows *= 2;
  return rows;
}

/* Every row of the tile; out[j] NULL for lanes past its rows (rows fill the first lanes). */
static void tile_values(const float *weights, const float *const *v, int64_t n, int64_t vectors,
                        const float *inverse, float *const *out) {
  const int64_t rows = value_rows(vectors);
  for (int64_t j0 = 0; j0 < TILE_ROWS && out[j0]; j0 += rows) {
    switch (vectors) {  /* the head sizes models use, each with its accumulators in registers */
      case 1: weigh_values(weights, v, n, j0, VALUE_ACCUMULATORS, 1, inverse, out + j0); break;
      case 2: weigh_values(weights, v, n, j0, VALUE_ACCUMULATORS / 2, 2, inverse, out + j0); break;
      case 4: weigh_values(weights, v, n, j0, VALUE_ACCUMULATORS >= 4 ? VALUE_ACCUMULATORS / 4 : 1, 4, inverse,
                           out + j0); break;
      case 8: weigh_values(weights, v, n, j0, VALUE_ACCUMULATORS >= 8 ? VALUE_ACCUMULATORS / 8 : 1, 8, inverse,
                           out + j0); break;
      default: weigh_values(weights, v, n, j0, rows, vectors, inverse, out + j0);
    }
  }
}

/* Arguments as paged_attention_in_team's: q: token t = b * Q + i at q + t * q_stride, head h at + h * D;
 * keys, values: [slots, kv_heads, D]; slots: [B, C]; positions: [B, Q]; lengths: [B]; out: [B, Q, heads,
 * D]. D % 16 == 0, D <= 128. Run by every thread of the parallel region it is called in (an `omp for`,
 * ending in a barrier). A thread whose scratch cannot be allocated sets *failed (KERNEL_OUT_OF_MEMORY;
 * shared by the team) and skips its tiles, still meeting the others at the barrier. */
static void prefill_attention_in_team(const float *q, int64_t q_stride, const float *keys, const float *values,
                                      const int64_t *slots, const int64_t *positions, const int64_t *lengths,
                                      int64_t B, int64_t Q, int64_t C, int64_t heads, int64_t kv_heads, int64_t D,
                                      int64_t window, float scale, float *out, int *failed) {
  const int64_t shared = heads / kv_heads, rows = Q * shared, tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
  const int64_t span = C + POSITIONS;  /* the most positions a tile's score steps cover */
  /* Per thread, reused by its tiles: where each position's keys and values sit, the scores (then
   * weights), the tile's queries transposed, each lane's visible range and output row. */
  const float **k = malloc(2 * span * sizeof(float *));
  float *scores = aligned_floats(span * TILE_ROWS + (D + 3) * TILE_ROWS);
  float *row_out[TILE_ROWS];
  const int ready = k && scores;
  if (!ready) {
#pragma omp atomic write
    *failed = KERNEL_OUT_OF_MEMORY;
  }
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < B * kv_heads * tiles; task++) {
    if (!ready) continue;
    const float **v = k + span;
    float *qt = scores + span * TILE_ROWS, *first = qt + D * TILE_ROWS, *end = first + TILE_ROWS;
    float *inverse = end + TILE_ROWS;
    const int64_t b = task / (kv_heads * tiles), g = task / tiles % kv_heads, j0 = task % tiles * TILE_ROWS;
    int64_t lo = C, hi = 0;
    for (int64_t j = 0; j < TILE_ROWS; j++) {
      row_out[j] = NULL;
      first[j] = end[j] = 0.0f;  /* a lane past the rows sees nothing */
      for (int64_t d = 0; d < D; d++) qt[d * TILE_ROWS + j] = 0.0f;
      if (j0 + j >= rows) continue;
      const int64_t i = (j0 + j) / shared, h = g * shared + (j0 + j) % shared, t = b * Q + i;
      int64_t start, stop;
      visible(positions[t], lengths[b], window, &start, &stop);
      if (stop <= start) start = stop = 0;
      first[j] = (float)start;
      end[j] = (float)stop;
      lo = start < lo ? start : lo;
      hi = stop > hi ? stop : hi;
      for (int64_t d = 0; d < D; d++) qt[d * TILE_ROWS + j] = q[t * q_stride + h * D + d];
      row_out[j] = out + (t * heads + h) * D;
    }
    if (hi <= lo) lo = hi = 0;
    const int64_t n = (hi - lo + POSITIONS - 1) / POSITIONS * POSITIONS;
    for (int64_t c = 0; c < n; c++) {  /* past the context: any slot, those lanes are masked */
      const int64_t at = (slots[b * C + (lo + c < C ? lo + c : C - 1)] * kv_heads + g) * D;
      k[c] = keys + at;
      v[c] = values + at;
    }
    tile_scores(qt, k, n, lo, D, scale, first, end, scores);
    tile_softmax(scores, n, inverse);
    tile_values(scores, v, hi - lo, D / 16, inverse, row_out);
  }
  free(k);
  free(scores);
}

#endif
