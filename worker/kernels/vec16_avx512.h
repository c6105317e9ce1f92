/* vec16.h's vocabulary on AVX-512 (AVX512F): a vector is one 512-bit register, a mask one mask register,
 * and each function one intrinsic, always inlined, so that the kernels compile to what the intrinsics
 * would. Included by vec16.h only, when the build has AVX-512; vec16_avx2.h defines the same names.
 */
#ifndef VEC16_AVX512_H
#define VEC16_AVX512_H
#include <immintrin.h>

typedef __m512 f32x16;
typedef __m512i i32x16;
#define F32X16_REGISTERS 32 /* the f32x16 the register file holds */

/* Making, loading and storing. */
ALWAYS_INLINE f32x16 f32x16_zero(void) { return _mm512_setzero_ps(); }
ALWAYS_INLINE f32x16 f32x16_broadcast(float a) { return _mm512_set1_ps(a); }
ALWAYS_INLINE f32x16 f32x16_load(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE void f32x16_store(float *p, f32x16 a) { _mm512_storeu_ps(p, a); }
ALWAYS_INLINE void f32x16_store_aligned(float *p, f32x16 a) { _mm512_store_ps(p, a); } /* p: 64-byte aligned */

/* Lane by lane; fmadd is a * b + c and fnmadd c - a * b, each rounded once. */
ALWAYS_INLINE f32x16 f32x16_add(f32x16 a, f32x16 b) { return _mm512_add_ps(a, b); }
ALWAYS_INLINE f32x16 f32x16_sub(f32x16 a, f32x16 b) { return _mm512_sub_ps(a, b); }
ALWAYS_INLINE f32x16 f32x16_mul(f32x16 a, f32x16 b) { return _mm512_mul_ps(a, b); }
ALWAYS_INLINE f32x16 f32x16_div(f32x16 a, f32x16 b) { return _mm512_div_ps(a, b); }
ALWAYS_INLINE f32x16 f32x16_max(f32x16 a, f32x16 b) { return _mm512_max_ps(a, b); }
/* a as it stands: the compiler fuses no multiply that made it into an add that takes it (GCC's
 * default -ffp-contract=fast would, and the bits would depend on what the compiler saw). */
ALWAYS_INLINE f32x16 f32x16_unfused(f32x16 a) {
  __asm__("" : "+v"(a));
  return a;
}
ALWAYS_INLINE f32x16 f32x16_fmadd(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS_INLINE f32x16 f32x16_fnmadd(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fnmadd_ps(a, b, c); }
ALWAYS_INLINE f32x16 f32x16_abs(f32x16 a) { return _mm512_abs_ps(a); }
/* To the nearest whole number, ties to even. */
ALWAYS_INLINE f32x16 f32x16_round_nearest(f32x16 a) {
  return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* a x 2^n for n whole in [-126, 127], where 2^n is a normal float: the AVX2 build builds 2^n from its
 * exponent bits, so outside that range (or for n not whole) the two builds disagree. */
ALWAYS_INLINE f32x16 f32x16_mul_pow2_normal(f32x16 a, f32x16 n) { return _mm512_scalef_ps(a, n); }

/* Comparisons, one mask bit a lane; false where a lane is NaN. */
ALWAYS_INLINE mask16 f32x16_less(f32x16 a, f32x16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
ALWAYS_INLINE mask16 f32x16_ordered_not_equal(f32x16 a, f32x16 b) {
  return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ);
}

/* Masked: lanes in m from a, the others from `otherwise` (select) or 0 (keep); a masked load reads
 * nothing outside m, a masked store writes nothing there. */
ALWAYS_INLINE f32x16 f32x16_select(mask16 m, f32x16 a, f32x16 otherwise) { return _mm512_mask_mov_ps(otherwise, m, a); }
ALWAYS_INLINE f32x16 f32x16_keep(mask16 m, f32x16 a) { return _mm512_maskz_mov_ps(m, a); }
ALWAYS_INLINE f32x16 f32x16_load_masked(mask16 m, const float *p) { return _mm512_maskz_loadu_ps(m, p); }
ALWAYS_INLINE f32x16 f32x16_load_masked_or(mask16 m, const float *p, f32x16 otherwise) {
  return _mm512_mask_loadu_ps(otherwise, m, p);
}
ALWAYS_INLINE void f32x16_store_masked(float *p, mask16 m, f32x16 a) { _mm512_mask_storeu_ps(p, m, a); }

/* Over the 16 lanes: the halves, then their halves, then pairs, then the last two lanes (GCC's order,
 * which vec16_avx2.h repeats). The maximum may differ from the AVX2 build's in the sign of a zero. */
ALWAYS_INLINE float f32x16_reduce_add(f32x16 a) { return _mm512_reduce_add_ps(a); }
ALWAYS_INLINE float f32x16_reduce_max(f32x16 a) { return _mm512_reduce_max_ps(a); }

/* Rearranging, within each 128-bit quarter (lanes 4q .. 4q + 3) or by whole quarters. */
ALWAYS_INLINE f32x16 f32x16_interleave_lo(f32x16 a, f32x16 b) { return _mm512_unpacklo_ps(a, b); } /* a0 b0 a1 b1 */
ALWAYS_INLINE f32x16 f32x16_interleave_hi(f32x16 a, f32x16 b) { return _mm512_unpackhi_ps(a, b); } /* a2 b2 a3 b3 */
ALWAYS_INLINE f32x16 f32x16_low_pairs(f32x16 a, f32x16 b) { /* a0 a1 b0 b1 */
  return _mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0));
}
ALWAYS_INLINE f32x16 f32x16_high_pairs(f32x16 a, f32x16 b) { /* a2 a3 b2 b3 */
  return _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2));
}
/* Quarters 0 and 2 of a, then of b; and quarters 1 and 3. */
ALWAYS_INLINE f32x16 f32x16_even_quarters(f32x16 a, f32x16 b) { return _mm512_shuffle_f32x4(a, b, 0x88); }
ALWAYS_INLINE f32x16 f32x16_odd_quarters(f32x16 a, f32x16 b) { return _mm512_shuffle_f32x4(a, b, 0xDD); }

/* 32-bit integer lanes. */
ALWAYS_INLINE i32x16 i32x16_zero(void) { return _mm512_setzero_si512(); }
ALWAYS_INLINE i32x16 i32x16_broadcast(int a) { return _mm512_set1_epi32(a); }
ALWAYS_INLINE i32x16 i32x16_lane_index(void) { /* lane i holds i */
  return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
}
ALWAYS_INLINE i32x16 i32x16_add(i32x16 a, i32x16 b) { return _mm512_add_epi32(a, b); }
ALWAYS_INLINE mask16 i32x16_less(i32x16 a, i32x16 b) { return _mm512_cmp_epi32_mask(a, b, _MM_CMPINT_LT); }
ALWAYS_INLINE mask16 i32x16_at_least(i32x16 a, i32x16 b) { return _mm512_cmp_epi32_mask(a, b, _MM_CMPINT_NLT); }

#endif
