/* Decode attention with the queries in vector lanes: where several rows read the same keys (rows
 * decoding after one cached prefix, or a row's verified tokens), one pass over a chunk's 16 keys
 * scores up to 16 queries, query j in lane j, and one pass over the values sums them for 16 queries.
 * Every sum is the one paged_attention.h's trees take, to the bit. Scores: for key c, lane l of
 * chunk_scores' product vector is the sum over x of q[16x + l] * k[16x + l] (a product, then fused
 * adds in x's order); here that sum is taken for all queries at once (q transposed: qt[16x + l] is
 * the vector of the queries' element 16x + l), and the 16 sums are added in sum16's tree as whole
 * vectors. Nothing crosses lanes until a transpose hands each query its 16 scores. Weighted values:
 * the same fused adds as weighted_values', even and odd positions apart, each query's in its lane.
 * Included by paged_attention.h.
 */
#ifndef QUERY_LANES_H
#define QUERY_LANES_H
#include "vec16.h"

#define LANES 16

static inline int64_t lane_sets(int64_t queries) { return (queries + LANES - 1) / LANES; }

/* The order sum16 adds a vector's 16 lanes in, on whole vectors: lanes 4Q..4Q+3 as
 * (p0 + p2) + (p1 + p3), then quarters as (Q0 + Q1) + (Q2 + Q3). */
ALWAYS_INLINE f32x16 quarter_sum(const f32x16 p[4]) {
  return f32x16_add(f32x16_add(p[0], p[2]), f32x16_add(p[1], p[3]));
}

ALWAYS_INLINE f32x16 tree_sum(const f32x16 p[16]) {
  return f32x16_add(f32x16_add(quarter_sum(p), quarter_sum(p + 4)), f32x16_add(quarter_sum(p + 8), quarter_sum(p + 12)));
}

/* The score of each lane's query against one key: qt [D][LANES], key [D], D = 16 * vectors. */
ALWAYS_INLINE f32x16 lane_scores(const float *qt, const float *key, const int64_t vectors) {
  f32x16 p[16];
  for (int l = 0; l < 16; l++) {
    f32x16 sum = f32x16_mul(f32x16_load(qt + l * LANES), f32x16_broadcast(key[l]));
    for (int64_t x = 1; x < vectors; x++)
      sum = f32x16_fmadd(f32x16_load(qt + (16 * x + l) * LANES), f32x16_broadcast(key[16 * x + l]), sum);
    p[l] = vectors == 1 ? f32x16_unfused(sum) : sum;  /* chunk_scores' lone products are not fused */
  }
  return tree_sum(p);
}

/* r[c] lane j -> r[j] lane c, in place: interleaves within quarters, then moves whole quarters. */
ALWAYS_INLINE void transpose16(f32x16 r[16]) {
  f32x16 t[16], u[16];
  for (int a = 0; a < 16; a += 2) {  /* per quarter: r[a] r[a+1] element 0, 1 | 2, 3 */
    t[a] = f32x16_interleave_lo(r[a], r[a + 1]);
    t[a + 1] = f32x16_interleave_hi(r[a], r[a + 1]);
  }
  for (int a = 0; a < 16; a += 4) {  /* u[a + e]: per quarter, element e of r[a .. a+3] */
    u[a] = f32x16_low_pairs(t[a], t[a + 2]);
    u[a + 1] = f32x16_high_pairs(t[a], t[a + 2]);
    u[a + 2] = f32x16_low_pairs(t[a + 1], t[a + 3]);
    u[a + 3] = f32x16_high_pairs(t[a + 1], t[a + 3]);
  }
  for (int e = 0; e < 4; e++) {  /* quarter Q of u[4g + e] is rows 4g..4g+3 of column 4Q + e */
    const f32x16 even01 = f32x16_even_quarters(u[e], u[4 + e]), even23 = f32x16_even_quarters(u[8 + e], u[12 + e]);
    const f32x16 odd01 = f32x16_odd_quarters(u[e], u[4 + e]), odd23 = f32x16_odd_quarters(u[8 + e], u[12 + e]);
    r[e] = f32x16_even_quarters(even01, even23);
    r[8 + e] = f32x16_odd_quarters(even01, even23);
    r[4 + e] = f32x16_even_quarters(odd01, odd23);
    r[12 + e] = f32x16_odd_quarters(odd01, odd23);
  }
}

static void chunk_lane_scores_n(const float *qt, const float *const *k, int64_t offset, int64_t vectors,
                                f32x16 scores[CHUNK]) {
  switch (vectors) {  /* as chunk_scores_any */
    case 1: for (int c = 0; c < CHUNK; c++) scores[c] = lane_scores(qt, k[c] + offset, 1); break;
    case 2: for (int c = 0; c < CHUNK; c++) scores[c] = lane_scores(qt, k[c] + offset, 2); break;
    case 4: for (int c = 0; c < CHUNK; c++) scores[c] = lane_scores(qt, k[c] + offset, 4); break;
    case 8: for (int c = 0; c < CHUNK; c++) scores[c] = lane_scores(qt, k[c] + offset, 8); break;
    default: for (int c = 0; c < CHUNK; c++) scores[c] = lane_scores(qt, k[c] + offset, vectors);
  }
}

/* The 16 keys' scores of each lane's query (qt as lane_scores'), times scale: scores[j] lane c is
 * query j's against key c. */
static void chunk_lane_scores(const float *qt, const float *const *k, int64_t offset, int64_t vectors, float scale,
                              f32x16 scores[CHUNK]) {
  chunk_lane_scores_n(qt, k, offset, vectors, scores);
  for (int c = 0; c < CHUNK; c++) scores[c] = f32x16_mul(scores[c], f32x16_broadcast(scale));
  transpose16(scores);
}

/* Dimensions of the values one pass over the positions sums: two accumulators a dimension (even and
 * odd positions, as weighted_values) and room for the weights. */
#define VALUE_DIMS (F32X16_REGISTERS / 4)

/* The weighted values' sums over positions [0, n) (a multiple of CHUNK) of each lane's query, the
 * sums weighted_values (paged_attention.h) starts with, to the bit: for dimension d, the fused
 * adds of w[c] * v[c][d] over the even positions in order, and over the odd ones. Here the queries'
 * weights are transposed into lanes (wt: scratch of n * LANES floats), and each pass over the
 * positions sums VALUE_DIMS dimensions for every lane. w[l]: lane l's weights; v[c] + offset: the
 * values at position c; sums[l]: lane l's even sums, then its odd ones (2 * D floats). */
static void lane_weighted_sums(const float *const *w, int64_t lanes, const float *const *v, int64_t offset,
                               int64_t n, int64_t D, float *wt, float *const *sums) {
  for (int64_t t = 0; t < n; t += CHUNK) {
    f32x16 r[LANES];
    for (int64_t l = 0; l < LANES; l++) r[l] = l < lanes ? f32x16_load(w[l] + t) : f32x16_zero();
    transpose16(r);
    for (int c = 0; c < CHUNK; c++) f32x16_store(wt + (t + c) * LANES, r[c]);
  }
  for (int64_t d0 = 0; d0 < D; d0 += VALUE_DIMS) {
    f32x16 even[VALUE_DIMS], odd[VALUE_DIMS];
    for (int k = 0; k < VALUE_DIMS; k++) even[k] = odd[k] = f32x16_zero();
    for (int64_t c = 0; c < n; c += 2) {
      const f32x16 w0 = f32x16_load(wt + c * LANES), w1 = f32x16_load(wt + (c + 1) * LANES);
      const float *v0 = v[c] + offset + d0, *v1 = v[c + 1] + offset + d0;
      for (int k = 0; k < VALUE_DIMS; k++) {
        even[k] = f32x16_fmadd(w0, f32x16_broadcast(v0[k]), even[k]);
        odd[k] = f32x16_fmadd(w1, f32x16_broadcast(v1[k]), odd[k]);
      }
    }
    float by_lane[2][VALUE_DIMS][LANES];
    for (int k = 0; k < VALUE_DIMS; k++) {
      f32x16_store(by_lane[0][k], even[k]);
      f32x16_store(by_lane[1][k], odd[k]);
    }
    for (int64_t l = 0; l < lanes; l++)
      for (int k = 0; k < VALUE_DIMS; k++) {
        sums[l][d0 + k] = by_lane[0][k][l];
        sums[l][D + d0 + k] = by_lane[1][k][l];
      }
  }
}

#endif
