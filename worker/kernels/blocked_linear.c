/* One matmul by a blocked weight in a parallel region of its own: the body is blocked_linear_in_team in
 * blocked_linear.h (decoder_layers.c runs it as a stage). Built by native.py, called through
 * blocked_linear.py; threads come from the OpenMP runtime torch has loaded.
 */
#include "blocked_linear.h"

void blocked_linear(const float *x, int64_t M, int64_t K, const float *packed, int64_t N, float *y,
                    int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
  blocked_linear_in_team(x, M, K, packed, N, NULL, NULL, y);
}
