// Decode attention over a paged KV cache on the CPU: one query token per sequence, K and V
// read IN PLACE through the block table. The PyTorch path (minillm.paged.context) first
// gathers each sequence's K/V into a padded copy with index_select and then runs SDPA over
// the copy, so the cache crosses memory three times (read, write, read again); here once.
// Python side, build and fallback: minillm/attention/cpu_decode.py.
//
// Layout (as everywhere in minillm.paged): k_cache / v_cache [num_blocks, block_size, Hkv, D];
// position t of sequence b is slot block_tables[b, t / block_size] * block_size
// + t % block_size. Only the first context_lens[b] positions are read, and every block id
// they lead to is checked before any is followed.
//
// Work item = a sequence, or a chunk of its positions where the threads' equal shares of the
// step cut it (split-K, see plan_work; at::parallel_for on PyTorch's intra-op threads). Its
// blocks are walked front to back; a slot's Hkv heads are adjacent in memory, so each K/V
// row is streamed once and serves the G = Hq / Hkv query heads that share it (grouped-query
// attention). Softmax is two-pass and exact: the scores (Hq x context floats, a few KB) are
// kept, max-subtracted, exponentiated, and the output divided by their sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

// minillm/csrc: vf8 (eight floats as one SIMD value) and hsum8. Plain scalar loops vectorize
// too, but a dot product would end in a serial chain of adds, and q . k is done once per
// (token, head).
#include "vec_math.h"
// minillm/csrc: load8 of bf16, widened exactly. A bf16 cache (a bf16 model) is read as bf16
// (half the bytes) and every product and sum is fp32; q is taken in fp32 and the output is
// rounded to the model's dtype once, as the SDPA it replaces does.
#include "bf16.h"

namespace {

using minillm::hsum8;
using minillm::load8;
using minillm::vf8;

// scores[g] = q[g] . k * scale for the G query heads of one KV head; D % 8 == 0. T: the
// cache's element type (float or c10::BFloat16).
template <typename T>
inline void group_scores(const float* __restrict q, const T* __restrict k, int64_t G,
                         int64_t D, float scale, float* __restrict scores, int64_t stride) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    vf8 acc0 = {0}, acc1 = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      acc0 += load8(qg + d) * load8(k + d);
      acc1 += load8(qg + d + 8) * load8(k + d + 8);
    }
    for (; d < D; d += 8) acc0 += load8(qg + d) * load8(k + d);
    scores[g * stride] = hsum8(acc0 + acc1) * scale;
  }
}

// The blocks of one sequence's table that positions [begin, end) fall in, walked front to
// back: fn(slot pointer offset of position t0 in elements, t0, n) for each run of n
// positions t0 .. t0 + n - 1 that lie in one block.
template <typename Fn>
inline void for_each_run(const int32_t* table, int64_t begin, int64_t end, int64_t block_size,
                         int64_t slot_stride, Fn&& fn) {
  for (int64_t t0 = begin; t0 < end;) {
    const int64_t n = std::min(block_size - t0 % block_size, end - t0);
    fn((static_cast<int64_t>(table[t0 / block_size]) * block_size + t0 % block_size) *
           slot_stride,
       t0, n);
    t0 += n;
  }
}

// out[0 .. 8 NV) = inv_sum * sum_t p[t - begin] v_t[0 .. 8 NV) over positions [begin, end),
// for one query head: the NV vector accumulators stay in registers over the whole range
// (NV <= 8: 64 floats), so each V row costs NV loads and NV FMAs, with no load and store
// of the output per token.
template <typename T, int NV>
inline void weighted_sum(const float* __restrict p, const T* __restrict v_base,
                         const int32_t* table, int64_t begin, int64_t end, int64_t block_size,
                         int64_t slot_stride, float inv_sum, float* __restrict out) {
  vf8 acc[NV] = {};
  for_each_run(table, begin, end, block_size, slot_stride,
               [&](int64_t at, int64_t t0, int64_t n) {
    const T* vb = v_base + at;
    const float* pb = p + (t0 - begin);
    for (int64_t i = 0; i < n; ++i) {
      const T* v = vb + i * slot_stride;
      const float pt = pb[i];
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[j] += pt * load8(v + 8 * j);
    }
  });
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) *reinterpret_cast<vf8*>(out + 8 * j) = acc[j] * inv_sum;
}

template <typename T>
using WeightedSum = void (*)(const float*, const T*, const int32_t*, int64_t, int64_t, int64_t,
                             int64_t, float, float*);
template <typename T>
constexpr WeightedSum<T> WEIGHTED_SUM[9] = {
    nullptr,           weighted_sum<T, 1>, weighted_sum<T, 2>, weighted_sum<T, 3>,
    weighted_sum<T, 4>, weighted_sum<T, 5>, weighted_sum<T, 6>, weighted_sum<T, 7>,
    weighted_sum<T, 8>};

// Positions [begin, end) of sequence b: the work item (see `plan_work`).
struct Chunk {
  int64_t b, begin, end;
};

// The work split of one call: part p (one per thread) runs chunks first[p] .. first[p+1]-1.
struct Plan {
  std::vector<Chunk> chunks;  // in batch order, each sequence's front to back
  std::vector<int64_t> first;
};

// A chunk shorter than this costs more in the threads' start and the merge than it saves.
// Measured at batch 1 on 2 threads (Zen 5, benchmarks/paged_decode_cpu.py --seqs 1): 32
// positions whole beat two chunks of 16 by 1.10x, 64 positions in two chunks beat them
// whole by 1.2x, and at 256-4096 positions two chunks were 1.65-1.86x one.
constexpr int64_t kMinChunk = 32;

// The step's positions (every sequence's context, in batch order) are cut into equal
// shares, one per thread. A sequence that lies inside one share is one chunk, read by one
// thread. A sequence that a cut falls inside is split there (split-K, as "flash decoding"
// does on a GPU): each chunk keeps its softmax partial (max, sum, unnormalised output) and
// `merge_chunks` combines them. So batch-1 decode on 2 cores reads its cache on both, where
// one thread per sequence left the other idle and lost long contexts to SDPA; and a few
// long sequences are shared evenly, where whole sequences could not be. Equal shares of
// positions, not of sequences, also because the engine sorts its decodes by context
// length: equal counts would hand one thread all the long ones (measured: the step's
// attention took up to 1.4x as long). A cut within kMinChunk of a sequence's edge moves to
// that edge (shares then differ by less than kMinChunk), so at most parts - 1 sequences
// are split and no chunk of a split sequence is shorter than kMinChunk.
Plan plan_work(const int32_t* lens, int64_t B, int64_t threads) {
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += lens[b];
  const int64_t parts = std::clamp<int64_t>(total / kMinChunk, 1, threads);
  // cuts[p]: where share p starts among the concatenated positions (non-decreasing).
  std::vector<int64_t> cuts(parts + 1, total);
  cuts[0] = 0;
  for (int64_t p = 1, b = 0, start = 0; p < parts; ++p) {
    int64_t x = total * p / parts;  // < total, so some sequence b holds it
    for (; start + lens[b] <= x; ++b) start += lens[b];
    if (x - start < kMinChunk) x = start;
    else if (start + lens[b] - x < kMinChunk) x = start + lens[b];
    cuts[p] = x;
  }
  Plan plan;
  plan.first.assign(parts + 1, 0);
  int64_t p = 1;  // the next share whose first chunk is still to be marked
  for (int64_t b = 0, start = 0; b < B; start += lens[b++]) {
    for (int64_t begin = 0, end = 0; end < lens[b]; begin = end) {
      for (; p < parts && cuts[p] <= start + begin; ++p)
        plan.first[p] = static_cast<int64_t>(plan.chunks.size());
      end = p < parts && cuts[p] < start + lens[b] ? cuts[p] - start : lens[b];
      plan.chunks.push_back({b, begin, end});
    }
  }
  for (; p <= parts; ++p) plan.first[p] = static_cast<int64_t>(plan.chunks.size());
  return plan;
}

// Each split sequence's output from its chunks' partials: with M the largest chunk max and
// w_c = exp(m_c - M), out = sum_c w_c out_c / sum_c w_c sum_c, the softmax over all its
// positions, exactly (up to the order of the fp32 sums). Sequences of one chunk were written
// in place by attend and are skipped.
inline void merge_chunks(const std::vector<Chunk>& chunks, const std::vector<float>& part_max,
                         const std::vector<float>& part_sum, const std::vector<float>& part_out,
                         int64_t Hq, int64_t D, float* op) {
  const int64_t C = static_cast<int64_t>(chunks.size());
  for (int64_t i = 0, e = 0; i < C; i = e) {  // chunks i .. e - 1 are sequence b's
    const int64_t b = chunks[i].b;
    for (e = i + 1; e < C && chunks[e].b == b;) ++e;
    if (e - i == 1) continue;
    for (int64_t r = 0; r < Hq; ++r) {
      float m = part_max[i * Hq + r];
      for (int64_t k = i + 1; k < e; ++k) m = std::max(m, part_max[k * Hq + r]);
      float denom = 0.f;
      float* o = op + (b * Hq + r) * D;
      std::fill(o, o + D, 0.f);
      for (int64_t k = i; k < e; ++k) {
        const float w = std::exp(part_max[k * Hq + r] - m);
        denom += w * part_sum[k * Hq + r];
        const float* pk = part_out.data() + (k * Hq + r) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * pk[d];
      }
      const float inv = 1.f / denom;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

// The attention of every chunk (see the work split below): q and out fp32 [B, Hq, D], the
// caches of element type T, every index already checked by paged_decode_cpu.
template <typename T>
void attend(const float* qp, const T* kp, const T* vp, float* op, const int32_t* tables,
            const int32_t* lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
            int64_t max_blocks, int64_t block_size, double sm_scale) {
  const int64_t G = Hq / Hkv;
  const float scale = static_cast<float>(sm_scale);
  const int64_t slot_stride = Hkv * D;  // elements between consecutive slots
  constexpr int64_t kLine = 64 / sizeof(T);  // elements in a cache line

  // Work item = one chunk of one sequence (plan_work): its blocks are read front to back,
  // and each block is one sequential read (its slots, each with all Hkv heads, are
  // adjacent). Pass 1 prefetches the next block (see there). That gained nothing while the
  // kernel was compute-bound; once pass 2 kept its sums in registers it made the kernel
  // 1.5x faster (benchmarks/paged_decode_cpu.py).
  const Plan plan = plan_work(lens, B, at::get_num_threads());
  const std::vector<Chunk>& chunks = plan.chunks;
  const std::vector<int64_t>& first = plan.first;
  const int64_t C = static_cast<int64_t>(chunks.size());
  const int64_t parts = static_cast<int64_t>(first.size()) - 1;
  // A split sequence's chunks leave their partials here, [C, Hq] maxima and sums and
  // [C, Hq, D] unnormalised outputs, for merge_chunks (only split chunks write them).
  const bool split = C > B;
  std::vector<float> part_max(split ? C * Hq : 0), part_sum(split ? C * Hq : 0),
      part_out(split ? C * Hq * D : 0);
  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> scores;  // [Hq, L] for the current chunk of L positions
    std::vector<float> inv_sum(Hq);
    for (int64_t i = first[part_begin]; i < first[part_end]; ++i) {
      const Chunk& c = chunks[i];
      const int64_t L = c.end - c.begin;
      const bool whole = L == lens[c.b];  // the sequence's only chunk: normalise in place
      const float* qb = qp + c.b * Hq * D;
      float* ob = whole ? op + c.b * Hq * D : part_out.data() + i * Hq * D;
      const int32_t* table = tables + c.b * max_blocks;
      scores.resize(Hq * L);
      // Pass 1: scores = q . k * scale, block by block (one table lookup per block).
      for_each_run(table, c.begin, c.end, block_size, slot_stride,
                   [&](int64_t at, int64_t t0, int64_t n) {
        const T* kb = kp + at;
        const T* vb = vp + at;
        // The next block is elsewhere in memory, where the hardware prefetcher cannot
        // guess: fetch it while this one is computed, slot j of the next with slot j here,
        // K for the rest of this pass and V of this run for pass 2.
        const int64_t next = t0 + n;
        const bool more = next < c.end;
        const T* kn = more ? kp + static_cast<int64_t>(table[next / block_size]) *
                                          block_size * slot_stride
                               : kb;
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t f = 0; f < slot_stride; f += kLine) {
            if (more) __builtin_prefetch(kn + j * slot_stride + f);
            __builtin_prefetch(vb + j * slot_stride + f);
          }
          for (int64_t h = 0; h < Hkv; ++h)
            group_scores(qb + h * G * D, kb + j * slot_stride + h * D, G, D, scale,
                         scores.data() + h * G * L + t0 - c.begin + j, L);
        }
      });
      // Softmax numerators, and the reciprocal of each query head's denominator (or, for a
      // chunk of a split sequence, its max and sum, and no division: merge_chunks divides).
      for (int64_t r = 0; r < Hq; ++r) {
        float* s = scores.data() + r * L;
        float m = s[0];
        for (int64_t t = 1; t < L; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        inv_sum[r] = whole ? 1.f / sum : 1.f;
        if (!whole) {
          part_max[i * Hq + r] = m;
          part_sum[i * Hq + r] = sum;
        }
      }
      // Pass 2: out = sum_t p_t * v_t / denominator, query head by query head, 64 output
      // floats at a time (the G heads of a KV head re-read its V rows from cache).
      for (int64_t r = 0; r < Hq; ++r)  // query head r reads KV head r / G
        for (int64_t d0 = 0; d0 < D; d0 += 64)
          WEIGHTED_SUM<T>[std::min<int64_t>(8, (D - d0) / 8)](
              scores.data() + r * L, vp + (r / G) * D + d0, table, c.begin, c.end,
              block_size, slot_stride, inv_sum[r], ob + r * D + d0);
    }
  });
  if (split) merge_chunks(chunks, part_max, part_sum, part_out, Hq, D, op);
}

}  // namespace

torch::Tensor paged_decode_cpu(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                               const torch::Tensor& context_lens, double sm_scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_cpu: tensors must be on the CPU");
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK((dt == torch::kFloat || dt == torch::kBFloat16) && q.scalar_type() == dt &&
                  v_cache.scalar_type() == dt,
              "paged_decode_cpu: q, k_cache and v_cache must be float32, or all bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && context_lens.scalar_type() == torch::kInt,
              "paged_decode_cpu: block_tables and context_lens must be int32");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_cpu: q [B, Hq, D], k_cache = v_cache [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode_cpu: tensors must be contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1),
                Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 8 == 0 && Hkv > 0 && Hq % Hkv == 0,
              "paged_decode_cpu: head_dim must match and be a multiple of 8, and Hq must be "
              "a multiple of Hkv");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && context_lens.dim() == 1 &&
                  context_lens.size(0) == B,
              "paged_decode_cpu: block_tables [B, max_blocks], context_lens [B]");
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  // Validate every index the loops will follow: a bad table must be an error, not a read
  // outside the cache.
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size,
                "paged_decode_cpu: context_lens[", b, "] = ", lens[b], " must be in [1, ",
                max_blocks * block_size, "]");
    for (int64_t i = 0; i * block_size < lens[b]; ++i) {
      const int32_t blk = tables[b * max_blocks + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_decode_cpu: block_tables[", b, ", ", i,
                  "] = ", blk, " is not a block of the cache (", num_blocks, " blocks)");
    }
  }

  // fp32 q and output: a bf16 q is widened (exact) and the output rounded once at the end.
  const auto qf = q.to(torch::kFloat);
  auto out = torch::empty_like(qf);  // every element is written once, in pass 2
  const float* qp = qf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (dt == torch::kFloat)
    attend(qp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), op, tables, lens, B, Hq,
           Hkv, D, max_blocks, block_size, sm_scale);
  else
    attend(qp, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), op, tables,
           lens, B, Hq, Hkv, D, max_blocks, block_size, sm_scale);
  return dt == torch::kFloat ? out : out.to(dt);
}


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_cpu", &paged_decode_cpu,
        "Decode attention over a paged KV cache, K/V read in place (CPU, float32 or bfloat16)");
}
