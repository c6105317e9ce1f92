/* e^x on 16 lanes for x <= 0, for the kernels' softmaxes (softmax_draw.h, paged_attention.h) and SiLU
 * (decoder_layers.c), written in vec16.h's names: the same bits on both builds.
 */
#ifndef VEC16_EXP_H
#define VEC16_EXP_H
#include "vec16.h"

/* To about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r, scaled by 2^n.
 * Inputs below -87 give e^-87 (callers zero the lanes that are masked), so n stays in [-126, 0]. */
static inline f32x16 exp_nonpositive(f32x16 x) {
  x = f32x16_max(x, f32x16_broadcast(-87.0f));
  const f32x16 n = f32x16_round_nearest(f32x16_mul(x, f32x16_broadcast(1.44269504088896341f)));
  f32x16 r = f32x16_fnmadd(n, f32x16_broadcast(0.693359375f), x);  /* ln2, high part */
  r = f32x16_fnmadd(n, f32x16_broadcast(-2.12194440e-4f), r);      /* ln2, low part */
  f32x16 p = f32x16_broadcast(1.0f / 720);
  p = f32x16_fmadd(p, r, f32x16_broadcast(1.0f / 120));
  p = f32x16_fmadd(p, r, f32x16_broadcast(1.0f / 24));
  p = f32x16_fmadd(p, r, f32x16_broadcast(1.0f / 6));
  p = f32x16_fmadd(p, r, f32x16_broadcast(0.5f));
  p = f32x16_fmadd(p, r, f32x16_broadcast(1.0f));
  p = f32x16_fmadd(p, r, f32x16_broadcast(1.0f));
  return f32x16_mul_pow2_normal(p, n);
}

#endif
