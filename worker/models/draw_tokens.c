/* One token per row drawn from softmax(logits / temperature), for float32 on AVX-512 or AVX2 CPUs.
 *
 * The torch path (sampler.py: divide, softmax, cumsum, searchsorted) makes five tensors of the
 * logits' size a step, each a fresh mapping whose pages fault in at 32 rows: ~0.6 ms a step where
 * the arithmetic needs ~0.05. Here a row is three passes over its logits and one small scratch row:
 * the maximum; the weights e^(x / T - max) with the sum of each 16-lane block; then the draw, the
 * first token whose cumulative weight exceeds u x total (u in [0, 1)), found block by block.
 * Cumulative weights are summed in one fixed order (blocks in turn, lanes in turn within the
 * chosen block), so a row's token depends on its logits, temperature and u only, never on its
 * batch. A token whose weight is 0 (a logit of -inf) is never drawn.
 * A draft step also needs the distribution it drew from (verification divides by it): given
 * `probs`, the kernel writes each row's weights / total there, one more pass over the scratch row.
 * Built and loaded by native.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector16.h"

/* logits [N, V] dense; temperature [N] (> 0); u [N] in [0, 1); tokens [N] out; probs [N, V] out, or NULL. */
void draw_tokens(const float *logits, int64_t N, int64_t V, const float *temperature, const float *u,
                 int64_t *tokens, float *probs) {
  const int64_t blocks = (V + 15) / 16;
  float *weights = _mm_malloc(blocks * 16 * sizeof(float), 64);
  float *block_sums = malloc(blocks * sizeof(float));
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t r = 0; r < N; r++) {
    const float *x = logits + r * V;
    const __m512 t = _mm512_set1_ps(temperature[r]);
    __m512 best = minus_inf;
    for (int64_t i = 0; i < V; i += 16)
      best = _mm512_max_ps(best, _mm512_mask_loadu_ps(minus_inf, tail_mask(V - i), x + i));
    /* Dividing is monotone, so the largest x / T is the largest x divided by T. */
    const __m512 top = _mm512_div_ps(_mm512_set1_ps(_mm512_reduce_max_ps(best)), t);
    for (int64_t b = 0; b < blocks; b++) {
      const __m512 y = _mm512_div_ps(_mm512_mask_loadu_ps(minus_inf, tail_mask(V - b * 16), x + b * 16), t);
      const __mmask16 finite = _mm512_cmp_ps_mask(y, minus_inf, _CMP_NEQ_OQ);
      const __m512 w = _mm512_maskz_mov_ps(finite, exp_nonpositive(_mm512_sub_ps(y, top)));
      _mm512_store_ps(weights + b * 16, w);
      block_sums[b] = _mm512_reduce_add_ps(w);
    }
    float total = 0;
    for (int64_t b = 0; b < blocks; b++) total += block_sums[b];
    if (probs) {
      const __m512 scale = _mm512_set1_ps(1.0f / total);
      for (int64_t i = 0; i < V; i += 16)
        _mm512_mask_storeu_ps(probs + r * V + i, tail_mask(V - i),
                              _mm512_mul_ps(_mm512_loadu_ps(weights + i), scale));
    }
    float target = u[r] * total;
    if (target >= total) target = nextafterf(total, 0);  /* u just below 1 may round up to the total */
    /* The block whose end passes the target: its start is at most the target, its end above it
     * (the last block's end is the total). Within it, the lane whose cumulative weight passes
     * the target; rounding inside a block can leave the lanes' sum a hair short of the block's
     * sum, so then its last lane of non-zero weight. */
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
    tokens[r] = token;
  }
  free(block_sums);
  _mm_free(weights);
}
