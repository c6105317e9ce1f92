/* One layer's new tokens in one call, on the calling thread: the rotation and the cache write, whose
 * body is rotate_store_in_team in rotate_store.h (decoder_layers.c runs it as a stage). In torch that was
 * four elementwise ops for the rotation and two index_copy_ for the store, each a dispatch: ~35 us a
 * layer at 1 row on the shipped target, ~75 us at 32 rows. Built by native.py, called through
 * rotate_store.py.
 */
#include "rotate_store.h"

void rotate_store(float *heads, int64_t tokens, int64_t num_heads, int64_t kv_heads, int64_t D,
                  const float *cos, const float *sin, const int64_t *rows, const int64_t *slots, int64_t n,
                  float *key_cache, float *value_cache) {
  rotate_store_in_team(heads, tokens, num_heads, kv_heads, D, cos, sin, rows, slots, n, key_cache, value_cache);
}
