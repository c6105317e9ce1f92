/* A row's softmax weights and one draw from them, included by draw_tokens.c and verify_tokens.c.
 * Weights are e^(x / T - max) in 16-lane blocks, each block's sum kept, so that a draw walks the
 * blocks first and one block's lanes last: cumulative weights summed in one fixed order, so a
 * row's token depends on its own numbers only, never on its batch. */
#ifndef SOFTMAX_DRAW_H
#define SOFTMAX_DRAW_H
#include <math.h>

#include "vec16_exp.h"

/* weights [blocks * 16] (64-byte aligned; lanes past V get 0) and block_sums [blocks] of the row x [V]
 * at temperature t; returns their total. A logit of -inf gets weight 0. */
static inline float softmax_weights(const float *x, int64_t V, float t, float *weights, float *block_sums) {
  const int64_t blocks = (V + 15) / 16;
  const f32x16 minus_inf = f32x16_broadcast(-INFINITY), tv = f32x16_broadcast(t);
  f32x16 best = minus_inf;
  for (int64_t i = 0; i < V; i += 16)
    best = f32x16_max(best, f32x16_load_masked_or(tail_mask(V - i), x + i, minus_inf));
  /* Dividing is monotone, so the largest x / T is the largest x divided by T. */
  const f32x16 top = f32x16_div(f32x16_broadcast(f32x16_reduce_max(best)), tv);
  float total = 0;
  for (int64_t b = 0; b < blocks; b++) {
    const f32x16 y = f32x16_div(f32x16_load_masked_or(tail_mask(V - b * 16), x + b * 16, minus_inf), tv);
    const mask16 finite = f32x16_ordered_not_equal(y, minus_inf);
    const f32x16 w = f32x16_keep(finite, exp_nonpositive(f32x16_sub(y, top)));
    f32x16_store_aligned(weights + b * 16, w);
    block_sums[b] = f32x16_reduce_add(w);
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
