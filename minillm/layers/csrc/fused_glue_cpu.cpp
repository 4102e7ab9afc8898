// The elementwise glue between a Llama layer's weight products, one pass per group on the
// CPU: RMSNorm, residual add + RMSNorm, RoPE on the q and k heads (in place), SiLU(gate)*up.
// Python side, the plain PyTorch reference and when each is used: minillm/layers/fused.py.
//
// fp32 or bf16 (every tensor of a call in one dtype; RoPE's cos/sin tables stay fp32). bf16
// is computed in fp32 and rounded to bf16 wherever the PyTorch reference of fused.py stores
// a bf16 tensor (bf16.h: nearest even), so it matches that reference to fp32 rounding inside:
// the bf16 model's eager decode gets the same one-pass glue as fp32's.
//
// Every function works row by row (a row = one token's vector), and a row's result is
// computed by the same code in the same order whatever the number of rows: batch
// invariance, so an engine step of 64 rows and a decode step of 1 give a sequence the same
// bits. Rows are split over PyTorch's intra-op threads (at::parallel_for) in chunks of
// GRAIN_ROWS; a decode step's single row runs inline, with no thread hand-off.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "bf16.h"      // minillm/csrc: load8/store8/round8 of bf16
#include "vec_math.h"  // minillm/csrc: vf8, load8/store8, hsum8, exp8

namespace {

using minillm::load8;
using minillm::round8;
using minillm::splat8;
using minillm::store8;
using minillm::vf8;
using bf16 = c10::BFloat16;

constexpr int64_t GRAIN_ROWS = 16;

void check_rows(const torch::Tensor& x, const char* what,
                torch::ScalarType dtype = torch::kFloat) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kFloat ||
                                      x.scalar_type() == torch::kBFloat16),
              what, ": tensors must be float32 or bfloat16 on the CPU");
  TORCH_CHECK(x.scalar_type() == dtype, what, ": tensors must share one dtype, got ",
              x.scalar_type(), " and ", dtype);
  TORCH_CHECK(x.is_contiguous(), what, ": tensors must be contiguous");
}

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) { return static_cast<float>(v); }
// What the reference stores between two ops: nothing to round in fp32, bf16 rounding in bf16.
inline vf8 stored(vf8 v, const float*) { return v; }
inline vf8 stored(vf8 v, const bf16*) { return round8(v); }
inline float stored(float v, const float*) { return v; }
inline float stored(float v, const bf16*) { return static_cast<float>(bf16(v)); }

// 1 / sqrt(mean(x^2) + eps) for one row of K floats; 16 partial sums, then a fixed tree.
template <typename T>
inline float inv_rms(const T* x, int64_t K, float eps) {
  vf8 a0 = {0}, a1 = {0};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const vf8 u = load8(x + k), v = load8(x + k + 8);
    a0 += u * u;
    a1 += v * v;
  }
  for (; k + 8 <= K; k += 8) {
    const vf8 u = load8(x + k);
    a0 += u * u;
  }
  float s = minillm::hsum8(a0 + a1);
  for (; k < K; ++k) s += to_float(x[k]) * to_float(x[k]);
  return 1.f / std::sqrt(s / static_cast<float>(K) + eps);
}

// y = (x * inv) * w, as PyTorch's rms_norm orders it (bf16: the normalized row is rounded to
// bf16 before the weight multiplies it, as fused.rms_norm_ref stores it in between).
template <typename T>
inline void scale_row(const T* x, const T* w, float inv, T* y, int64_t K) {
  const vf8 vi = splat8(inv);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) store8(y + k, stored(load8(x + k) * vi, x) * load8(w + k));
  for (; k < K; ++k) y[k] = T(stored(to_float(x[k]) * inv, x) * to_float(w[k]));
}

}  // namespace

// y = x / rms(x) * weight over the last dimension; x [M, K], weight [K].
template <typename T>
void rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                   torch::Tensor& y) {
  const int64_t K = x.size(-1), M = x.numel() / std::max<int64_t>(K, 1);
  const T *xp = x.data_ptr<T>(), *wp = weight.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, M, GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      scale_row(xp + m * K, wp, inv_rms(xp + m * K, K, static_cast<float>(eps)), yp + m * K, K);
  });
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm", x.scalar_type());
  check_rows(weight, "rms_norm", x.scalar_type());
  const int64_t K = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == K, "rms_norm: weight must be [", K, "]");
  auto y = torch::empty_like(x);
  if (x.scalar_type() == torch::kBFloat16)
    rms_norm_rows<bf16>(x, weight, eps, y);
  else
    rms_norm_rows<float>(x, weight, eps, y);
  return y;
}

// The residual stream's add and the next norm in one pass: s = x + delta, y = rms_norm(s).
template <typename T>
void add_rms_norm_rows(const torch::Tensor& x, const torch::Tensor& delta,
                       const torch::Tensor& weight, double eps, torch::Tensor& s,
                       torch::Tensor& y) {
  const int64_t K = x.size(-1), M = x.numel() / std::max<int64_t>(K, 1);
  const T *xp = x.data_ptr<T>(), *dp = delta.data_ptr<T>(), *wp = weight.data_ptr<T>();
  T *sp = s.data_ptr<T>(), *yp = y.data_ptr<T>();
  at::parallel_for(0, M, GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      T* sr = sp + m * K;
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) store8(sr + k, load8(xp + m * K + k) + load8(dp + m * K + k));
      for (; k < K; ++k) sr[k] = T(to_float(xp[m * K + k]) + to_float(dp[m * K + k]));
      scale_row(sr, wp, inv_rms(sr, K, static_cast<float>(eps)), yp + m * K, K);
    }
  });
}

std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                        const torch::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm", x.scalar_type());
  check_rows(delta, "add_rms_norm", x.scalar_type());
  check_rows(weight, "add_rms_norm", x.scalar_type());
  TORCH_CHECK(x.sizes() == delta.sizes(), "add_rms_norm: x and delta must have one shape, got ",
              x.sizes(), " and ", delta.sizes());
  const int64_t K = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == K, "add_rms_norm: weight must be [", K, "]");
  auto s = torch::empty_like(x), y = torch::empty_like(x);
  if (x.scalar_type() == torch::kBFloat16)
    add_rms_norm_rows<bf16>(x, delta, weight, eps, s, y);
  else
    add_rms_norm_rows<float>(x, delta, weight, eps, s, y);
  return {s, y};
}

// bf16 heads are rotated in fp32 (the tables are fp32, so PyTorch promotes) and rounded once.
template <typename T>
void rope_rows(T* hp, int64_t M, int64_t H, int64_t D, int64_t num_rotated, const float* cp,
               const float* sp) {
  const int64_t half = D / 2;
  at::parallel_for(0, M, GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float *c = cp + m * D, *s = sp + m * D;
      for (int64_t h = 0; h < num_rotated; ++h) {
        T* x = hp + (m * H + h) * D;
        for (int64_t i = 0; i < half; i += 8) {  // both halves read the old values
          const vf8 x1 = load8(x + i), x2 = load8(x + half + i);
          store8(x + i, x1 * load8(c + i) + x2 * load8(s + i));
          store8(x + half + i, x2 * load8(c + half + i) + x1 * load8(s + half + i));
        }
      }
    }
  });
}

// RoPE in place on the first `num_rotated` heads of each row (q's and k's heads of a fused
// q|k|v projection; v's heads follow and are left alone). heads [M, H, D]; cos, sin [M, D]
// laid out as minillm.model.rope_cos_sin makes them (cos = [c, c], sin = [-s, s]), so
// out[i] = x[i] cos[i] + x[(i + D/2) % D] sin[i], which is minillm.model.apply_rope.
torch::Tensor rope_(torch::Tensor heads, int64_t num_rotated, const torch::Tensor& cos,
                    const torch::Tensor& sin) {
  check_rows(heads, "rope_", heads.scalar_type());
  check_rows(cos, "rope_");  // the tables stay fp32 (a bf16 model's too)
  check_rows(sin, "rope_");
  TORCH_CHECK(heads.dim() == 3, "rope_: heads must be [rows, heads, head_dim]");
  const int64_t M = heads.size(0), H = heads.size(1), D = heads.size(2);
  TORCH_CHECK(D % 16 == 0, "rope_: head_dim must be a multiple of 16, got ", D);
  TORCH_CHECK(num_rotated >= 0 && num_rotated <= H, "rope_: num_rotated must be in [0, ", H, "]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == M &&
                  cos.size(1) == D,
              "rope_: cos and sin must be [", M, ", ", D, "]");
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  if (heads.scalar_type() == torch::kBFloat16)
    rope_rows(heads.data_ptr<bf16>(), M, H, D, num_rotated, cp, sp);
  else
    rope_rows(heads.data_ptr<float>(), M, H, D, num_rotated, cp, sp);
  return heads;
}

// bf16: silu(gate) is rounded to bf16 before it multiplies up, as F.silu(gate) * up stores it.
template <typename T>
void silu_mul_rows(const T* gp, T* op, int64_t M, int64_t I) {
  const int64_t two_i = 2 * I;
  const vf8 one = splat8(1.f);
  at::parallel_for(0, M, GRAIN_ROWS, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T *g = gp + m * two_i, *u = g + I;
      T* o = op + m * I;
      for (int64_t i = 0; i < I; i += 8) {
        const vf8 gv = load8(g + i);
        store8(o + i, stored(gv / (one + minillm::exp8(-gv)), g) * load8(u + i));
      }
    }
  });
}

// SwiGLU's middle: out = silu(gate) * up, with gate_up = [gate | up] along the last dim.
// silu(g) = g / (1 + exp(-g)), with exp8 (about 1 ulp) where PyTorch uses its own.
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul", gate_up.scalar_type());
  const int64_t two_i = gate_up.size(-1), I = two_i / 2,
                M = gate_up.numel() / std::max<int64_t>(two_i, 1);
  TORCH_CHECK(two_i % 16 == 0, "silu_mul: the last dimension (gate | up) must be a multiple "
                               "of 16, got ", two_i);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  if (gate_up.scalar_type() == torch::kBFloat16)
    silu_mul_rows(gate_up.data_ptr<bf16>(), out.data_ptr<bf16>(), M, I);
  else
    silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), M, I);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (CPU, float32 or bfloat16)");
  m.def("add_rms_norm", &add_rms_norm, "s = x + delta and rms_norm(s), one pass (CPU, float32 or bfloat16)");
  m.def("rope_", &rope_, "RoPE in place on the first num_rotated heads (CPU, float32 or bfloat16 heads)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up for gate_up = [gate | up] (CPU, float32 or bfloat16)");
}
