/* y[M, N] = x[M, K] @ W^T for float32 on AVX-512 CPUs, with W stored in blocks of 16 outputs:
 * packed[N / 16][K][16], so one pass reads the weights as one contiguous stream.
 *
 * A tile holds up to 6 rows x 4 blocks (24 of the 32 vector registers) and runs over k: each k
 * loads 4 weight vectors, broadcasts one x value per row and adds one fused multiply per row and
 * block. Every output sums over k in order, so a row's result does not depend on M or on the tile
 * it falls in: one row decoded alone and the same row in a batch give the same bits.
 * Built and loaded by native.py; threads come from the OpenMP runtime torch has loaded.
 */
#include <immintrin.h>
#include <stdint.h>

#define MAX_ROWS 6

#define TILE(ROWS, BLOCKS)                                                                         \
  static inline __attribute__((always_inline)) void tile_##ROWS##_##BLOCKS(                       \
      const float *x, int64_t K, const float *w, float *y, int64_t N) {                            \
    __m512 acc[ROWS][BLOCKS];                                                                      \
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)                                         \
        _Pragma("GCC unroll 4") for (int b = 0; b < BLOCKS; b++) acc[r][b] = _mm512_setzero_ps();  \
    for (int64_t k = 0; k < K; k++) {                                                              \
      __m512 wk[BLOCKS];                                                                           \
      _Pragma("GCC unroll 4") for (int b = 0; b < BLOCKS; b++)                                     \
          wk[b] = _mm512_loadu_ps(w + (b * K + k) * 16);                                           \
      _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++) {                                     \
        __m512 xk = _mm512_set1_ps(x[r * K + k]);                                                  \
        _Pragma("GCC unroll 4") for (int b = 0; b < BLOCKS; b++)                                   \
            acc[r][b] = _mm512_fmadd_ps(xk, wk[b], acc[r][b]);                                     \
      }                                                                                            \
    }                                                                                              \
    _Pragma("GCC unroll 8") for (int r = 0; r < ROWS; r++)                                         \
        _Pragma("GCC unroll 4") for (int b = 0; b < BLOCKS; b++)                                   \
            _mm512_storeu_ps(y + r * N + b * 16, acc[r][b]);                                       \
  }

TILE(1, 4) TILE(2, 4) TILE(3, 4) TILE(4, 4) TILE(5, 4) TILE(6, 4)
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1)

/* Rows known at compile time let the compiler keep every accumulator in a register:
 * TILES[wide][rows - 1] is the tile for 4 blocks (wide) or 1. */
typedef void (*tile_fn)(const float *, int64_t, const float *, float *, int64_t);
static const tile_fn TILES[2][MAX_ROWS] = {
    {tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1},
    {tile_1_4, tile_2_4, tile_3_4, tile_4_4, tile_5_4, tile_6_4},
};

/* x: [M, K] dense; packed: [N / 16, K, 16]; y: [M, N] dense. N must be a multiple of 16.
 * The work splits over groups of 4 blocks (then single blocks), each group's weights read once
 * per 6 rows; threads > 1 shares the groups out in one parallel region. */
void blocked_linear(const float *x, int64_t M, int64_t K, const float *packed, int64_t N, float *y,
                    int threads) {
  const int64_t blocks = N / 16, groups = blocks / 4, units = groups + blocks % 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t unit = 0; unit < units; unit++) {
    const int64_t block = unit < groups ? unit * 4 : groups * 4 + (unit - groups);
    const float *w = packed + block * K * 16;
    for (int64_t m = 0; m < M; m += MAX_ROWS) {
      const int rows = M - m < MAX_ROWS ? (int)(M - m) : MAX_ROWS;
      TILES[unit < groups][rows - 1](x + m * K, K, w, y + m * N + block * 16, N);
    }
  }
}
