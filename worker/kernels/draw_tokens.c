/* One token per row drawn from softmax(logits / temperature), for float32 on AVX-512 or AVX2 CPUs.
 *
 * The torch path (engine/sampler.py: divide, softmax, cumsum, searchsorted) makes five tensors of the
 * logits' size a step, each a fresh mapping whose pages fault in at 32 rows: ~0.6 ms a step where
 * the arithmetic needs ~0.05. Here a row is three passes over its logits and one small scratch row
 * (softmax_draw.h): the maximum; the weights with the sum of each 16-lane block; then the draw.
 * A draft step also needs the distribution it drew from (verification divides by it): given
 * `probs`, the kernel writes each row's weights / total there, one more pass over the scratch row.
 * The body is here, its softmax and draw in softmax_draw.h. Built by native.py, called through
 * draw_tokens.py, on the calling thread. Returns 0, or KERNEL_OUT_OF_MEMORY where its scratch row
 * could not be allocated (nothing written then).
 */
#include <stdlib.h>

#include "softmax_draw.h"

/* logits [N, V] dense; temperature [N] (> 0); u [N] in [0, 1); tokens [N] out; probs [N, V] out, or NULL. */
int draw_tokens(const float *logits, int64_t N, int64_t V, const float *temperature, const float *u,
                 int64_t *tokens, float *probs) {
  const int64_t blocks = (V + 15) / 16;
  float *weights = aligned_floats(blocks * 16);
  float *block_sums = malloc(blocks * sizeof(float));
  if (!weights || !block_sums) {
    free(block_sums);
    free(weights);
    return KERNEL_OUT_OF_MEMORY;
  }
  for (int64_t r = 0; r < N; r++) {
    const float total = softmax_weights(logits + r * V, V, temperature[r], weights, block_sums);
    if (probs) {
      const f32x16 scale = f32x16_broadcast(1.0f / total);
      for (int64_t i = 0; i < V; i += 16)
        f32x16_store_masked(probs + r * V + i, tail_mask(V - i), f32x16_mul(f32x16_load(weights + i), scale));
    }
    tokens[r] = draw_from_weights(weights, block_sums, V, total, u[r]);
  }
  free(block_sums);
  free(weights);
  return 0;
}
