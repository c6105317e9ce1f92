/* A step's whole forward in one call and one parallel region, for float32 on AVX-512 or AVX2 CPUs:
 * the token embeddings and each token's RoPE angles; per layer RMSNorm, the q/k/v matmul, RoPE and the
 * cache write, attention over the paged cache (a decode or verify step's kernel, or a prompt chunk's;
 * a step may hold rows of both kinds, as parts that share every other stage), the output matmul plus
 * the residual, RMSNorm,
 * the gate/up matmul, SiLU(gate) x up, the down matmul plus the residual; then the final RMSNorm and
 * the head at the positions whose logits are wanted. Each stage is an `omp for` of the kernels'
 * headers, so threads meet at a barrier between stages instead of starting a region and returning
 * to Python for each one (a step of the shipped target made ~13 calls a layer). Every stage
 * computes what its own kernel computes, to the bit, save SiLU and RoPE's cos and sin (the C
 * library's): rows keep their bits alone and in a batch. The stages' bodies are in those headers; the
 * embedding, angles, SiLU and head are here. Built by native.py, called through decoder_layers.py;
 * threads come from torch's OpenMP pool. Returns 0, or KERNEL_OUT_OF_MEMORY where an attention stage's
 * scratch could not be allocated: the threads then stop after that layer, all of them, and x, logits
 * and the cache slots this step wrote are not to be read.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "blocked_linear.h"
#include "paged_attention.h"
#include "prefill_attention.h"
#include "rms_norm.h"
#include "rotate_store.h"
#include "vec16_exp.h"

/* One layer's weights: matmul weights blocked ([out / 16, in, 16]); a bias may be NULL. */
struct layer {
  const float *input_norm, *qkv, *qkv_bias, *o, *o_bias, *post_norm, *gate_up, *gate_up_bias, *down, *down_bias;
  int64_t window; /* sliding window in positions; 0: none */
};

/* The model around its layers. */
struct ends {
  const float *embed;      /* [vocab, hidden] */
  const float *inv_freq;   /* [D / 2] */
  float rope_scaling;      /* cos and sin are multiplied by it (rope.py) */
  const float *final_norm; /* [hidden] */
  const float *head;       /* blocked [vocab / 16, hidden, 16]; NULL: the caller takes x from the last layer */
  int64_t vocab;
};

/* Rows of one attention kind: [B, Q] tokens of prompts' chunks (prefill, prefill_attention.h) or of
 * generated tokens (paged_attention.h), after the earlier parts' tokens. slots [B, C], positions [B, Q]
 * and lengths [B] as paged_attention's; logits_index [B, n] the tokens whose logits are wanted. A step
 * of one kind is one part; a prompt's chunk and the decoding rows that ride with it are two. */
struct part {
  const int64_t *slots, *positions, *lengths, *logits_index;
  int64_t B, Q, C, n;
  int prefill;
};

/* x[m] = embed[ids[m]]; cos, sin [M, D / 2] of each token's position, computed as rope.py computes
 * them: float(position) * inv_freq, then cos and sin, then the scaling. */
static void embed_and_angles_in_team(const struct ends *e, const int64_t *ids, const int64_t *positions, int64_t M,
                                     int64_t hidden, int64_t half, float *x, float *cos, float *sin) {
#pragma omp for schedule(static)
  for (int64_t m = 0; m < M; m++) {
    memcpy(x + m * hidden, e->embed + ids[m] * hidden, hidden * sizeof(float));
    for (int64_t i = 0; i < half; i++) {
      const float angle = (float)positions[m] * e->inv_freq[i];
      cos[m * half + i] = cosf(angle) * e->rope_scaling;
      sin[m * half + i] = sinf(angle) * e->rope_scaling;
    }
  }
}

/* logits [rows, vocab] of the parts' rows whose logits are wanted (each part's logits_index [B, n] into its
 * own [B, Q] tokens of x, the parts' tokens one after the other): the final RMSNorm of those rows
 * (gathered into scratch), then the head. */
static void head_in_team(const struct ends *e, const float *x, const struct part *parts, int64_t num_parts,
                         int64_t hidden, float eps, float *gathered, float *normed, float *logits) {
  int64_t rows = 0;
  for (int64_t p = 0, first = 0; p < num_parts; first += parts[p].B * parts[p].Q, p++) {
    const struct part *part = parts + p;
    const int64_t R = part->B * part->n;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; r++)
      memcpy(gathered + (rows + r) * hidden,
             x + (first + (r / part->n) * part->Q + part->logits_index[r]) * hidden, hidden * sizeof(float));
    rows += R;
  }
  rms_norm_in_team(gathered, rows, hidden, e->final_norm, eps, normed);
  blocked_linear_in_team(normed, rows, hidden, e->head, e->vocab, NULL, NULL, logits);
}

/* act[r, i] = silu(g) * u with g = gate_up[r, i], u = gate_up[r, inner + i]; silu(g) = g / (1 + e^-g),
 * from e^-|g| so that the exponent never overflows. */
static void silu_mul_in_team(const float *gate_up, int64_t rows, int64_t inner, float *act) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    const float *gate = gate_up + r * 2 * inner, *up = gate + inner;
    for (int64_t i = 0; i < inner; i += 16) {
      const mask16 m = tail_mask(inner - i);
      const f32x16 g = f32x16_load_masked(m, gate + i);
      const f32x16 e = exp_nonpositive(f32x16_sub(f32x16_zero(), f32x16_abs(g)));
      const mask16 negative = f32x16_less(g, f32x16_zero());
      const f32x16 sigmoid = f32x16_div(f32x16_select(negative, e, f32x16_broadcast(1.0f)),
                                        f32x16_add(f32x16_broadcast(1.0f), e));
      f32x16_store_masked(act + i + r * inner, m,
                          f32x16_mul(f32x16_mul(g, sigmoid), f32x16_load_masked(m, up + i)));
    }
  }
}

/* ids, positions: [M] the parts' tokens, one part after the other; x: [M, hidden] out, the last layer's
 * output. write_rows (NULL: all), write_slots: [writes] as rotate_store. keys, values: layer 0's [slots,
 * kv_heads, D], each next layer layer_stride floats on. logits [sum of the parts' B * n, vocab] out where
 * ends->head is set. work: scratch of M * (2 hidden + (2 heads + 2 kv_heads + 1) D + 3 inner) floats. */
int decoder_forward(const struct layer *layers, int64_t num_layers, const struct ends *ends, const int64_t *ids,
                     const int64_t *positions, float *x, int64_t M, int64_t hidden, int64_t heads, int64_t kv_heads,
                     int64_t D, int64_t inner, float eps, const int64_t *write_rows, const int64_t *write_slots,
                     int64_t writes, float *keys, float *values, int64_t layer_stride, const struct part *parts,
                     int64_t num_parts, float scale, float *logits, float *work, int threads) {
  const int64_t width = (heads + 2 * kv_heads) * D;
  float *normed = work, *qkv = normed + M * hidden, *attended = qkv + M * width;
  float *gate_up = attended + M * heads * D, *act = gate_up + M * 2 * inner;
  float *cos = act + M * inner, *sin = cos + M * D / 2, *gathered = sin + M * D / 2;
  int64_t wanted = 0;
  for (int64_t p = 0; p < num_parts; p++) wanted += parts[p].n;
  int failed = 0;  /* set by a thread whose attention scratch could not be had */
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    int stop = 0;
    embed_and_angles_in_team(ends, ids, positions, M, hidden, D / 2, x, cos, sin);
    for (int64_t l = 0; l < num_layers; l++) {
      const struct layer *w = layers + l;
      float *k = keys + l * layer_stride, *v = values + l * layer_stride;
      rms_norm_in_team(x, M, hidden, w->input_norm, eps, normed);
      blocked_linear_in_team(normed, M, hidden, w->qkv, width, w->qkv_bias, NULL, qkv);
      rotate_store_in_team(qkv, M, heads, kv_heads, D, cos, sin, write_rows, write_slots, writes, k, v);
      for (int64_t p = 0, first = 0; p < num_parts; first += parts[p].B * parts[p].Q, p++) {
        const struct part *a = parts + p;
        if (a->prefill)
          prefill_attention_in_team(qkv + first * width, width, k, v, a->slots, a->positions, a->lengths, a->B,
                                    a->Q, a->C, heads, kv_heads, D, w->window, scale, attended + first * heads * D,
                                    &failed);
        else
          paged_attention_in_team(qkv + first * width, width, k, v, a->slots, a->positions, a->lengths, a->B,
                                  a->Q, a->C, heads, kv_heads, D, w->window, scale, attended + first * heads * D,
                                  &failed);
      }
      /* Read after every part's closing barrier and before the next attention stage's (several
       * barriers on), so that every thread reads the same and all stop together. */
#pragma omp atomic read
      stop = failed;
      if (stop) break;
      blocked_linear_in_team(attended, M, heads * D, w->o, hidden, w->o_bias, x, x);
      rms_norm_in_team(x, M, hidden, w->post_norm, eps, normed);
      blocked_linear_in_team(normed, M, hidden, w->gate_up, 2 * inner, w->gate_up_bias, NULL, gate_up);
      silu_mul_in_team(gate_up, M, inner, act);
      blocked_linear_in_team(act, M, inner, w->down, hidden, w->down_bias, x, x);
    }
    if (ends->head && wanted && !stop) head_in_team(ends, x, parts, num_parts, hidden, eps, gathered, normed, logits);
  }
  return failed;
}
