// CPU kernels of the optamp multi-tensor ops.
//
// The tensors of a call are split by element count over the intra-op threads (at::parallel_for;
// this file is compiled with OpenMP, see csrc/CMakeLists.txt), so many small tensors and a few
// large ones balance alike. Each piece is one pass over memory: load, convert to fp32, multiply,
// check, convert back, store, by the kernels of the instruction set picked at run time
// (cpu_isa.h: AVX-512, AVX2 or scalar; the library itself is built for baseline x86-64). The
// per-element math is ops/unscale_math.h's, shared with the CUDA kernels (see cpu_kernels.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>

#include "ops/cpu/cpu_kernels.h"
#include "ops/multi_tensor.h"
#include "ops/register_kernels.h"
#include "ops/update_scale_math.h"

namespace amp::ops::detail {
namespace {

// The least work worth a thread: smaller calls run on the calling thread.
constexpr int64_t kChunk = 1 << 16;

// ---- splitting the work ------------------------------------------------------------------------

// A piece of one tensor: elements [begin, end) of tensors[tensor].
struct Chunk {
  int32_t tensor;
  int64_t begin;
  int64_t end;
};

// The tensors are laid end to end as one range of elements, and at::parallel_for splits that
// range evenly over the threads: every thread gets the same number of elements however the sizes
// are distributed (splitting a list of per-tensor chunks by count left one thread with the big
// tensors). Each thread then walks the tensors its part overlaps.
template <typename Body>
bool for_each_chunk(const std::vector<at::Tensor>& tensors, Body body) {
  std::vector<int64_t> offsets(tensors.size() + 1, 0);
  for (size_t t = 0; t < tensors.size(); ++t) offsets[t + 1] = offsets[t] + tensors[t].numel();
  std::atomic<bool> bad{false};
  at::parallel_for(0, offsets.back(), kChunk, [&](int64_t lo, int64_t hi) {
    bool local = false;
    auto t = std::upper_bound(offsets.begin(), offsets.end(), lo) - offsets.begin() - 1;
    for (; t < static_cast<int64_t>(tensors.size()) && offsets[t] < hi; ++t) {
      const int64_t begin = std::max(lo, offsets[t]) - offsets[t];
      const int64_t end = std::min(hi, offsets[t + 1]) - offsets[t];
      if (begin < end) local |= body(Chunk{static_cast<int32_t>(t), begin, end});
    }
    if (local) bad.store(true, std::memory_order_relaxed);
  });
  return bad.load();
}

template <typename T>
bool unscale_list(const std::vector<at::Tensor>& tensors, float s) {
  const bool check_only = unscale_is_check(s);
  const cpu::Kernels<T> k = cpu::kernels_for<T>(cpu::cpu_isa());
  std::vector<T*> ptrs;
  ptrs.reserve(tensors.size());
  for (const auto& t : tensors) ptrs.push_back(t.data_ptr<T>());
  return for_each_chunk(tensors, [&](const Chunk& c) {
    T* p = ptrs[c.tensor] + c.begin;
    const int64_t n = c.end - c.begin;
    return check_only ? k.check(p, n) : k.unscale(p, n, s);
  });
}

template <typename T>
bool axpby_list(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& x,
                const std::vector<at::Tensor>& y, float a, float b) {
  const cpu::Kernels<T> k = cpu::kernels_for<T>(cpu::cpu_isa());
  std::vector<T*> po;
  std::vector<const T*> px, py;
  for (size_t i = 0; i < out.size(); ++i) {
    po.push_back(out[i].data_ptr<T>());
    px.push_back(x[i].const_data_ptr<T>());
    py.push_back(y[i].const_data_ptr<T>());
  }
  return for_each_chunk(out, [&](const Chunk& c) {
    const int64_t n = c.end - c.begin;
    T* o = po[c.tensor] + c.begin;
    const T* xp = px[c.tensor] + c.begin;
    const T* yp = py[c.tensor] + c.begin;
    return k.axpby(o, xp, yp, n, a, b);
  });
}

void unscale_group_cpu(const std::vector<at::Tensor>& tensors, const at::Tensor& found_inf,
                       const at::Tensor& inv_scale) {
  const float s = inv_scale.item<float>();  // a CPU tensor: no device sync
  bool bad = false;
  AT_DISPATCH_V2(tensors[0].scalar_type(), "optamp::unscale_check_",
                 AT_WRAP([&] { bad = unscale_list<scalar_t>(tensors, s); }), OPTAMP_KERNEL_DTYPES);
  if (bad) found_inf.fill_(1.0);
}

void axpby_group_cpu(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& x,
                     const std::vector<at::Tensor>& y, const at::Tensor& a, float b,
                     const at::Tensor& found_inf) {
  const float av = a.item<float>();
  bool bad = false;
  AT_DISPATCH_V2(out[0].scalar_type(), "optamp::axpby_check_",
                 AT_WRAP([&] { bad = axpby_list<scalar_t>(out, x, y, av, b); }),
                 OPTAMP_KERNEL_DTYPES);
  if (bad) found_inf.fill_(1.0);
}

void update_scale_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker,
                      const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                      double growth_factor, double backoff_factor, int64_t growth_interval,
                      int64_t hysteresis, double min_scale, double max_scale) {
  update_scale_math(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                    hysteresis_tracker.data_ptr<int32_t>(), found_inf.item<float>(), growth_factor,
                    backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
}

}  // namespace
}  // namespace amp::ops::detail

TORCH_LIBRARY_IMPL(optamp, CPU, m) {
  using namespace amp::ops::detail;
  register_multi_tensor_kernels<&unscale_group_cpu, &axpby_group_cpu, &update_scale_cpu>(m);
}
