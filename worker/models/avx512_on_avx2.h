/* The AVX-512 intrinsics the kernels use, on CPUs with AVX2 and FMA only (most AMD EPYCs before Zen 4):
 * a 16-lane vector is a pair of 256-bit ones, a 16-bit mask stays a 16-bit mask. vector16.h includes
 * this file when the build lacks AVX-512 (native.py picks the flags from the CPU), so one source of
 * each kernel serves both: built with AVX-512, nothing here is seen and its code is unchanged.
 *
 * Each name below is redirected by a macro to a function or expression of the same meaning for the
 * lanes the kernels use. Two are narrower than Intel's: _mm512_scalef_ps takes whole exponents in
 * [-126, 127] (exp_nonpositive's range) and _mm512_roundscale_ps rounds to the nearest whole number
 * only. The reductions add in another order than AVX-512's: the last bits may differ between the two
 * builds, never between a row alone and in a batch on one of them.
 */
#ifndef AVX512_ON_AVX2_H
#define AVX512_ON_AVX2_H
#include <immintrin.h>
#include <stdint.h>

typedef struct { __m256 lo, hi; } f32x16;
typedef struct { __m256i lo, hi; } i32x16;
#define INLINE static inline __attribute__((always_inline))

/* Mask bits <-> lanes of all ones. */
INLINE __m256i pair_lanes_of(unsigned bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), bit), bit);
}
INLINE __mmask16 pair_bits_of(__m256 lo, __m256 hi) {
  return (__mmask16)(_mm256_movemask_ps(lo) | _mm256_movemask_ps(hi) << 8);
}
INLINE f32x16 pair_of(__m256 lo, __m256 hi) { return (f32x16){lo, hi}; }

INLINE f32x16 pair_setzero_ps(void) { return pair_of(_mm256_setzero_ps(), _mm256_setzero_ps()); }
INLINE f32x16 pair_set1_ps(float a) { return pair_of(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
INLINE f32x16 pair_loadu_ps(const float *p) { return pair_of(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
INLINE void pair_storeu_ps(float *p, f32x16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
INLINE void pair_store_ps(float *p, f32x16 a) { _mm256_store_ps(p, a.lo); _mm256_store_ps(p + 8, a.hi); }

/* Lane by lane on both halves. */
#define PAIR_OF_TWO(name, op) \
  INLINE f32x16 pair_##name(f32x16 a, f32x16 b) { return pair_of(op(a.lo, b.lo), op(a.hi, b.hi)); }
PAIR_OF_TWO(add_ps, _mm256_add_ps)
PAIR_OF_TWO(sub_ps, _mm256_sub_ps)
PAIR_OF_TWO(mul_ps, _mm256_mul_ps)
PAIR_OF_TWO(div_ps, _mm256_div_ps)
PAIR_OF_TWO(max_ps, _mm256_max_ps)
PAIR_OF_TWO(unpacklo_ps, _mm256_unpacklo_ps) /* within each 128-bit lane, as AVX-512 does */
PAIR_OF_TWO(unpackhi_ps, _mm256_unpackhi_ps)
INLINE f32x16 pair_fmadd_ps(f32x16 a, f32x16 b, f32x16 c) {
  return pair_of(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
INLINE f32x16 pair_fnmadd_ps(f32x16 a, f32x16 b, f32x16 c) {
  return pair_of(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
INLINE f32x16 pair_abs_ps(f32x16 a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return pair_of(_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi));
}

/* Masked moves, loads and stores: lanes outside the mask keep src (mask_) or become 0 (maskz_). */
INLINE f32x16 pair_mask_mov_ps(f32x16 src, __mmask16 m, f32x16 a) {
  return pair_of(_mm256_blendv_ps(src.lo, a.lo, _mm256_castsi256_ps(pair_lanes_of(m))),
                 _mm256_blendv_ps(src.hi, a.hi, _mm256_castsi256_ps(pair_lanes_of(m >> 8))));
}
INLINE f32x16 pair_maskz_mov_ps(__mmask16 m, f32x16 a) { return pair_mask_mov_ps(pair_setzero_ps(), m, a); }
INLINE f32x16 pair_maskz_loadu_ps(__mmask16 m, const float *p) {  /* masked-off lanes are not read */
  return pair_of(_mm256_maskload_ps(p, pair_lanes_of(m)), _mm256_maskload_ps(p + 8, pair_lanes_of(m >> 8)));
}
INLINE f32x16 pair_mask_loadu_ps(f32x16 src, __mmask16 m, const float *p) {
  return pair_mask_mov_ps(src, m, pair_maskz_loadu_ps(m, p));
}
INLINE void pair_mask_storeu_ps(float *p, __mmask16 m, f32x16 a) {
  _mm256_maskstore_ps(p, pair_lanes_of(m), a.lo);
  _mm256_maskstore_ps(p + 8, pair_lanes_of(m >> 8), a.hi);
}

/* Reductions over the 16 lanes: halves, then quarters, pairs and the last two lanes. */
#define PAIR_REDUCE(name, op256, op128, op_lowest)                                      \
  INLINE float pair_reduce_##name(f32x16 a) {                                           \
    const __m256 s = op256(a.lo, a.hi);                                                 \
    __m128 x = op128(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));           \
    x = op128(x, _mm_movehl_ps(x, x));                                                  \
    return _mm_cvtss_f32(op_lowest(x, _mm_movehdup_ps(x)));                             \
  }
PAIR_REDUCE(add_ps, _mm256_add_ps, _mm_add_ps, _mm_add_ss)
PAIR_REDUCE(max_ps, _mm256_max_ps, _mm_max_ps, _mm_max_ss)

#define pair_shuffle_ps(a, b, imm) \
  pair_of(_mm256_shuffle_ps((a).lo, (b).lo, imm), _mm256_shuffle_ps((a).hi, (b).hi, imm))
/* 128-bit lanes 0-1 from a, 2-3 from b, each picked by two bits of imm (a constant once inlined). */
INLINE f32x16 pair_shuffle_f32x4(f32x16 a, f32x16 b, const int imm) {
  const __m128 q[8] = {_mm256_castps256_ps128(a.lo), _mm256_extractf128_ps(a.lo, 1),
                       _mm256_castps256_ps128(a.hi), _mm256_extractf128_ps(a.hi, 1),
                       _mm256_castps256_ps128(b.lo), _mm256_extractf128_ps(b.lo, 1),
                       _mm256_castps256_ps128(b.hi), _mm256_extractf128_ps(b.hi, 1)};
  return pair_of(_mm256_set_m128(q[imm >> 2 & 3], q[imm & 3]),
                 _mm256_set_m128(q[4 + (imm >> 6 & 3)], q[4 + (imm >> 4 & 3)]));
}
#define pair_roundscale_ps(a, imm) pair_of(_mm256_round_ps((a).lo, imm), _mm256_round_ps((a).hi, imm))
INLINE __m256 times_two_to(__m256 a, __m256 n) {
  const __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(a, _mm256_castsi256_ps(_mm256_slli_epi32(exponent, 23)));
}
INLINE f32x16 pair_scalef_ps(f32x16 a, f32x16 n) {  /* a x 2^n, n whole in [-126, 127] */
  return pair_of(times_two_to(a.lo, n.lo), times_two_to(a.hi, n.hi));
}
#define pair_cmp_ps_mask(a, b, predicate) \
  pair_bits_of(_mm256_cmp_ps((a).lo, (b).lo, predicate), _mm256_cmp_ps((a).hi, (b).hi, predicate))

/* 32-bit integer lanes. */
INLINE i32x16 pair_set1_epi32(int a) { return (i32x16){_mm256_set1_epi32(a), _mm256_set1_epi32(a)}; }
INLINE i32x16 pair_setzero_si512(void) { return pair_set1_epi32(0); }
INLINE i32x16 pair_set_epi32(int e15, int e14, int e13, int e12, int e11, int e10, int e9, int e8,
                             int e7, int e6, int e5, int e4, int e3, int e2, int e1, int e0) {
  return (i32x16){_mm256_set_epi32(e7, e6, e5, e4, e3, e2, e1, e0),
                  _mm256_set_epi32(e15, e14, e13, e12, e11, e10, e9, e8)};
}
INLINE i32x16 pair_add_epi32(i32x16 a, i32x16 b) {
  return (i32x16){_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}
/* a < b (_MM_CMPINT_LT) or a >= b (_MM_CMPINT_NLT), the two predicates the kernels ask for. */
INLINE __mmask16 pair_cmp_epi32_mask(i32x16 a, i32x16 b, const int predicate) {
  const __mmask16 less = pair_bits_of(_mm256_castsi256_ps(_mm256_cmpgt_epi32(b.lo, a.lo)),
                                 _mm256_castsi256_ps(_mm256_cmpgt_epi32(b.hi, a.hi)));
  return predicate == _MM_CMPINT_LT ? less : (__mmask16)~less;
}

#define __m512 f32x16
#define __m512i i32x16
#define _mm512_setzero_ps pair_setzero_ps
#define _mm512_set1_ps pair_set1_ps
#define _mm512_loadu_ps pair_loadu_ps
#define _mm512_storeu_ps pair_storeu_ps
#define _mm512_store_ps pair_store_ps
#define _mm512_add_ps pair_add_ps
#define _mm512_sub_ps pair_sub_ps
#define _mm512_mul_ps pair_mul_ps
#define _mm512_div_ps pair_div_ps
#define _mm512_max_ps pair_max_ps
#define _mm512_fmadd_ps pair_fmadd_ps
#define _mm512_fnmadd_ps pair_fnmadd_ps
#define _mm512_abs_ps pair_abs_ps
#define _mm512_mask_mov_ps pair_mask_mov_ps
#define _mm512_maskz_mov_ps pair_maskz_mov_ps
#define _mm512_maskz_loadu_ps pair_maskz_loadu_ps
#define _mm512_mask_loadu_ps pair_mask_loadu_ps
#define _mm512_mask_storeu_ps pair_mask_storeu_ps
#define _mm512_reduce_add_ps pair_reduce_add_ps
#define _mm512_reduce_max_ps pair_reduce_max_ps
#define _mm512_unpacklo_ps pair_unpacklo_ps
#define _mm512_unpackhi_ps pair_unpackhi_ps
#define _mm512_shuffle_ps pair_shuffle_ps
#define _mm512_shuffle_f32x4 pair_shuffle_f32x4
#define _mm512_roundscale_ps pair_roundscale_ps
#define _mm512_scalef_ps pair_scalef_ps
#define _mm512_cmp_ps_mask pair_cmp_ps_mask
#define _mm512_set1_epi32 pair_set1_epi32
#define _mm512_setzero_si512 pair_setzero_si512
#define _mm512_set_epi32 pair_set_epi32
#define _mm512_add_epi32 pair_add_epi32
#define _mm512_cmp_epi32_mask pair_cmp_epi32_mask

#endif
