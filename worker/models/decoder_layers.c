/* Every decoder layer of a decode or verify step in one call and one parallel region, for float32 on
 * AVX-512 or AVX2 CPUs: per layer RMSNorm, the q/k/v matmul, RoPE and the cache write, paged attention, the
 * output matmul plus the residual, RMSNorm, the gate/up matmul, SiLU(gate) x up, the down matmul
 * plus the residual. Each stage is an `omp for` of the kernels' headers, so threads meet at a
 * barrier between stages instead of starting a region and returning to Python for each one (a
 * step of the shipped target made ~13 calls a layer). Every stage computes what its own kernel
 * computes, to the bit, save SiLU: rows keep their bits alone and in a batch.
 * Built and loaded by native.py; threads come from torch's OpenMP pool.
 */
#include <immintrin.h>
#include <stdint.h>

#include "blocked_linear.h"
#include "paged_attention.h"
#include "rms_norm.h"
#include "rotate_store.h"
#include "vector16.h"

/* One layer's weights: matmul weights blocked ([out / 16, in, 16]); a bias may be NULL. */
struct layer {
  const float *input_norm, *qkv, *qkv_bias, *o, *o_bias, *post_norm, *gate_up, *gate_up_bias, *down, *down_bias;
  int64_t window; /* sliding window in positions; 0: none */
};

/* act[r, i] = silu(g) * u with g = gate_up[r, i], u = gate_up[r, inner + i]; silu(g) = g / (1 + e^-g),
 * from e^-|g| so that the exponent never overflows. */
static void silu_mul_in_team(const float *gate_up, int64_t rows, int64_t inner, float *act) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    const float *gate = gate_up + r * 2 * inner, *up = gate + inner;
    for (int64_t i = 0; i < inner; i += 16) {
      const __mmask16 m = tail_mask(inner - i);
      const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
      const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
      const __m512 sigmoid = _mm512_div_ps(_mm512_mask_mov_ps(_mm512_set1_ps(1.0f), negative, e),
                                           _mm512_add_ps(_mm512_set1_ps(1.0f), e));
      _mm512_mask_storeu_ps(act + i + r * inner, m,
                            _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), _mm512_maskz_loadu_ps(m, up + i)));
    }
  }
}

/* x: [B * Q, hidden], updated in place. cos, sin: [B * Q, D / 2]. write_rows (NULL: all), write_slots:
 * [writes] as rotate_store. keys, values: layer 0's [slots, kv_heads, D], each next layer layer_stride
 * floats on. slots [B, C], positions [B, Q], lengths [B] as paged_attention. work: scratch of
 * B * Q * (hidden + (heads + 2 kv_heads) D + heads D + 3 inner) floats. */
void decoder_layers(const struct layer *layers, int64_t num_layers, float *x, int64_t B, int64_t Q, int64_t hidden,
                    int64_t heads, int64_t kv_heads, int64_t D, int64_t inner, float eps, const float *cos,
                    const float *sin, const int64_t *write_rows, const int64_t *write_slots, int64_t writes,
                    float *keys, float *values, int64_t layer_stride, const int64_t *slots,
                    const int64_t *positions, const int64_t *lengths, int64_t C, float scale, float *work,
                    int threads) {
  const int64_t M = B * Q, width = (heads + 2 * kv_heads) * D;
  float *normed = work, *qkv = normed + M * hidden, *attended = qkv + M * width;
  float *gate_up = attended + M * heads * D, *act = gate_up + M * 2 * inner;
#pragma omp parallel num_threads(threads) if (threads > 1)
  for (int64_t l = 0; l < num_layers; l++) {
    const struct layer *w = layers + l;
    float *k = keys + l * layer_stride, *v = values + l * layer_stride;
    rms_norm_in_team(x, M, hidden, w->input_norm, eps, normed);
    blocked_linear_in_team(normed, M, hidden, w->qkv, width, w->qkv_bias, NULL, qkv);
    rotate_store_in_team(qkv, M, heads, kv_heads, D, cos, sin, write_rows, write_slots, writes, k, v);
    paged_attention_in_team(qkv, width, k, v, slots, positions, lengths, B, Q, C, heads, kv_heads, D, w->window,
                            scale, attended);
    blocked_linear_in_team(attended, M, heads * D, w->o, hidden, w->o_bias, x, x);
    rms_norm_in_team(x, M, hidden, w->post_norm, eps, normed);
    blocked_linear_in_team(normed, M, hidden, w->gate_up, 2 * inner, w->gate_up_bias, NULL, gate_up);
    silu_mul_in_team(gate_up, M, inner, act);
    blocked_linear_in_team(act, M, inner, w->down, hidden, w->down_bias, x, x);
  }
}
