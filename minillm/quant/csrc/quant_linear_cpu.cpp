// y = x Ŵ^T for a FEW fp32 rows of x against a packed 4-bit or 8-bit weight, on the CPU.
// Python side, build and fallback: minillm/quant/cpu_kernels.py. Format: quant/packing.py.
//
// Why: a decode step multiplies 1 row (a speculative verify k + 1, a small batch a few) by
// every weight, so its time is the time to stream the weights from memory. Stored as 4-bit
// values they are 1/8 of fp32's bytes, 8-bit 1/4, but only if nothing ever builds the float
// matrix: here each packed byte is read from memory once per call, widened to fp32 in
// registers and multiplied by all M rows while it is there.
//
// Layout (packing.py), W [N, K], groups of g columns, G = K / g:
//   w4: qweight uint8 [N, K/2], column 2j in the low nibble of byte j, 2j+1 in the high one.
//   w8: qweight uint8 [N, K].
//   scales, zeros fp32 [N, G];  Ŵ[n, k] = (u[n, k] - zeros[n, k/g]) * scales[n, k/g].
//
// Arithmetic: per group, Σ_k Ŵ[n,k] x[k] = s·Σ u·x − s·z·Σ x, so the inner loop is one FMA
// per weight on the unsigned value u (exact in fp32), and Σ x over each group is summed once
// per call for each row, not once per output. Products and sums are fp32: the result equals
// dequantize-then-F.linear to fp32 rounding (only the summation order differs). The price:
// s·Σu·x and s·z·Σx are each larger than their difference (z is 2^(bits-1) for a symmetric
// weight), so the rounding error is a few times dequantize-then-F.linear's (we measured up
// to ~10x; ~1e-6 of the output's magnitude at K = 576).
//
// Speed: the inner loop is compute-bound, not memory-bound: per 8 bytes of w4 it widens,
// masks, shifts, converts twice and issues two FMAs, so on 2 cores it streams ~20 GB/s where
// fp32 streams ~33. Wider vectors are the cure: built with AVX-512 (cpp_extension.build_flags
// asks for it where the CPU has it) a chunk is 16 lanes, half the instructions per weight;
// otherwise AVX2's 8 lanes. Which one a call uses depends only on the build and the group
// size (16 lanes need g to be a multiple of 32 for w4, 16 for w8), never on M.
// benchmarks/quant_linear.py measures both widths side by side. Both builds are compiled
// where the CPU runs AVX-512 (an avx2 and an avx512 build), and which one runs, or the
// dequantize + BLAS path, is measured per host (minillm/cpu_select.py): on a CPU that runs
// 512-bit instructions as two halves (Zen 4) 16 lanes need not pay.
//
// Batch invariance: y[m, n] is accumulated in one fixed order (L lanes per chunk, groups in
// order, a fixed sum of the lanes, the per-group tails, then the zero-point term), whatever
// M is and however rows are tiled, so a row's result is the same bits alone or among others
// (speculative decoding's greedy verify relies on it, as with small_m_linear_cpu.cpp).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

// minillm/csrc: MINILLM_ISA_NAME, this build's ISA, in its operators' names
// (minillm_cpu::w4_linear_avx2, ...), so several builds load side by side.
#include "build_name.h"

namespace {

typedef float vf8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));
typedef uint8_t vb8 __attribute__((vector_size(8), aligned(1)));
typedef float vf16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));
typedef uint8_t vb16 __attribute__((vector_size(16), aligned(1)));

constexpr int64_t kMaxRows = 16;

#ifdef __AVX512F__
constexpr bool kHave16Lanes = true;
#else
constexpr bool kHave16Lanes = false;
#endif

// The vector types of an L-lane chunk, and the three things the tiles do with them: load L
// floats, widen L bytes to L int32 lanes, sum the L lanes in a fixed order.
template <int L> struct Lanes;

template <> struct Lanes<8> {
  typedef vf8 F;
  typedef vi8 I;
  static inline F load(const float* p) { return *reinterpret_cast<const F*>(p); }
  // 8 bytes -> 8 int32 lanes: one vpmovzxbd from memory. (GCC 12 lowers the portable
  // __builtin_convertvector of a byte vector to 8 scalar loads and inserts, 5x slower.)
  static inline I widen(const uint8_t* p) {
#ifdef __AVX2__
    return reinterpret_cast<I>(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
    return __builtin_convertvector(*reinterpret_cast<const vb8*>(p), I);
#endif
  }
  static inline float hsum(F v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
  }
  static inline F splat(float s) { return F{s, s, s, s, s, s, s, s}; }
  // The low and high nibbles of widened bytes as floats: mask or shift, then convert.
  static inline F low_nibbles(I b) { return __builtin_convertvector(b & 15, F); }
  static inline F high_nibbles(I b) { return __builtin_convertvector(b >> 4, F); }
};

template <> struct Lanes<16> {
  typedef vf16 F;
  typedef vi16 I;
  static inline F load(const float* p) { return *reinterpret_cast<const F*>(p); }
  static inline I widen(const uint8_t* p) {
#ifdef __AVX512F__
    return reinterpret_cast<I>(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
    return __builtin_convertvector(*reinterpret_cast<const vb16*>(p), I);
#endif
  }
  static inline float hsum(F v) {  // fold the halves, then as 8 lanes
    vf8 h;
    for (int i = 0; i < 8; ++i) h[i] = v[i] + v[i + 8];
    return Lanes<8>::hsum(h);
  }
  static inline F splat(float s) { return F{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }
  // With AVX-512 a 16-entry table lookup (vpermps reads only the low 4 bits of each index)
  // turns a nibble into its float in one instruction: no mask, no conversion.
#ifdef __AVX512F__
  static inline F table() {
    return F{0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f};
  }
  static inline F low_nibbles(I b) {
    return reinterpret_cast<F>(_mm512_permutexvar_ps(reinterpret_cast<__m512i>(b),
                                                     reinterpret_cast<__m512>(table())));
  }
  static inline F high_nibbles(I b) { return low_nibbles(b >> 4); }
#else
  static inline F low_nibbles(I b) { return __builtin_convertvector(b & 15, F); }
  static inline F high_nibbles(I b) { return __builtin_convertvector(b >> 4, F); }
#endif
};

// Everything a tile needs, fixed for the call.
struct Problem {
  const float* x;       // [M, K]; for w4, each group's 16-column chunks de-interleaved (below)
  const float* xsum;    // [M, G]: Σ x over each group
  const uint8_t* qw;    // packed weight, row_bytes per output
  const float* scales;  // [N, G]
  const float* zeros;   // [N, G]
  int64_t M, K, N, G, g, row_bytes;
  int64_t chunks;       // vector chunks per group (2L columns for w4, L for w8); the rest of
                        // each group (g - chunks * width columns) is the scalar tail
};

// Hardware prefetchers do badly on a tile's access pattern (R short rows, 288 or 576 bytes
// each at K = 576, read side by side a few bytes at a time): the kernel then runs at half
// the memory bandwidth. So each tile's first pass over W also prefetches, spread over its
// chunk loop, the same rows kPrefetchRows further on (a later tile of the same thread:
// parallel_for hands each thread one contiguous range of tiles).
constexpr int64_t kPrefetchRows = 16;

struct Prefetch {
  const uint8_t* at;  // nullptr: no prefetching in this pass
  int64_t step;       // bytes per chunk iteration, so the rows' bytes are covered once
  inline void operator()(int64_t iteration) const {
    // One prefetch per 64-byte line: with 16 lanes an iteration can cover two.
    if (at)
      for (int64_t b = 0; b < step; b += 64) __builtin_prefetch(at + iteration * step + b);
  }
};

// ---- 4-bit -----------------------------------------------------------------------------
// A 2L-column chunk is L bytes: widened to L lanes, (b & 15) holds columns 0,2,..,2L-2 and
// (b >> 4) columns 1,3,..,2L-1. So x is rearranged once per call to match: within each
// chunk, the L even columns, then the L odd ones. The tail columns of a group keep their
// place.

inline float w4_value(const uint8_t* row, int64_t k) {
  const uint8_t b = row[k >> 1];
  return static_cast<float>((k & 1) ? (b >> 4) : (b & 15));
}

// Output rows n0..n0+R-1 times input rows m0..m0+MB-1. Per group, one accumulator per
// (output, input) pair, R * MB of them in registers (R * MB >= 8 keeps enough independent
// FMA chains in flight), folded into the running total with the group's scale.
template <int L, int R, int MB>
inline void w4_tile(const Problem& p, float* __restrict y, int64_t m0, int64_t n0,
                    Prefetch prefetch) {
  typedef Lanes<L> V;
  typedef typename V::F vf;
  typedef typename V::I vi;
  constexpr int64_t kW4Chunk = 2 * L;
  vf total[R][MB];
  float tail[R][MB], zterm[R][MB];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) total[r][j] = V::splat(0), tail[r][j] = 0, zterm[r][j] = 0;
  const int64_t tail_begin = p.chunks * kW4Chunk;
  for (int64_t gi = 0; gi < p.G; ++gi) {
    const int64_t k0 = gi * p.g;
    vf acc[R][MB];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < MB; ++j) acc[r][j] = V::splat(0);
    for (int64_t c = 0; c < p.chunks; ++c) {
      const int64_t k = k0 + c * kW4Chunk;
      prefetch(gi * p.chunks + c);
      vf xe[MB], xo[MB];
#pragma GCC unroll 16
      for (int j = 0; j < MB; ++j) {
        xe[j] = V::load(p.x + (m0 + j) * p.K + k);
        xo[j] = V::load(p.x + (m0 + j) * p.K + k + L);
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const vi b = V::widen(p.qw + (n0 + r) * p.row_bytes + (k >> 1));
        const vf lo = V::low_nibbles(b), hi = V::high_nibbles(b);
#pragma GCC unroll 16
        for (int j = 0; j < MB; ++j) {
          acc[r][j] += lo * xe[j];
          acc[r][j] += hi * xo[j];
        }
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float s = p.scales[(n0 + r) * p.G + gi], z = p.zeros[(n0 + r) * p.G + gi];
      const uint8_t* row = p.qw + (n0 + r) * p.row_bytes;
#pragma GCC unroll 16
      for (int j = 0; j < MB; ++j) {
        total[r][j] += V::splat(s) * acc[r][j];
        if (tail_begin < p.g) {
          const float* xr = p.x + (m0 + j) * p.K;
          float t = 0;
          for (int64_t k = k0 + tail_begin; k < k0 + p.g; ++k) t += w4_value(row, k) * xr[k];
          tail[r][j] += s * t;
        }
        zterm[r][j] += s * z * p.xsum[(m0 + j) * p.G + gi];
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j)
      y[(m0 + j) * p.N + n0 + r] = (V::hsum(total[r][j]) + tail[r][j]) - zterm[r][j];
}

// ---- 8-bit -----------------------------------------------------------------------------
template <int L, int R, int MB>
inline void w8_tile(const Problem& p, float* __restrict y, int64_t m0, int64_t n0,
                    Prefetch prefetch) {
  typedef Lanes<L> V;
  typedef typename V::F vf;
  constexpr int64_t kW8Chunk = L;
  vf total[R][MB];
  float tail[R][MB], zterm[R][MB];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j) total[r][j] = V::splat(0), tail[r][j] = 0, zterm[r][j] = 0;
  const int64_t tail_begin = p.chunks * kW8Chunk;
  for (int64_t gi = 0; gi < p.G; ++gi) {
    const int64_t k0 = gi * p.g;
    vf acc[R][MB];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < MB; ++j) acc[r][j] = V::splat(0);
    for (int64_t c = 0; c < p.chunks; ++c) {
      const int64_t k = k0 + c * kW8Chunk;
      prefetch(gi * p.chunks + c);
      vf xv[MB];
#pragma GCC unroll 16
      for (int j = 0; j < MB; ++j) xv[j] = V::load(p.x + (m0 + j) * p.K + k);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const vf u = __builtin_convertvector(V::widen(p.qw + (n0 + r) * p.row_bytes + k), vf);
#pragma GCC unroll 16
        for (int j = 0; j < MB; ++j) acc[r][j] += u * xv[j];
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float s = p.scales[(n0 + r) * p.G + gi], z = p.zeros[(n0 + r) * p.G + gi];
      const uint8_t* row = p.qw + (n0 + r) * p.row_bytes;
#pragma GCC unroll 16
      for (int j = 0; j < MB; ++j) {
        total[r][j] += V::splat(s) * acc[r][j];
        if (tail_begin < p.g) {
          const float* xr = p.x + (m0 + j) * p.K;
          float t = 0;
          for (int64_t k = k0 + tail_begin; k < k0 + p.g; ++k)
            t += static_cast<float>(row[k]) * xr[k];
          tail[r][j] += s * t;
        }
        zterm[r][j] += s * z * p.xsum[(m0 + j) * p.G + gi];
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j)
      y[(m0 + j) * p.N + n0 + r] = (V::hsum(total[r][j]) + tail[r][j]) - zterm[r][j];
}

// ---- driver ----------------------------------------------------------------------------
// All M rows against output rows n0..n0+R-1: pairs of input rows with R/2 outputs at a
// time, a last odd row with all R, so every call keeps 8 accumulators busy.
// The prefetch for a tile of `rows` outputs at n0, or none for the last few tiles.
inline Prefetch ahead(const Problem& p, int64_t n0, int64_t rows) {
  const int64_t iterations = p.G * p.chunks;
  if (iterations == 0 || n0 + kPrefetchRows + rows > p.N) return {nullptr, 0};
  return {p.qw + (n0 + kPrefetchRows) * p.row_bytes, rows * p.row_bytes / iterations};
}

// Input rows m..m+MB-1 against outputs n0..n0+R-1 (R = 8, or 1 for the last N % 8), in
// tiles of T outputs with T * MB = 8 to 12 accumulators: enough independent FMA chains to
// hide the FMA latency, and (with the x chunks the T outputs share, 2 registers per row for
// w4, 1 for w8) few spills from AVX2's 16 registers. We measured fewer chains (T = 1) to be
// slower than a spill or two. Each tile widens its weights once for all MB rows. The first
// pass over these outputs (m = 0) prefetches further ones.
template <int L, int R, int MB, bool W4>
inline void pass(const Problem& p, float* y, int64_t m, int64_t n0) {
  constexpr int T = R == 1 ? 1 : MB == 1 ? 8 : MB <= 3 ? 4 : MB <= 6 ? 2 : 1;
  for (int h = 0; h < R; h += T) {
    const Prefetch pf = m == 0 ? ahead(p, n0 + h, T) : Prefetch{nullptr, 0};
    W4 ? w4_tile<L, T, MB>(p, y, m, n0 + h, pf) : w8_tile<L, T, MB>(p, y, m, n0 + h, pf);
  }
}

// All M rows against outputs n0..n0+R-1, in passes of up to 8 rows for w8 and 4 for w4
// (whose x takes twice the registers): 5 rows widen each w8 weight once, each w4 weight
// twice (4 + 1), and W is read from memory once either way.
template <int L, int R, bool W4>
inline void tile_all_rows(const Problem& p, float* y, int64_t n0) {
  constexpr int64_t kRowsPerPass = W4 ? 4 : 8;
  for (int64_t m = 0; m < p.M; m += kRowsPerPass) switch (std::min(p.M - m, kRowsPerPass)) {
      case 1: pass<L, R, 1, W4>(p, y, m, n0); break;
      case 2: pass<L, R, 2, W4>(p, y, m, n0); break;
      case 3: pass<L, R, 3, W4>(p, y, m, n0); break;
      case 4: pass<L, R, 4, W4>(p, y, m, n0); break;
      case 5: pass<L, R, 5, W4>(p, y, m, n0); break;
      case 6: pass<L, R, 6, W4>(p, y, m, n0); break;
      case 7: pass<L, R, 7, W4>(p, y, m, n0); break;
      default: pass<L, R, 8, W4>(p, y, m, n0); break;
    }
}

void check_args(const char* fn, const torch::Tensor& x, const torch::Tensor& qweight,
                const torch::Tensor& scales, const torch::Tensor& zeros, int64_t group_size,
                int64_t values_per_byte) {
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu() && scales.device().is_cpu() &&
                  zeros.device().is_cpu(),
              fn, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat, fn, ": x must be float32, got ",
              x.scalar_type());
  TORCH_CHECK(qweight.scalar_type() == torch::kByte, fn, ": qweight must be uint8, got ",
              qweight.scalar_type());
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && zeros.scalar_type() == torch::kFloat,
              fn, ": scales and zeros must be float32, got ", scales.scalar_type(), " and ",
              zeros.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && qweight.dim() == 2 && scales.dim() == 2 && zeros.dim() == 2,
              fn, ": x must be [..., K] and qweight, scales and zeros 2-d");
  const int64_t K = x.size(-1), N = qweight.size(0), M = K ? x.numel() / K : 0;
  TORCH_CHECK(M >= 1 && M <= kMaxRows, fn, ": x has ", M, " rows; this kernel takes 1 to ",
              kMaxRows, " (more rows are compute-bound: dequantize and use a GEMM)");
  TORCH_CHECK(qweight.size(1) * values_per_byte == K, fn, ": x has ", K,
              " features but qweight ", qweight.sizes(), " holds ",
              qweight.size(1) * values_per_byte, " per row (", values_per_byte,
              values_per_byte == 2 ? " values per byte)" : " value per byte)");
  TORCH_CHECK(group_size > 0 && K % group_size == 0, fn, ": group_size ", group_size,
              " must divide the ", K, " input features");
  const int64_t G = K / group_size;
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == G && zeros.size(0) == N &&
                  zeros.size(1) == G,
              fn, ": scales and zeros must be [", N, ", ", G, "] (N, K / group_size), got ",
              scales.sizes(), " and ", zeros.sizes());
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && zeros.is_contiguous(),
              fn, ": qweight, scales and zeros must be contiguous");
}

// x [..., K] -> y [..., N]: the leading dimensions are the M rows.
torch::Tensor run(const char* fn, torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                  torch::Tensor zeros, int64_t group_size, bool w4) {
  check_args(fn, x, qweight, scales, zeros, group_size, w4 ? 2 : 1);
  x = x.contiguous();
  const int64_t K = x.size(-1), M = x.numel() / K, N = qweight.size(0), g = group_size,
                G = K / g;
  // Lanes per chunk: 16 where the build has AVX-512 and whole chunks tile each group, else 8.
  // (A w4 chunk must also start on a byte: with an odd g, groups after the first do not.)
  const bool wide = kHave16Lanes && g % (w4 ? 32 : 16) == 0;
  const int64_t L = wide ? 16 : 8;
  const int64_t width = w4 ? 2 * L : L;
  const int64_t chunks = (w4 && g % 2) ? 0 : g / width;

  // Per call, O(M K): x rearranged for the w4 chunks, and Σ x of each group of each row.
  const float* x_in = x.data_ptr<float>();
  std::vector<float> xr(x_in, x_in + M * K), xsum(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t gi = 0; gi < G; ++gi) {
      const float* src = x_in + m * K + gi * g;
      float* dst = xr.data() + m * K + gi * g;
      float s = 0;
      for (int64_t k = 0; k < g; ++k) s += src[k];
      xsum[m * G + gi] = s;
      if (w4)
        for (int64_t c = 0; c < chunks; ++c)
          for (int64_t i = 0; i < L; ++i) {
            dst[c * width + i] = src[c * width + 2 * i];
            dst[c * width + L + i] = src[c * width + 2 * i + 1];
          }
    }

  const Problem p{xr.data(), xsum.data(), qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                  zeros.data_ptr<float>(), M, K, N, G, g, qweight.size(1), chunks};
  std::vector<int64_t> y_shape(x.sizes().begin(), x.sizes().end());
  y_shape.back() = N;
  auto y = torch::empty(y_shape, x.options());
  float* yp = y.data_ptr<float>();
  constexpr int64_t R = 8;
  const int64_t tiles = N / R;
  // Grain: 8 tiles = 64 outputs, 18 KB of w4 at K = 576: enough work per task.
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (wide)
        w4 ? tile_all_rows<16, R, true>(p, yp, t * R) : tile_all_rows<16, R, false>(p, yp, t * R);
      else
        w4 ? tile_all_rows<8, R, true>(p, yp, t * R) : tile_all_rows<8, R, false>(p, yp, t * R);
    }
  });
  for (int64_t n = tiles * R; n < N; ++n) {
    if (wide)
      w4 ? tile_all_rows<16, 1, true>(p, yp, n) : tile_all_rows<16, 1, false>(p, yp, n);
    else
      w4 ? tile_all_rows<8, 1, true>(p, yp, n) : tile_all_rows<8, 1, false>(p, yp, n);
  }
  return y;
}

// Ŵ [N, K] fp32 from the packed layout, for products with more rows than the kernels take
// (prefill, a large batch: compute-bound, so a BLAS GEMM on the float matrix is the better
// path). Each element is (u - z) * s, one subtraction and one multiplication in fp32, as in
// packing.dequantize_packed: the same bits, written in one pass over W instead of the
// several full-size temporaries that PyTorch's elementwise version allocates.
torch::Tensor dequantize(const char* fn, const torch::Tensor& qweight, const torch::Tensor& scales,
                         const torch::Tensor& zeros, bool w4) {
  TORCH_CHECK(qweight.device().is_cpu() && scales.device().is_cpu() && zeros.device().is_cpu(),
              fn, ": CPU tensors only");
  TORCH_CHECK(qweight.scalar_type() == torch::kByte && qweight.dim() == 2 &&
                  qweight.is_contiguous(),
              fn, ": qweight must be contiguous uint8 [N, K / values per byte]");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && zeros.scalar_type() == torch::kFloat &&
                  scales.dim() == 2 && scales.sizes() == zeros.sizes() &&
                  scales.is_contiguous() && zeros.is_contiguous(),
              fn, ": scales and zeros must be contiguous float32 [N, G] of the same shape");
  const int64_t N = qweight.size(0), K = qweight.size(1) * (w4 ? 2 : 1), G = scales.size(1);
  TORCH_CHECK(scales.size(0) == N && G > 0 && K % G == 0, fn, ": scales are ",
              scales.sizes(), " for a weight of ", N, " x ", K, " (G must divide K)");
  const int64_t g = K / G;
  auto w = torch::empty({N, K}, scales.options());
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zeros.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* q = qp + n * qweight.size(1);
      float* out = wp + n * K;
      for (int64_t gi = 0; gi < G; ++gi) {
        const float s = sp[n * G + gi], z = zp[n * G + gi];
        for (int64_t k = gi * g; k < (gi + 1) * g; ++k) {
          const uint8_t u = w4 ? ((k & 1) ? q[k >> 1] >> 4 : q[k >> 1] & 15) : q[k];
          out[k] = (static_cast<float>(u) - z) * s;
        }
      }
    }
  });
  return w;
}

}  // namespace

torch::Tensor w4_dequantize(torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros) {
  return dequantize("w4_dequantize", qweight, scales, zeros, true);
}

torch::Tensor w8_dequantize(torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros) {
  return dequantize("w8_dequantize", qweight, scales, zeros, false);
}

// Entry points: x fp32 [..., K] with 1..16 rows, y fp32 [..., N].
torch::Tensor w4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                        torch::Tensor zeros, int64_t group_size) {
  return run("w4_linear", x, qweight, scales, zeros, group_size, true);
}

torch::Tensor w8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                        torch::Tensor zeros, int64_t group_size) {
  return run("w8_linear", x, qweight, scales, zeros, group_size, false);
}

// The same two products as PyTorch operators, minillm_cpu::w4_linear_<isa> / w8_linear_<isa>,
// for torch.compile: a graph calls them through the dispatcher straight into C++ (~2 µs a
// call), where a Python custom op costs ~9 µs, and a decode step makes 120 of these calls.
// Their shape functions (fake kernels) are registered from Python (cpu_kernels.load_kernel).
TORCH_LIBRARY_FRAGMENT(minillm_cpu, m) {
  m.def("w4_linear_" MINILLM_ISA_NAME
        "(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size) -> Tensor");
  m.def("w8_linear_" MINILLM_ISA_NAME
        "(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(minillm_cpu, CPU, m) {
  m.impl("w4_linear_" MINILLM_ISA_NAME, &w4_linear);
  m.impl("w8_linear_" MINILLM_ISA_NAME, &w8_linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w4_linear", &w4_linear,
        "y = x W^T for 1..16 fp32 rows, W stored 4 bits per value (packing.py layout)");
  m.def("w8_linear", &w8_linear,
        "y = x W^T for 1..16 fp32 rows, W stored 8 bits per value (packing.py layout)");
  m.def("w4_dequantize", &w4_dequantize, "W [N, K] fp32 from 4-bit storage (packing.py)");
  m.def("w8_dequantize", &w8_dequantize, "W [N, K] fp32 from 8-bit storage (packing.py)");
  m.attr("isa") = MINILLM_ISA_NAME;  // this build's ISA
}
