// y = x W^T for a FEW rows of x on the CPU, streaming W from memory once.
// Python side, build and fallback: minillm/layers/cpu_linear.py.
//
// Why: decoding one token multiplies 1 row by every weight matrix; verifying k speculative
// tokens multiplies k + 1 rows. Either way the time should be the time to read W, since
// W (MBs) dwarfs x (KBs). BLAS does that for 1 row (its matrix-vector path) but switches to
// a GEMM for 2..8 rows that re-streams W in panels, and then 5 rows cost almost 2 steps.
// Here every tile of W is read from memory once and multiplied by all M rows while it
// sits in registers and L1, so M <= 16 rows cost about what 1 row does.
//
// Layout: x [..., K] (M rows: any leading shape) and W [N, K] contiguous (W as nn.Linear
// stores it: each output's weights are one contiguous row); y [..., N]. Taking the leading
// shape here spares the caller two reshapes per product (~1.5 us of Python each decode
// product, 121 per step).
//
// dtypes: fp32 x and W, or bf16 x and W (a bf16 model). bf16 halves the bytes a decode step
// streams; here each bf16 value is widened to fp32 in registers (a bf16 is the top half of
// an fp32: a 16-bit shift, exact, on any AVX2 CPU), products and sums are fp32, and y is
// rounded to bf16 once at the end (round to nearest even), as F.linear's bf16 GEMM does.
//
// Builds (cpp_extension.build_flags; which one runs a shape is measured per host,
// minillm/cpu_select.py): the same source is compiled once per instruction set.
//   avx2        L = 8 lanes: fp32 FMAs; bf16 widened 8 at a time.
//   avx512      L = 16 lanes (-mavx512f): fp32 FMAs; bf16 widened 16 at a time.
//   avx512bf16  fp32 as avx2 (8 lanes, compiled with AVX-512: the build every CPU with
//               AVX512_BF16 ran before builds were measured, kept bit for bit); bf16 takes
//               tile_dp instead, one vdpbf16ps per 32 weights (only where the CPU has
//               AVX512_BF16: the build adds -mavx512bf16).
// Each build names its operator after its ISA (MINILLM_ISA, set by cpp_extension.load):
// minillm_cpu::small_m_linear_avx2 and so on, so several builds load side by side.
//
// Exactness and batch invariance: y[m, n] is accumulated in one fixed order (L lanes over
// k in steps of L, a fixed pairwise sum of the lanes, then the k % L tail), whatever M is
// and however the rows are tiled. So a row's result does not depend on which other rows
// share the call: 1 row alone and the same row among 5 give the same bits. Speculative
// decoding relies on this to keep greedy verification identical to plain decoding. The
// order depends on the build (8 or 16 lanes, or vdpbf16ps), so builds differ in the last
// bits (avx2 and avx512bf16 sum fp32 in the same order; they can differ only in the k % 8
// tail, where the compiler contracts a multiply and an add differently for each ISA).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "build_name.h"  // minillm/csrc: MINILLM_ISA_NAME, this build's ISA
#include "bf16.h"        // minillm/csrc: load8 of bf16 (widened)
#include "vec_math.h"    // minillm/csrc: vf8, load8 (fp32), hsum8

#define MINILLM_OP "small_m_linear_" MINILLM_ISA_NAME

namespace {

using minillm::hsum8;
using minillm::load8;  // fp32, and bf16 widened (bf16.h)
using minillm::vf8;

typedef float vf16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t vu16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t vh16 __attribute__((vector_size(32), aligned(2)));

// 16 bf16 -> 16 fp32, the same widening 16 at a time.
inline vf16 load16(const at::BFloat16* p) {
#ifdef __AVX512F__
  const __m512i v =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<vf16>(_mm512_slli_epi32(v, 16));
#else
  const vu16 v = __builtin_convertvector(*reinterpret_cast<const vh16*>(p), vu16) << 16;
  return reinterpret_cast<const vf16&>(v);
#endif
}

inline vf16 load16(const float* p) { return *reinterpret_cast<const vf16*>(p); }

// An L-lane chunk: its vector type, its load, and the fixed order its lanes are summed in.
template <int L> struct Lanes;
template <> struct Lanes<8> {
  typedef vf8 F;
  template <typename T> static inline F load(const T* p) { return load8(p); }
  static inline float hsum(F v) { return hsum8(v); }
};
template <> struct Lanes<16> {
  typedef vf16 F;
  template <typename T> static inline F load(const T* p) { return load16(p); }
  static inline float hsum(F v) {  // fold the halves, then as 8 lanes
    vf8 h;
    for (int i = 0; i < 8; ++i) h[i] = v[i] + v[i + 8];
    return hsum8(h);
  }
};

// Lanes per chunk in this build: 16 in the avx512 build, else 8 (the avx512bf16 build keeps
// fp32 at 8 lanes: see the top).
#if defined(__AVX512F__) && !defined(__AVX512BF16__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

// fp32 -> T: a no-op for fp32, round to nearest even for bf16 (c10::BFloat16's constructor).
template <typename T> inline T from_float(float v) { return T(v); }

// R output rows (n0..n0+R-1) times MB input rows (m0..m0+MB-1). R * MB accumulators live in
// registers (at most 8 of AVX2's 16); each L-float chunk of W is loaded once per call and
// used MB times, each chunk of x once and used R times.
template <typename T, int L, int R, int MB>
inline void tile(const T* __restrict x, const T* __restrict w, T* __restrict y,
                 int64_t K, int64_t N, int64_t m0, int64_t n0) {
  typedef Lanes<L> V;
  typedef typename V::F vf;
  vf acc[R][MB];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < MB; ++j) acc[r][j] = vf{};
  const int64_t KL = K - K % L;
  for (int64_t k = 0; k < KL; k += L) {
    vf wv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wv[r] = V::load(w + (n0 + r) * K + k);
#pragma GCC unroll 4
    for (int j = 0; j < MB; ++j) {
      const vf xv = V::load(x + (m0 + j) * K + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][j] += wv[r] * xv;
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < MB; ++j) {
      float s = V::hsum(acc[r][j]);
      for (int64_t k = KL; k < K; ++k)
        s += to_float(w[(n0 + r) * K + k]) * to_float(x[(m0 + j) * K + k]);
      y[(m0 + j) * N + n0 + r] = from_float<T>(s);
    }
}

#ifdef __AVX512BF16__
// bf16 on a CPU with AVX512_BF16 (built so only where the CPU has it; cpp_extension.py):
// one vdpbf16ps multiplies 32 bf16 pairs and adds them, two by two, into 16 fp32 lanes.
// The AVX2 path above spends a widen, a shift and an FMA on every 8 weights, and streamed
// bf16 W at ~24 GB/s where fp32 W went at ~34; this does 32 weights per instruction.
// Products of two bf16 are exact in fp32; the sums round as vdpbf16ps does (nearest even,
// denormals flushed), so results can differ from the AVX2 build in the last bf16 bit, and
// every row still sums in one fixed order whatever M is (batch invariance).
template <int R, int MB>
inline void tile_dp(const at::BFloat16* __restrict x, const at::BFloat16* __restrict w,
                    at::BFloat16* __restrict y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  __m512 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MB; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t K32 = K - K % 32;
  for (int64_t k = 0; k < K32; k += 32) {
    __m512bh wv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      wv[r] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + (n0 + r) * K + k));
#pragma GCC unroll 4
    for (int j = 0; j < MB; ++j) {
      const __m512bh xv =
          (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x + (m0 + j) * K + k));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[r], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < MB; ++j) {
      float s = _mm512_reduce_add_ps(acc[r][j]);
      for (int64_t k = K32; k < K; ++k)
        s += to_float(w[(n0 + r) * K + k]) * to_float(x[(m0 + j) * K + k]);
      y[(m0 + j) * N + n0 + r] = from_float<at::BFloat16>(s);
    }
}
#endif

// All M rows against output rows n0..n0+R-1, two x rows at a time.
template <typename T, int R>
inline void rows(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  int64_t m = 0;
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    for (; m + 2 <= M; m += 2) tile_dp<R, 2>(x, w, y, K, N, m, n0);
    if (m < M) tile_dp<R, 1>(x, w, y, K, N, m, n0);
    return;
  }
#endif
  for (; m + 2 <= M; m += 2) tile<T, kLanes, R, 2>(x, w, y, K, N, m, n0);
  if (m < M) tile<T, kLanes, R, 1>(x, w, y, K, N, m, n0);
}

template <typename T>
void run(const T* xp, const T* wp, T* yp, int64_t M, int64_t K, int64_t N) {
  constexpr int64_t R = 4;
  const int64_t tiles = N / R;
  // Grain: 16 tiles = 64 output rows, 147 KB of fp32 W at K = 576; enough work per task.
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rows<T, R>(xp, wp, yp, M, K, N, t * R);
  });
  for (int64_t n = tiles * R; n < N; ++n) rows<T, 1>(xp, wp, yp, M, K, N, n);
}

}  // namespace

torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "small_m_linear: CPU tensors only");
  const auto dt = x.scalar_type();
  TORCH_CHECK((dt == torch::kFloat || dt == torch::kBFloat16) && w.scalar_type() == dt,
              "small_m_linear: x and W must both be float32 or both bfloat16, got ",
              x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2, "small_m_linear: x [..., K] and W [N, K]");
  TORCH_CHECK(x.size(-1) == w.size(1), "small_m_linear: x has ", x.size(-1),
              " features, W expects ", w.size(1));
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(),
              "small_m_linear: x and W must be contiguous ([N, K] row-major W)");
  const int64_t K = x.size(-1), N = w.size(0), M = K ? x.numel() / K : 0;
  std::vector<int64_t> y_shape(x.sizes().begin(), x.sizes().end());
  y_shape.back() = N;
  auto y = torch::empty(y_shape, x.options());
  if (dt == torch::kFloat)
    run(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, K, N);
  else
    run(x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), M,
        K, N);
  return y;
}

// The same product as a PyTorch operator, minillm_cpu::small_m_linear_<isa>, for torch.compile:
// a graph calls it through the dispatcher straight into C++ (~2 µs a call), where a Python
// custom op costs ~10 µs, and a decode step makes 121 of these calls. Its shape function
// (fake kernel) is registered from Python (cpu_linear.load_kernel).
TORCH_LIBRARY_FRAGMENT(minillm_cpu, m) {
  m.def(MINILLM_OP "(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(minillm_cpu, CPU, m) { m.impl(MINILLM_OP, &small_m_linear); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_m_linear", &small_m_linear,
        "y [..., N] = x [..., K] W^T for a few rows of x (W [N, K]; both fp32 or both bf16)");
  m.attr("isa") = MINILLM_ISA_NAME;  // this build's ISA
  m.attr("op_name") = MINILLM_OP;    // its operator: torch.ops.minillm_cpu.<op_name>
}
