/* RMSNorm over rows of float32, Hugging Face's formula in one pass per row:
 * y = weight * (x * rsqrt(mean(x^2) + eps)).
 */
#ifndef RMS_NORM_H
#define RMS_NORM_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vector16.h"

/* The rows shared out among the threads of the parallel region it is called in (one thread outside
 * any region); an `omp for`, ending in a barrier. */
static void rms_norm_in_team(const float *x, int64_t rows, int64_t dim, const float *weight, float eps, float *y) {
#pragma omp for schedule(static)
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

#endif
