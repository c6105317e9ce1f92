/* Verification of sampled rows' draft proposals from the target's logits, for float32 on AVX-512 or
 * AVX2 CPUs: what engine/spec_decode.py's verify does for rows that sample at a temperature only.
 *
 * The torch path takes the softmax of all k + 1 positions of every row, then some thirty small ops
 * (0.9 ms a step at 1 row, k = 4). Here a row takes the softmax of a position only while its
 * proposals are accepted: position i accepts proposal d when u_i q_i(d) < p_i(d); at the first
 * rejection the row's next token is drawn from max(0, p_i - q_i) (from p_i where that has no mass),
 * and when all k are accepted, from p_k (the bonus). The same law as the torch path, from the same
 * uniforms; the last bits of p differ, so a decision that close to its threshold may differ.
 * The body is here, its softmax and draws in softmax_draw.h. Built by native.py, called through
 * verify_tokens.py, on the calling thread. Returns 0, or KERNEL_OUT_OF_MEMORY where its scratch rows
 * could not be allocated (nothing written then).
 */
#include <stdlib.h>

#include "softmax_draw.h"

/* draft [N, k]; q [N, k, V] the draft's probabilities; logits [N, k + 1, V]; temperature [N] (> 0);
 * u_accept [N, k], u_next [N] in [0, 1). Out: num_accepted [N]; tokens [N, k + 1], of which row r
 * emits the first num_accepted[r] + 1 (the rest hold proposals, as the torch path leaves them). */
int verify_tokens(const int64_t *draft, const float *q, const float *logits, int64_t N, int64_t k, int64_t V,
                   const float *temperature, const float *u_accept, const float *u_next, int64_t *num_accepted,
                   int64_t *tokens) {
  const int64_t blocks = (V + 15) / 16;
  float *weights = aligned_floats(blocks * 16);
  float *residual = aligned_floats(blocks * 16);
  float *block_sums = malloc(blocks * sizeof(float));
  float *residual_sums = malloc(blocks * sizeof(float));
  if (!weights || !residual || !block_sums || !residual_sums) {
    free(residual_sums);
    free(block_sums);
    free(residual);
    free(weights);
    return KERNEL_OUT_OF_MEMORY;
  }
  for (int64_t r = 0; r < N; r++) {
    const int64_t *d = draft + r * k;
    int64_t n = 0;
    float total;
    for (;; n++) {
      total = softmax_weights(logits + (r * (k + 1) + n) * V, V, temperature[r], weights, block_sums);
      if (n == k || !(u_accept[r * k + n] * q[(r * k + n) * V + d[n]] < weights[d[n]] / total)) break;
    }
    int64_t next = -1;
    if (n < k) { /* rejected: the residual max(0, p - q), its lanes past V 0 as p's are */
      const float *qn = q + (r * k + n) * V;
      const f32x16 scale = f32x16_broadcast(1.0f / total), zero = f32x16_zero();
      float residual_total = 0;
      for (int64_t b = 0; b < blocks; b++) {
        const f32x16 p = f32x16_mul(f32x16_load(weights + b * 16), scale);
        const f32x16 w = f32x16_max(zero, f32x16_sub(p, f32x16_load_masked(tail_mask(V - b * 16), qn + b * 16)));
        f32x16_store_aligned(residual + b * 16, w);
        residual_sums[b] = f32x16_reduce_add(w);
      }
      for (int64_t b = 0; b < blocks; b++) residual_total += residual_sums[b];
      if (residual_total > 0) next = draw_from_weights(residual, residual_sums, V, residual_total, u_next[r]);
    }
    if (next < 0) next = draw_from_weights(weights, block_sums, V, total, u_next[r]); /* p == q, or the bonus */
    int64_t *out = tokens + r * (k + 1);
    for (int64_t i = 0; i < k; i++) out[i] = d[i];
    out[k] = d[0];
    out[n] = next;
    num_accepted[r] = n;
  }
  free(residual_sums);
  free(block_sums);
  free(residual);
  free(weights);
  return 0;
}
