/* vec16.h's vocabulary on CPUs with AVX2 and FMA only (most AMD EPYCs before Zen 4): a vector is a pair
 * of 256-bit registers (lanes 0-7 in lo, 8-15 in hi), a mask stays 16 bits, turned into lanes of all
 * ones where an instruction wants them. Each function computes what vec16_avx512.h's does, lane for lane
 * and in the same order (the limits are noted there). Included by vec16.h only, when the build lacks
 * AVX-512.
 */
#ifndef VEC16_AVX2_H
#define VEC16_AVX2_H
#include <immintrin.h>

typedef struct { __m256 lo, hi; } f32x16;
typedef struct { __m256i lo, hi; } i32x16;
#define F32X16_REGISTERS 8 /* the f32x16 the register file holds: two of its 16 registers each */

/* Mask bits <-> lanes of all ones. */
ALWAYS_INLINE __m256i pair_lanes_of(unsigned bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), bit), bit);
}
ALWAYS_INLINE mask16 pair_bits_of(__m256 lo, __m256 hi) {
  return (mask16)(_mm256_movemask_ps(lo) | _mm256_movemask_ps(hi) << 8);
}
ALWAYS_INLINE f32x16 pair_of(__m256 lo, __m256 hi) { return (f32x16){lo, hi}; }

/* Making, loading and storing. */
ALWAYS_INLINE f32x16 f32x16_zero(void) { return pair_of(_mm256_setzero_ps(), _mm256_setzero_ps()); }
ALWAYS_INLINE f32x16 f32x16_broadcast(float a) { return pair_of(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
ALWAYS_INLINE f32x16 f32x16_load(const float *p) { return pair_of(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
ALWAYS_INLINE void f32x16_store(float *p, f32x16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
ALWAYS_INLINE void f32x16_store_aligned(float *p, f32x16 a) {
  _mm256_store_ps(p, a.lo);
  _mm256_store_ps(p + 8, a.hi);
}

/* Lane by lane on both halves. */
#define LANEWISE(name, op) \
  ALWAYS_INLINE f32x16 f32x16_##name(f32x16 a, f32x16 b) { return pair_of(op(a.lo, b.lo), op(a.hi, b.hi)); }
LANEWISE(add, _mm256_add_ps)
LANEWISE(sub, _mm256_sub_ps)
LANEWISE(mul, _mm256_mul_ps)
LANEWISE(div, _mm256_div_ps)
LANEWISE(max, _mm256_max_ps)
LANEWISE(interleave_lo, _mm256_unpacklo_ps) /* within each 128-bit quarter, as AVX-512's */
LANEWISE(interleave_hi, _mm256_unpackhi_ps)
#undef LANEWISE
ALWAYS_INLINE f32x16 f32x16_unfused(f32x16 a) { /* as vec16_avx512.h's */
  __asm__("" : "+x"(a.lo), "+x"(a.hi));
  return a;
}
ALWAYS_INLINE f32x16 f32x16_fmadd(f32x16 a, f32x16 b, f32x16 c) {
  return pair_of(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
ALWAYS_INLINE f32x16 f32x16_fnmadd(f32x16 a, f32x16 b, f32x16 c) {
  return pair_of(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
ALWAYS_INLINE f32x16 f32x16_abs(f32x16 a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return pair_of(_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi));
}
ALWAYS_INLINE f32x16 f32x16_round_nearest(f32x16 a) {
  return pair_of(_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                 _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* 2^n made from its exponent bits (n + 127): right for n whole in [-126, 127] only. */
ALWAYS_INLINE __m256 pair_times_pow2(__m256 a, __m256 n) {
  const __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(a, _mm256_castsi256_ps(_mm256_slli_epi32(exponent, 23)));
}
ALWAYS_INLINE f32x16 f32x16_mul_pow2_normal(f32x16 a, f32x16 n) {
  return pair_of(pair_times_pow2(a.lo, n.lo), pair_times_pow2(a.hi, n.hi));
}

/* Comparisons. */
ALWAYS_INLINE mask16 f32x16_less(f32x16 a, f32x16 b) {
  return pair_bits_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ));
}
ALWAYS_INLINE mask16 f32x16_ordered_not_equal(f32x16 a, f32x16 b) {
  return pair_bits_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_NEQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_NEQ_OQ));
}

/* Masked moves, loads and stores. */
ALWAYS_INLINE f32x16 f32x16_select(mask16 m, f32x16 a, f32x16 otherwise) {
  return pair_of(_mm256_blendv_ps(otherwise.lo, a.lo, _mm256_castsi256_ps(pair_lanes_of(m))),
                 _mm256_blendv_ps(otherwise.hi, a.hi, _mm256_castsi256_ps(pair_lanes_of(m >> 8))));
}
ALWAYS_INLINE f32x16 f32x16_keep(mask16 m, f32x16 a) { return f32x16_select(m, a, f32x16_zero()); }
ALWAYS_INLINE f32x16 f32x16_load_masked(mask16 m, const float *p) {
  return pair_of(_mm256_maskload_ps(p, pair_lanes_of(m)), _mm256_maskload_ps(p + 8, pair_lanes_of(m >> 8)));
}
ALWAYS_INLINE f32x16 f32x16_load_masked_or(mask16 m, const float *p, f32x16 otherwise) {
  return f32x16_select(m, f32x16_load_masked(m, p), otherwise);
}
ALWAYS_INLINE void f32x16_store_masked(float *p, mask16 m, f32x16 a) {
  _mm256_maskstore_ps(p, pair_lanes_of(m), a.lo);
  _mm256_maskstore_ps(p + 8, pair_lanes_of(m >> 8), a.hi);
}

/* Reductions over the 16 lanes: halves, then quarters, pairs and the last two lanes. */
#define REDUCE(name, op256, op128, op_lowest)                                           \
  ALWAYS_INLINE float f32x16_reduce_##name(f32x16 a) {                                  \
    const __m256 s = op256(a.lo, a.hi);                                                 \
    __m128 x = op128(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));           \
    x = op128(x, _mm_movehl_ps(x, x));                                                  \
    return _mm_cvtss_f32(op_lowest(x, _mm_movehdup_ps(x)));                             \
  }
REDUCE(add, _mm256_add_ps, _mm_add_ps, _mm_add_ss)
REDUCE(max, _mm256_max_ps, _mm_max_ps, _mm_max_ss)
#undef REDUCE

/* Rearranging within quarters (as AVX-512's shuffles, on each half) and by whole quarters; macros, since
 * a shuffle's selector must be a constant expression. */
#define PAIRS(a, b, imm) pair_of(_mm256_shuffle_ps((a).lo, (b).lo, imm), _mm256_shuffle_ps((a).hi, (b).hi, imm))
#define f32x16_low_pairs(a, b) PAIRS(a, b, _MM_SHUFFLE(1, 0, 1, 0))
#define f32x16_high_pairs(a, b) PAIRS(a, b, _MM_SHUFFLE(3, 2, 3, 2))
/* 128-bit quarters 0-1 from a, 2-3 from b, each picked by two bits of imm. */
ALWAYS_INLINE f32x16 pair_quarters(f32x16 a, f32x16 b, const int imm) {
  const __m128 q[8] = {_mm256_castps256_ps128(a.lo), _mm256_extractf128_ps(a.lo, 1),
                       _mm256_castps256_ps128(a.hi), _mm256_extractf128_ps(a.hi, 1),
                       _mm256_castps256_ps128(b.lo), _mm256_extractf128_ps(b.lo, 1),
                       _mm256_castps256_ps128(b.hi), _mm256_extractf128_ps(b.hi, 1)};
  return pair_of(_mm256_set_m128(q[imm >> 2 & 3], q[imm & 3]),
                 _mm256_set_m128(q[4 + (imm >> 6 & 3)], q[4 + (imm >> 4 & 3)]));
}
#define f32x16_even_quarters(a, b) pair_quarters(a, b, 0x88)
#define f32x16_odd_quarters(a, b) pair_quarters(a, b, 0xDD)

/* 32-bit integer lanes. */
ALWAYS_INLINE i32x16 i32x16_broadcast(int a) { return (i32x16){_mm256_set1_epi32(a), _mm256_set1_epi32(a)}; }
ALWAYS_INLINE i32x16 i32x16_zero(void) { return i32x16_broadcast(0); }
ALWAYS_INLINE i32x16 i32x16_lane_index(void) {
  return (i32x16){_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set_epi32(15, 14, 13, 12, 11, 10, 9, 8)};
}
ALWAYS_INLINE i32x16 i32x16_add(i32x16 a, i32x16 b) {
  return (i32x16){_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}
ALWAYS_INLINE mask16 i32x16_less(i32x16 a, i32x16 b) {
  return pair_bits_of(_mm256_castsi256_ps(_mm256_cmpgt_epi32(b.lo, a.lo)),
                 _mm256_castsi256_ps(_mm256_cmpgt_epi32(b.hi, a.hi)));
}
ALWAYS_INLINE mask16 i32x16_at_least(i32x16 a, i32x16 b) { return (mask16)~i32x16_less(a, b); }

#endif
