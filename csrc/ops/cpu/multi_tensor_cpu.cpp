// CPU kernels of the optamp multi-tensor ops.
//
// The tensors of a call are split by element count over the intra-op threads (at::parallel_for;
// this file is compiled with OpenMP, see csrc/CMakeLists.txt), so many small tensors and a few
// large ones balance alike. Each piece is one
// pass over memory: load, convert to fp32, multiply, check, convert back, store. On x86-64 an
// AVX2/F16C/FMA variant is chosen at run time (the library itself is built for baseline x86-64).
// The non-finite check is branch-free: acc += v * 0 stays 0 for finite v and becomes NaN for
// inf/NaN. The per-element math is ops/unscale_math.h's, shared with the CUDA kernels: the scalar
// path and the vector tails call it, the AVX2 bodies do the same operations in the same order
// (held to it bit for bit by tests/cpp/test_unscale_math.cpp; nothing is fused into an FMA, see
// -ffp-contract in csrc/CMakeLists.txt).
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "ops/multi_tensor.h"
#include "ops/register_kernels.h"
#include "ops/unscale_math.h"
#include "ops/update_scale_math.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define OPTAMP_CPU_AVX2 1
#endif

namespace amp::ops::detail {
namespace {

// The least work worth a thread: smaller calls run on the calling thread.
constexpr int64_t kChunk = 1 << 16;

// ---- scalar kernels (portable; also the tails of the vector kernels) ----------------------------

template <typename T>
bool unscale_scalar(T* p, int64_t n, float s) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) p[i] = unscale_element(p[i], s, bad);
  return bad;
}

template <typename T>
bool check_scalar(const T* p, int64_t n) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) check_element(p[i], bad);
  return bad;
}

template <typename T>
bool axpby_scalar(T* out, const T* x, const T* y, int64_t n, float a, float b) {
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) out[i] = axpby_element(x[i], y[i], a, b, bad);
  return bad;
}

#ifdef OPTAMP_CPU_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// Round to nearest even, NaN -> 0x7fc0: the same bits as c10::BFloat16(float).
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline bool any_nan(__m256 acc) {
  return _mm256_movemask_ps(_mm256_cmp_ps(acc, acc, _CMP_UNORD_Q)) != 0;
}

// The value as stored (rounded to T), re-read from L1, is what the non-finite check looks at
// (see ops/unscale_math.h).
template <typename T>
bool unscale_avx2(T* p, int64_t n, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  const __m256 zero = _mm256_setzero_ps();
  __m256 acc0 = zero, acc1 = zero;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    store8(p + i, _mm256_mul_ps(load8(p + i), vs));
    store8(p + i + 8, _mm256_mul_ps(load8(p + i + 8), vs));
    acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(load8(p + i), zero));
    acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(load8(p + i + 8), zero));
  }
  const bool bad = any_nan(_mm256_add_ps(acc0, acc1));
  return unscale_scalar(p + i, n - i, s) || bad;
}

// The read-only check of an unscale by 1.0 (see check_element).
template <typename T>
bool check_avx2(const T* p, int64_t n) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 acc0 = zero, acc1 = zero;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(load8(p + i), zero));
    acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(load8(p + i + 8), zero));
  }
  const bool bad = any_nan(_mm256_add_ps(acc0, acc1));
  return check_scalar(p + i, n - i) || bad;
}

template <typename T>
bool axpby_avx2(T* out, const T* x, const T* y, int64_t n, float a, float b) {
  const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
  const __m256 zero = _mm256_setzero_ps();
  __m256 acc = zero;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 xv = load8(x + i);
    const __m256 r = _mm256_add_ps(_mm256_mul_ps(va, xv), _mm256_mul_ps(vb, load8(y + i)));
    store8(out + i, r);
    acc = _mm256_add_ps(
        acc, _mm256_add_ps(_mm256_mul_ps(xv, zero), _mm256_mul_ps(load8(out + i), zero)));
  }
  const bool bad = any_nan(acc);
  return axpby_scalar(out + i, x + i, y + i, n - i, a, b) || bad;
}

#pragma GCC pop_options

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}
#endif

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
  std::vector<T*> ptrs;
  for (const auto& t : tensors) ptrs.push_back(t.data_ptr<T>());
  return for_each_chunk(tensors, [&](const Chunk& c) {
    T* p = ptrs[c.tensor] + c.begin;
    const int64_t n = c.end - c.begin;
#ifdef OPTAMP_CPU_AVX2
    if (cpu_has_avx2()) return check_only ? check_avx2(p, n) : unscale_avx2(p, n, s);
#endif
    return check_only ? check_scalar(p, n) : unscale_scalar(p, n, s);
  });
}

template <typename T>
bool axpby_list(const std::vector<at::Tensor>& out, const std::vector<at::Tensor>& x,
                const std::vector<at::Tensor>& y, float a, float b) {
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
#ifdef OPTAMP_CPU_AVX2
    if (cpu_has_avx2()) return axpby_avx2(o, xp, yp, n, a, b);
#endif
    return axpby_scalar(o, xp, yp, n, a, b);
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
