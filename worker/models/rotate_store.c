/* One layer's new tokens in one call, on the calling thread (rotate_store.h): the rotation and the
 * cache write. In torch that was four elementwise ops for the rotation and two index_copy_ for the
 * store, each a dispatch: ~35 us a layer at 1 row on the shipped target, ~75 us at 32 rows.
 * Built and loaded by native.py.
 */
#include "rotate_store.h"

void rotate_store(float *heads, int64_t tokens, int64_t num_heads, int64_t kv_heads, int64_t D,
                  const float *cos, const float *sin, const int64_t *rows, const int64_t *slots, int64_t n,
                  float *key_cache, float *value_cache) {
  rotate_store_in_team(heads, tokens, num_heads, kv_heads, D, cos, sin, rows, slots, n, key_cache, value_cache);
}
