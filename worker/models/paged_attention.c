/* Decode attention for float32 that reads keys and values where they sit in the paged cache.
 *
 * For query token i of row b (at position p), head h: softmax over the visible context positions
 * c (c <= p, c < the row's length, c > p - window when there is one) of scale * (q . K[slot]),
 * weighting V[slot], where slot = slots[b, c]. Nothing is gathered or masked first.
 *
 * Positions go in chunks of 16 aligned to absolute positions: 16 scores, one vector exp, one
 * rescale of the running sum per chunk (online softmax). The heads that share a key/value head
 * and all of a row's query tokens are done together, so each key and value is read once per row.
 * A token's chunks and their order depend only on its own visible range: a row alone and in a
 * batch, or a token decoded alone and verified among a draft's, give the same bits. The 16 scores
 * of a chunk are summed in one tree (sum16), not one horizontal sum per position.
 * The model calls it for one-token steps (llama.py): at 16 rows x 5 tokens SDPA was faster.
 * Built and loaded by native.py; threads come from torch's OpenMP pool.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define CHUNK 16

/* Lane-wise products of a and b summed over their vectors: the dot product, before its last sum. */
static inline __m512 products(const float *a, const float *b, int64_t vectors) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < vectors; i++)
    sum = _mm512_fmadd_ps(_mm512_loadu_ps(a + 16 * i), _mm512_loadu_ps(b + 16 * i), sum);
  return sum;
}

/* The 16 sums of 16 lanes each, as one vector: lane c holds the sum of v[c]'s lanes. A tree of
 * in-lane then cross-lane adds, where one reduction per vector costs about three times as much. */
static inline __m512 sum16(const __m512 v[CHUNK]) {
  __m512 quads[4];
  for (int g = 0; g < 4; g++) {  /* each 128-bit lane L: the sums over L of v[4g .. 4g+3] */
    const __m512 *w = v + 4 * g;
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
    quads[g] = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

/* e^x for x <= 0, to about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r,
 * scaled by 2^n. Inputs below -87 give e^-87 (callers zero the lanes that are masked). */
static inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  /* ln2, high part */
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);      /* ln2, low part */
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

/* The visible context of the token at position p: [start, end). */
static inline void visible(int64_t p, int64_t length, int64_t window, int64_t *start, int64_t *end) {
  *end = p + 1 < length ? p + 1 : length;
  *start = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
}

/* q: token t = b * Q + i at q + t * q_stride, head h at + h * D. keys, values: [slots, kv_heads, D].
 * slots: [B, C]; positions: [B, Q]; lengths: [B]; out: [B, Q, heads, D]. D % 16 == 0. */
void paged_attention(const float *q, int64_t q_stride, const float *keys, const float *values,
                     const int64_t *slots, const int64_t *positions, const int64_t *lengths, int64_t B,
                     int64_t Q, int64_t C, int64_t heads, int64_t kv_heads, int64_t D, int64_t window,
                     float scale, float *out, int threads) {
  const int64_t shared = heads / kv_heads, vectors = D / 16, per_task = Q * shared;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
  /* Per (query token, head): the running sum of weighted values, its maximum score and total;
   * allocated once per thread, reset per task. */
  __m512 *acc = _mm_malloc(per_task * vectors * sizeof(__m512), 64);
  float *best = malloc(2 * per_task * sizeof(float)), *total = best + per_task;
  int64_t *start = malloc(2 * Q * sizeof(int64_t)), *end = start + Q;
#pragma omp for schedule(static)
  for (int64_t task = 0; task < B * kv_heads; task++) {
    const int64_t b = task / kv_heads, g = task % kv_heads;
    int64_t first = C, last = 0;
    for (int64_t i = 0; i < Q; i++) {
      visible(positions[b * Q + i], lengths[b], window, &start[i], &end[i]);
      first = start[i] < first ? start[i] : first;
      last = end[i] > last ? end[i] : last;
    }
    for (int64_t j = 0; j < per_task; j++) {
      best[j] = -INFINITY;
      total[j] = 0.0f;
      for (int64_t x = 0; x < vectors; x++) acc[j * vectors + x] = _mm512_setzero_ps();
    }
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t c0 = first - first % CHUNK; c0 < last; c0 += CHUNK) {
      const float *k[CHUNK], *v[CHUNK];
      for (int64_t c = 0; c < CHUNK; c++) {  /* past the context: any slot, those lanes are masked */
        const int64_t at = (slots[b * C + (c0 + c < C ? c0 + c : C - 1)] * kv_heads + g) * D;
        k[c] = keys + at;
        v[c] = values + at;
      }
      for (int64_t i = 0; i < Q; i++) {
        if (end[i] <= c0 || start[i] >= c0 + CHUNK) continue;  /* nothing of this chunk is visible */
        const __m512i offset = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(c0 - start[i])));
        const __mmask16 seen = _mm512_cmp_epi32_mask(offset, _mm512_setzero_si512(), _MM_CMPINT_NLT) &
                               _mm512_cmp_epi32_mask(offset, _mm512_set1_epi32((int)(end[i] - start[i])), _MM_CMPINT_LT);
        const float *query = q + (b * Q + i) * q_stride + g * shared * D;
        for (int64_t r = 0; r < shared; r++) {
          const int64_t j = i * shared + r;
          __m512 raw[CHUNK];
          for (int64_t c = 0; c < CHUNK; c++) raw[c] = products(query + r * D, k[c], vectors);
          const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen,
                                                   _mm512_mul_ps(sum16(raw), _mm512_set1_ps(scale)));
          const float top = _mm512_reduce_max_ps(scores);
          const float now = top > best[j] ? top : best[j];
          const float shrink = expf(best[j] - now);  /* 0 on the first chunk (best is -inf) */
          const __m512 weights = _mm512_maskz_mov_ps(seen, exp_nonpositive(_mm512_sub_ps(scores, _mm512_set1_ps(now))));
          best[j] = now;
          total[j] = total[j] * shrink + _mm512_reduce_add_ps(weights);
          float w[CHUNK];
          _mm512_storeu_ps(w, weights);
          __m512 *a = acc + j * vectors;
          const __m512 by = _mm512_set1_ps(shrink);
          for (int64_t x = 0; x < vectors; x++) a[x] = _mm512_mul_ps(a[x], by);
          for (int64_t c = 0; c < CHUNK; c++) {
            if (!(seen >> c & 1)) continue;
            const __m512 wc = _mm512_set1_ps(w[c]);
            for (int64_t x = 0; x < vectors; x++) a[x] = _mm512_fmadd_ps(wc, _mm512_loadu_ps(v[c] + 16 * x), a[x]);
          }
        }
      }
    }
    for (int64_t j = 0; j < per_task; j++) {
      float *o = out + ((b * Q + j / shared) * heads + g * shared + j % shared) * D;
      const __m512 inverse = _mm512_set1_ps(total[j] > 0.0f ? 1.0f / total[j] : 0.0f);
      for (int64_t x = 0; x < vectors; x++) _mm512_storeu_ps(o + 16 * x, _mm512_mul_ps(acc[j * vectors + x], inverse));
    }
  }
  _mm_free(acc);
  free(best);
  free(start);
  }
}
