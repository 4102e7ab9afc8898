// Eight-float SIMD helpers shared by minillm's C++ CPU kernels.
//
// Written with the GCC/Clang vector extension, so the compiler emits AVX2 (the -mavx2
// build), SSE or scalar code for whatever it builds on, and every host rounds the same way.
//
// exp8 is needed where a kernel takes many exponentials (softmax over a context, SiLU over
// an FFN row): libm's expf is scalar and would cost more than the memory traffic around it.
// It is the Cephes single-precision scheme, the one most SIMD libraries use: x = n ln2 + r
// with n an integer and |r| <= ln2 / 2, exp(r) by a degree-6 polynomial, 2^n put straight
// into the exponent bits. Error: about 1 ulp over the clamped range, against 0.5 for a
// correctly rounded expf (tests/test_fused_ops.py checks the SiLU built on it against PyTorch's).
#pragma once

#include <cstdint>
#include <cstring>

namespace minillm {

typedef float vf8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));

// vf8 is declared aligned(4), so these are unaligned vector moves (a memcpy would do the
// same in principle, but GCC routes it through the stack).
inline vf8 load8(const float* p) { return *reinterpret_cast<const vf8*>(p); }
inline void store8(float* p, vf8 v) { *reinterpret_cast<vf8*>(p) = v; }
inline vf8 splat8(float x) { return vf8{x, x, x, x, x, x, x, x}; }

// Sum of the eight lanes, in a fixed order (the same on every call: batch invariance).
inline float hsum8(vf8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

inline vf8 exp8(vf8 x) {
  const vf8 hi = splat8(88.3762626647949f), lo = splat8(-88.3762626647949f);
  x = x > hi ? hi : x;  // exp(88.38) is just below FLT_MAX; exp(-88.38) about FLT_MIN
  x = x < lo ? lo : x;
  // n = round(x / ln2), by floor(x log2(e) + 0.5): truncate, then step down where that
  // rounded a negative value up.
  vf8 t = x * splat8(1.44269504088896341f) + splat8(0.5f);
  vi8 n = __builtin_convertvector(t, vi8);
  vf8 nf = __builtin_convertvector(n, vf8);
  n = n + (vi8)(nf > t);  // a true comparison is -1 in every bit
  nf = __builtin_convertvector(n, vf8);
  // r = x - n ln2, with ln2 in two parts so that r keeps its low bits.
  vf8 r = x - nf * splat8(0.693359375f) + nf * splat8(2.12194440e-4f);
  vf8 p = splat8(1.9875691500e-4f);
  p = p * r + splat8(1.3981999507e-3f);
  p = p * r + splat8(8.3334519073e-3f);
  p = p * r + splat8(4.1665795894e-2f);
  p = p * r + splat8(1.6666665459e-1f);
  p = p * r + splat8(5.0000001201e-1f);
  p = p * (r * r) + r + splat8(1.0f);
  vi8 scale = (n + 127) << 23;  // 2^n as a float's bits
  vf8 pow2n;
  std::memcpy(&pow2n, &scale, sizeof pow2n);
  return p * pow2n;
}

}  // namespace minillm
