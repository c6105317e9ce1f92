/* What the kernels share on 16 float lanes: the mask of a row's last, partial vector, and e^x for
 * a softmax. Every kernel includes it, so that a build without AVX-512 gets its intrinsics as pairs
 * of AVX2 vectors (avx512_on_avx2.h). native.py hashes the headers here with each source, so a
 * change rebuilds every kernel. */
#ifndef VECTOR16_H
#define VECTOR16_H
#include <immintrin.h>
#include <stdint.h>
#ifndef __AVX512F__
#include "avx512_on_avx2.h"
#endif

/* The lanes of a vector that starts `left` elements before a row's end. */
static inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }

/* e^x for x <= 0, to about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r,
 * scaled by 2^n. Inputs below -87 give e^-87 (callers zero the lanes that are masked). */
static inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  /* ln2, high part */
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);      /* ln2, low part */
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

#endif
