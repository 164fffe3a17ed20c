#include "cache/gradient_buckets.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cache/autograd_cast.h"
#include "cache/batched_cast.h"
#include "common/compiled_autograd.h"
#include "dispatch/carried_state.h"
#include "optamp/cast_cache.h"

namespace amp::detail {
namespace {

using torch::autograd::variable_list;

// Input i: the gradient of a bucket's i-th copy, in the copy's dtype (undefined when nothing used
// the copy in this backward). Output i: that gradient in its source's dtype, for the source's
// gradient edge (its grad accumulator).
//
// The highest sequence number, as AccumulateGrad has: when the bucket's last gradient arrives the
// node runs before the other ready nodes, so the bucket's reduced gradients are freed and its
// parameters' gradients accumulated as early as the engine allows.
struct ConvertGradientsBackward final : torch::autograd::Node {
  ConvertGradientsBackward() : Node(/*sequence_nr=*/UINT64_MAX) {}

  std::vector<c10::ScalarType> dtypes;  // per output: its source's dtype

  variable_list apply(variable_list&& grads) override {
    variable_list converted(grads.size());
    if (c10::GradMode::is_enabled()) {
      // create_graph: recorded, as the engine records its own conversion.
      for (std::size_t i = 0; i < grads.size(); ++i) {
        if (wanted(grads, i)) converted[i] = grads[i].to(dtypes[i]);
      }
      return converted;
    }
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    c10::impl::ExcludeDispatchKeyGuard no_optamp_keys(
        c10::DispatchKeySet({kCastKey, kSubstituteKey}));
    std::vector<Group> groups;
    for (std::size_t i = 0; i < grads.size(); ++i) {
      if (!wanted(grads, i)) continue;
      const at::Tensor& grad = grads[i];
      if (grad.scalar_type() == dtypes[i]) {
        converted[i] = grad;
      } else if (grad.layout() != c10::kStrided || !grad.is_non_overlapping_and_dense()) {
        converted[i] = grad.to(dtypes[i]);  // the engine's conversion, on its own
      } else {
        group_of(groups, grad, dtypes[i]).add(grad, i);
      }
    }
    for (auto& group : groups) group.convert_into(converted);
    return converted;
  }

  std::string name() const override { return "ConvertGradientsBackward"; }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    amp::detail::refuse_compiled_autograd("gradient buckets (ConvertGradientsBackward)");
  }

 private:
  // Gradients of one dtype to be converted to one dtype: one multi-tensor copy (torch's
  // _foreach_copy_ converts on its CUDA fast path when each destination has its source's sizes
  // and strides, which empty_like gives a dense tensor).
  struct Group {
    c10::ScalarType from, to;
    std::vector<at::Tensor> sources, destinations;
    std::vector<std::size_t> outputs;

    void add(const at::Tensor& grad, std::size_t output) {
      sources.push_back(grad);
      destinations.push_back(at::empty_like(grad, grad.options().dtype(to)));
      outputs.push_back(output);
    }
    void convert_into(variable_list& converted) {
      at::_foreach_copy_(destinations, sources);
      for (std::size_t k = 0; k < outputs.size(); ++k) {
        converted[outputs[k]] = std::move(destinations[k]);
      }
    }
  };

  static Group& group_of(std::vector<Group>& groups, const at::Tensor& grad, c10::ScalarType to) {
    for (auto& g : groups) {
      if (g.from == grad.scalar_type() && g.to == to) return g;
    }
    groups.push_back(Group{grad.scalar_type(), to, {}, {}, {}});
    return groups.back();
  }

  // Defined, and needed by this backward (torch.autograd.grad asks for some parameters only).
  bool wanted(const variable_list& grads, std::size_t i) const {
    return grads[i].defined() && task_should_compute_output(i);
  }
};

std::atomic<bool> g_cpu_buckets{false};
std::atomic<bool> g_buckets{true};

}  // namespace

// Which gradients keep their own conversion: those a hook wants when they are computed, not when
// their bucket completes. DDP's reducer (a post hook on each grad accumulator: its bucketed
// all-reduce starts as the gradients arrive and overlaps the rest of the backward), FSDP-style
// post-accumulate hooks, Tensor.register_hook: for those the gradient arrives as before. Tensors
// whose autograd is not only the engine's never reach here (the cache's batch holds plain ones).
bool GradientBuckets::admits(const at::Tensor& source) {
  namespace impl = torch::autograd::impl;
  if (!g_buckets.load(std::memory_order_relaxed)) return false;
  if (source.is_cpu() && !g_cpu_buckets.load(std::memory_order_relaxed)) return false;
  if (!source.is_leaf() || !source.requires_grad() || !is_plain_for_autograd(source)) return false;
  if (!impl::hooks(source).empty() || impl::post_acc_grad_hooks(source) != nullptr) return false;
  const auto accumulator = impl::try_get_grad_accumulator(source);
  return accumulator == nullptr ||
         (accumulator->pre_hooks().empty() && accumulator->post_hooks().empty());
}

// The edges are added before any op uses a copy: autograd fixes a node's topological number once
// another node points to it, and adding an edge after that is refused.
void GradientBuckets::add(const at::Tensor& copy, const at::Tensor& source) {
  const std::int64_t bytes = copy.numel() * static_cast<std::int64_t>(copy.element_size());
  auto* bucket = static_cast<ConvertGradientsBackward*>(bucket_.get());
  // One device per bucket: every input's is its first input's.
  if (bucket == nullptr || bucket->input_metadata(0).device() != copy.device() ||
      (bucket_bytes_ > 0 && bucket_bytes_ + bytes > kBucketBytes)) {
    auto fresh = std::shared_ptr<ConvertGradientsBackward>(new ConvertGradientsBackward(),
                                                           torch::autograd::deleteNode);
    bucket = fresh.get();
    bucket_ = std::move(fresh);
    bucket_bytes_ = 0;
  }
  const auto input = bucket->add_input_metadata(copy);
  bucket->add_next_edge(torch::autograd::impl::gradient_edge(source));
  bucket->dtypes.push_back(source.scalar_type());
  bucket_bytes_ += bytes;
  torch::autograd::impl::set_gradient_edge(copy, {bucket_, input});
}

// Why a copy used again in its step gets an alias: the gradients of all uses of one tensor meet in
// its gradient edge's input buffer and are summed there in the copy's dtype, where the engine's
// own conversions (a copy with its source's edge) summed each use's converted gradient in fp32
// (design.md, "Deviation: casts record no autograd node"). The first use keeps the bucket's edge;
// every later one (a tied embedding's second use, an RNN's next time step, a second micro-batch)
// reads the same memory through a tensor with the source's own edge, so each use's gradient is
// converted on its own and the sum stays fp32.
at::Tensor alias_with_own_edge(const at::Tensor& copy, const at::Tensor& source) {
  at::Tensor alias = tensor_over(copy, copy.sizes(), copy.strides(), copy.storage_offset());
  give_gradient_edge(alias, source);
  return alias;
}

}  // namespace amp::detail

namespace amp {
bool set_gradient_buckets_on_cpu(bool enabled) { return detail::g_cpu_buckets.exchange(enabled); }
bool set_gradient_buckets(bool enabled) { return detail::g_buckets.exchange(enabled); }
}  // namespace amp
