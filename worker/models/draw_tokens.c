/* One token per row drawn from softmax(logits / temperature), for float32 on AVX-512 or AVX2 CPUs.
 *
 * The torch path (sampler.py: divide, softmax, cumsum, searchsorted) makes five tensors of the
 * logits' size a step, each a fresh mapping whose pages fault in at 32 rows: ~0.6 ms a step where
 * the arithmetic needs ~0.05. Here a row is three passes over its logits and one small scratch row
 * (softmax_draw.h): the maximum; the weights with the sum of each 16-lane block; then the draw.
 * A draft step also needs the distribution it drew from (verification divides by it): given
 * `probs`, the kernel writes each row's weights / total there, one more pass over the scratch row.
 * Built and loaded by native.py.
 */
#include <stdlib.h>

#include "softmax_draw.h"

/* logits [N, V] dense; temperature [N] (> 0); u [N] in [0, 1); tokens [N] out; probs [N, V] out, or NULL. */
void draw_tokens(const float *logits, int64_t N, int64_t V, const float *temperature, const float *u,
                 int64_t *tokens, float *probs) {
  const int64_t blocks = (V + 15) / 16;
  float *weights = _mm_malloc(blocks * 16 * sizeof(float), 64);
  float *block_sums = malloc(blocks * sizeof(float));
  for (int64_t r = 0; r < N; r++) {
    const float total = softmax_weights(logits + r * V, V, temperature[r], weights, block_sums);
    if (probs) {
      const __m512 scale = _mm512_set1_ps(1.0f / total);
      for (int64_t i = 0; i < V; i += 16)
        _mm512_mask_storeu_ps(probs + r * V + i, tail_mask(V - i),
                              _mm512_mul_ps(_mm512_loadu_ps(weights + i), scale));
    }
    tokens[r] = draw_from_weights(weights, block_sums, V, total, u[r]);
  }
  free(block_sums);
  _mm_free(weights);
}
