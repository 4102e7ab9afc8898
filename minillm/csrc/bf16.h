// bf16 <-> fp32 for eight lanes at a time, shared by the C++ CPU kernels that take bf16.
//
// A bf16 is the top half of an fp32, so widening is exact: zero-extend each 16-bit value and
// shift it to the top. Narrowing rounds to nearest even, as c10::BFloat16's constructor and
// PyTorch's bf16 ops do (a NaN stays a NaN, 0x7FC0), so a kernel that computes in fp32 and
// stores bf16 rounds each stored value exactly once, like the op it replaces.
#pragma once

#include <c10/util/BFloat16.h>

#include "vec_math.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace minillm {

typedef uint32_t vu8 __attribute__((vector_size(32), aligned(4)));
typedef uint16_t vh8 __attribute__((vector_size(16), aligned(2)));

// 8 bf16 -> 8 fp32 (exact).
inline vf8 load8(const c10::BFloat16* p) {
#ifdef __AVX2__
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<vf8>(_mm256_slli_epi32(v, 16));
#else
  const vu8 v = __builtin_convertvector(*reinterpret_cast<const vh8*>(p), vu8) << 16;
  return reinterpret_cast<const vf8&>(v);
#endif
}

// The bits of 8 fp32 rounded to bf16 (nearest even), in the top halves of the lanes.
inline vu8 round_bits8(vf8 v) {
  vu8 u = reinterpret_cast<const vu8&>(v);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return (v != v) ? vu8{} + 0x7FC00000u : u;  // NaN (every lane that is not equal to itself)
}

// 8 fp32 -> 8 bf16, rounded to nearest even.
inline void store8(c10::BFloat16* p, vf8 v) {
  *reinterpret_cast<vh8*>(p) = __builtin_convertvector(round_bits8(v) >> 16, vh8);
}

// 8 fp32 rounded to bf16 and widened back: what a bf16 op in between would have stored.
inline vf8 round8(vf8 v) {
  const vu8 u = round_bits8(v);
  return reinterpret_cast<const vf8&>(u);
}

}  // namespace minillm
