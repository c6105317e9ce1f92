/* The kernels' own vector vocabulary (as vLLM's cpu_types_x86.hpp has its own): f32x16 (16 float
 * lanes), i32x16 (16 int32 lanes) and mask16 (one bit a lane, lane 0 the lowest), with functions named
 * f32x16_* and i32x16_*. Every kernel includes this header and names no intrinsic itself. The build
 * picks one of two implementations: vec16_avx512.h (a vector is one AVX-512 register) or vec16_avx2.h
 * (a pair of 256-bit registers, for CPUs with AVX2 and FMA only); native.py picks the flags from the
 * CPU. Each function gives the same bits on both (f32x16_reduce_max save the sign of a zero). Where a
 * function's meaning is narrower than the instruction's (f32x16_mul_pow2_normal), its name says so and
 * its definitions say how. Here too: what the kernels share on top of them that names no instruction.
 */
#ifndef VEC16_H
#define VEC16_H
#include <stdint.h>
#include <stdlib.h>

typedef uint16_t mask16;
#define ALWAYS_INLINE static inline __attribute__((always_inline))

#ifdef __AVX512F__
#include "vec16_avx512.h"
#else
#include "vec16_avx2.h"
#endif

/* The lanes of a vector that starts `left` elements before a row's end. */
static inline mask16 tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : (mask16)((1u << left) - 1); }

/* What a kernel's C call returns where it could not allocate its scratch (0: done); the bindings
 * (native.py) raise MemoryError for it. */
#define KERNEL_OUT_OF_MEMORY 1

/* Scratch of n floats on a 64-byte boundary, where f32x16_store_aligned may write; NULL where it
 * cannot be had. Freed with free(). */
static inline float *aligned_floats(int64_t n) {
  void *p;
  return posix_memalign(&p, 64, n * sizeof(float)) == 0 ? p : NULL;
}

#endif
