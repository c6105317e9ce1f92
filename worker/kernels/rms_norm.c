/* RMSNorm of float32 rows in one call, on the calling thread: the body is rms_norm_in_team in rms_norm.h
 * (decoder_layers.c runs it as a stage). Replaces the five elementwise ops (each a dispatch and a pass
 * over the row) that a decode step called 2 x layers + 1 times. Built by native.py, called through
 * rms_norm.py.
 */
#include "rms_norm.h"

void rms_norm(const float *x, int64_t rows, int64_t dim, const float *weight, float eps, float *y) {
  rms_norm_in_team(x, rows, dim, weight, eps, y);
}
