/* One layer's new tokens: rotate the query and key heads in place (rotate-half RoPE), then store each
 * real token's keys and values at its slot of the paged cache.
 * Included by rotate_store.c (the call of its own) and decoder_layers.c (a stage of the forward).
 */
#ifndef ROTATE_STORE_H
#define ROTATE_STORE_H
#include <stdint.h>
#include <string.h>

/* heads: [tokens, heads + 2 * kv_heads, D] (queries, keys, values), dense. cos, sin: [tokens, D / 2].
 * rows: [n] the tokens to store (NULL: tokens 0 .. n - 1); slots: [n] where they go.
 * key_cache, value_cache: [slots, kv_heads, D]. The tokens are shared out among the threads of the
 * parallel region it is called in (one thread outside any region); two `omp for`, each ending in a
 * barrier, so every key is rotated before it is stored. */
static void rotate_store_in_team(float *heads, int64_t tokens, int64_t num_heads, int64_t kv_heads, int64_t D,
                                 const float *cos, const float *sin, const int64_t *rows, const int64_t *slots,
                                 int64_t n, float *key_cache, float *value_cache) {
  const int64_t half = D / 2, stride = (num_heads + 2 * kv_heads) * D;
#pragma omp for schedule(static)
  for (int64_t t = 0; t < tokens; t++) {
    const float *c = cos + t * half, *s = sin + t * half;
    for (int64_t h = 0; h < num_heads + kv_heads; h++) {
      float *x = heads + t * stride + h * D;
      for (int64_t d = 0; d < half; d++) {
        const float a = x[d], b = x[d + half];
        x[d] = a * c[d] - b * s[d];
        x[d + half] = b * c[d] + a * s[d];
      }
    }
  }
  const int64_t bytes = kv_heads * D * sizeof(float);
#pragma omp for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float *token = heads + (rows ? rows[i] : i) * stride + num_heads * D;
    memcpy(key_cache + slots[i] * kv_heads * D, token, bytes);
    memcpy(value_cache + slots[i] * kv_heads * D, token + kv_heads * D, bytes);
  }
}

#endif
