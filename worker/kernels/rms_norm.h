/* RMSNorm over rows of float32, Hugging Face's formula in one pass per row:
 * y = weight * (x * rsqrt(mean(x^2) + eps)). Included by rms_norm.c (the call of its own) and
 * decoder_layers.c (a stage of the forward).
 */
#ifndef RMS_NORM_H
#define RMS_NORM_H
#include <math.h>
#include <stdint.h>

#include "vec16.h"

/* The rows shared out among the threads of the parallel region it is called in (one thread outside
 * any region); an `omp for`, ending in a barrier. */
static void rms_norm_in_team(const float *x, int64_t rows, int64_t dim, const float *weight, float eps, float *y) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; r++) {
    const float *row = x + r * dim;
    float *out = y + r * dim;
    f32x16 squares = f32x16_zero();
    for (int64_t i = 0; i < dim; i += 16) {
      f32x16 v = f32x16_load_masked(tail_mask(dim - i), row + i);
      squares = f32x16_fmadd(v, v, squares);
    }
    const f32x16 scale = f32x16_broadcast(1.0f / sqrtf(f32x16_reduce_add(squares) / (float)dim + eps));
    for (int64_t i = 0; i < dim; i += 16) {
      const mask16 m = tail_mask(dim - i);
      f32x16 v = f32x16_mul(f32x16_load_masked(m, row + i), scale);
      f32x16_store_masked(out + i, m, f32x16_mul(f32x16_load_masked(m, weight + i), v));
    }
  }
}

#endif
