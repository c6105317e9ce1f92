/* RMSNorm over rows of float32, Hugging Face's formula in one pass per row:
 * y = weight * (x * rsqrt(mean(x^2) + eps)). Replaces the five elementwise ops (each a dispatch
 * and a pass over the row) that a decode step called 2 x layers + 1 times.
 * Built and loaded by native.py.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vector16.h"

void rms_norm(const float *x, int64_t rows, int64_t dim, const float *weight, float eps, float *y) {
  for (int64_t r = 0; r < rows; r++) {
    const float *row = x + r * dim;
    float *out = y + r * dim;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
      __m512 v = _mm512_maskz_loadu_ps(tail_mask(dim - i), row + i);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)dim + eps));
    for (int64_t i = 0; i < dim; i += 16) {
      const __mmask16 m = tail_mask(dim - i);
      __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + i), scale);
      _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, weight + i), v));
    }
  }
}
