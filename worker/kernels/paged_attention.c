/* Decode and verify attention over the paged cache in a parallel region of its own: the body is
 * paged_attention_in_team in paged_attention.h (decoder_layers.c runs it as a stage). Built by native.py,
 * called through paged_attention.py; threads come from torch's OpenMP pool. Returns 0, or
 * KERNEL_OUT_OF_MEMORY where a thread's scratch could not be allocated (out is then not to be read).
 */
#include "paged_attention.h"

int paged_attention(const float *q, int64_t q_stride, const float *keys, const float *values,
                     const int64_t *slots, const int64_t *positions, const int64_t *lengths, int64_t B,
                     int64_t Q, int64_t C, int64_t heads, int64_t kv_heads, int64_t D, int64_t window,
                     float scale, float *out, int threads) {
  int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
  paged_attention_in_team(q, q_stride, keys, values, slots, positions, lengths, B, Q, C, heads, kv_heads, D,
                          window, scale, out, &failed);
  return failed;
}
