/* y[M, N] = x[M, K] @ W^T (+ bias) (+ residual) for float32 on AVX-512 or AVX2 CPUs, with W stored in
 * blocks of 16 outputs: packed[N / 16][K][16], so one pass reads the weights as one contiguous stream.
 *
 * A tile holds up to MAX_ROWS rows x WIDE blocks of accumulators and runs over k: each k loads WIDE
 * weight vectors, broadcasts one x value per row and adds one fused multiply per row and block.
 * Every output sums over k in order, so a row's result does not depend on M or on the tile it
 * falls in: one row decoded alone and the same row in a batch give the same bits. The bias and
 * the residual are added as torch adds them after a matmul ((x @ W^T + bias), then residual + it).
 * Included by blocked_linear.c (the call of its own) and decoder_layers.c (a stage of the forward).
 */
#ifndef BLOCKED_LINEAR_H
#define BLOCKED_LINEAR_H
#include <stdint.h>

#include "vec16.h"

#if F32X16_REGISTERS >= 32
#define MAX_ROWS 6 /* 6 x 4 blocks: 24 of the 32 vectors the registers hold */
#define WIDE 4
#else
#define MAX_ROWS 3 /* AVX2's registers hold 8: 3 x 2 blocks take 6 */
#define WIDE 2
#endif

#define TILE(ROWS, BLOCKS)                                                                         \
  ALWAYS_INLINE void tile_##ROWS##_##BLOCKS(                                                       \
      const float *x, int64_t K, const float *w, float *y, int64_t N, const float *bias,           \
      const float *residual) {                                                                     \
    f32x16 acc[ROWS][BLOCKS];                                                                      \
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)                                         \
        _Pragma("GCC unroll 4") for (int b = 0; b < BLOCKS; b++) acc[r][b] = f32x16_zero();        \
    for (int64_t k = 0; k < K; k++) {                                                              \
      f32x16 wk[BLOCKS];                                                                           \
      _Pragma("GCC unroll 4") for (int b = 0; b < BLOCKS; b++)                                     \
          wk[b] = f32x16_load(w + (b * K + k) * 16);                                               \
      _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                     \
        f32x16 xk = f32x16_broadcast(x[r * K + k]);                                                \
        _Pragma("GCC unroll 4") for (int b = 0; b < BLOCKS; b++)                                   \
            acc[r][b] = f32x16_fmadd(xk, wk[b], acc[r][b]);                                        \
      }                                                                                            \
    }                                                                                              \
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)                                         \
        _Pragma("GCC unroll 4") for (int b = 0; b < BLOCKS; b++) {                                 \
      f32x16 out = acc[r][b];                                                                      \
      if (bias) out = f32x16_add(out, f32x16_load(bias + b * 16));                                 \
      if (residual) out = f32x16_add(f32x16_load(residual + r * N + b * 16), out);                 \
      f32x16_store(y + r * N + b * 16, out);                                                       \
    }                                                                                              \
  }

/* Rows known at compile time let the compiler keep every accumulator in a register:
 * TILES[wide][rows - 1] is the tile for WIDE blocks (wide) or 1. */
typedef void (*tile_fn)(const float *, int64_t, const float *, float *, int64_t, const float *,
                        const float *);
#if WIDE == 4
TILE(1, 4) TILE(2, 4) TILE(3, 4) TILE(4, 4) TILE(5, 4) TILE(6, 4)
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1)
static const tile_fn TILES[2][MAX_ROWS] = {
    {tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1},
    {tile_1_4, tile_2_4, tile_3_4, tile_4_4, tile_5_4, tile_6_4},
};
#else
TILE(1, 2) TILE(2, 2) TILE(3, 2) TILE(1, 1) TILE(2, 1) TILE(3, 1)
static const tile_fn TILES[2][MAX_ROWS] = {{tile_1_1, tile_2_1, tile_3_1}, {tile_1_2, tile_2_2, tile_3_2}};
#endif

/* x: [M, K] dense; packed: [N / 16, K, 16]; y, residual: [M, N] dense (residual may be y, or NULL);
 * bias: [N] or NULL. N must be a multiple of 16. The work splits over groups of WIDE blocks (then
 * single blocks), each group's weights read once per MAX_ROWS rows, shared out among the threads
 * of the parallel region it is called in (an `omp for`, which ends in a barrier). */
static void blocked_linear_in_team(const float *x, int64_t M, int64_t K, const float *packed, int64_t N,
                                   const float *bias, const float *residual, float *y) {
  const int64_t blocks = N / 16, groups = blocks / WIDE, units = groups + blocks % WIDE;
#pragma omp for schedule(static)
  for (int64_t unit = 0; unit < units; unit++) {
    const int64_t block = unit < groups ? unit * WIDE : groups * WIDE + (unit - groups);
    const float *w = packed + block * K * 16, *b = bias ? bias + block * 16 : NULL;
    for (int64_t m = 0; m < M; m += MAX_ROWS) {
      const int rows = M - m < MAX_ROWS ? (int)(M - m) : MAX_ROWS;
      TILES[unit < groups][rows - 1](x + m * K, K, w, y + m * N + block * 16, N, b,
                                     residual ? residual + m * N + block * 16 : NULL);
    }
  }
}

#endif
