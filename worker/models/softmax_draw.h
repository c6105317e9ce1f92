/* A row's softmax weights and one draw from them, shared by draw_tokens.c and verify_tokens.c.
 * Weights are e^(x / T - max) in 16-lane blocks, each block's sum kept, so that a draw walks the
 * blocks first and one block's lanes last: cumulative weights summed in one fixed order, so a
 * row's token depends on its own numbers only, never on its batch. */
#ifndef SOFTMAX_DRAW_H
#define SOFTMAX_DRAW_H
#include <math.h>

#include "vector16.h"

/* weights [blocks * 16] (64-byte aligned; lanes past V get 0) and block_sums [blocks] of the row x [V]
 * at temperature t; returns their total. A logit of -inf gets weight 0. */
static inline float softmax_weights(const float *x, int64_t V, float t, float *weights, float *block_sums) {
  const int64_t blocks = (V + 15) / 16;
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY), tv = _mm512_set1_ps(t);
  __m512 best = minus_inf;
  for (int64_t i = 0; i < V; i += 16)
    best = _mm512_max_ps(best, _mm512_mask_loadu_ps(minus_inf, tail_mask(V - i), x + i));
  /* Dividing is monotone, so the largest x / T is the largest x divided by T. */
  const __m512 top = _mm512_div_ps(_mm512_set1_ps(_mm512_reduce_max_ps(best)), tv);
  float total = 0;
  for (int64_t b = 0; b < blocks; b++) {
    const __m512 y = _mm512_div_ps(_mm512_mask_loadu_ps(minus_inf, tail_mask(V - b * 16), x + b * 16), tv);
    const __mmask16 finite = _mm512_cmp_ps_mask(y, minus_inf, _CMP_NEQ_OQ);
    const __m512 w = _mm512_maskz_mov_ps(finite, exp_nonpositive(_mm512_sub_ps(y, top)));
    _mm512_store_ps(weights + b * 16, w);
    block_sums[b] = _mm512_reduce_add_ps(w);
  }
  for (int64_t b = 0; b < blocks; b++) total += block_sums[b];
  return total;
}

/* The first token whose cumulative weight exceeds u x total (u in [0, 1)); a token of weight 0 is
 * never drawn. The block whose end passes the target comes first (the last block's end is the
 * total); within it, the lane whose cumulative weight passes it. Rounding inside a block can leave
 * the lanes' sum a hair short of the block's sum: then its last lane of non-zero weight. */
static inline int64_t draw_from_weights(const float *weights, const float *block_sums, int64_t V, float total,
                                        float u) {
  const int64_t blocks = (V + 15) / 16;
  float target = u * total;
  if (target >= total) target = nextafterf(total, 0); /* u just below 1 may round up to the total */
  float start = 0;
  int64_t b = 0;
  while (b < blocks - 1 && start + block_sums[b] <= target) start += block_sums[b++];
  int64_t token = -1;
  for (int64_t i = b * 16; i < b * 16 + 16 && i < V; i++) {
    if (weights[i] == 0) continue;
    token = i;
    start += weights[i];
    if (start > target) break;
  }
  return token;
}

#endif
