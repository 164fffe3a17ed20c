// amp::FusedAdam / FusedAdamW / FusedSGD: torch::optim's Adam, AdamW and SGD stepped by torch's
// fused kernels, which take the loss scaler's overflow flag and skip on the device
// (optamp/fused_optimizers.h).
#include "optamp/fused_optimizers.h"

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace amp {

void DeviceSkippingOptimizer::add_found_inf(const at::Tensor& found_inf) {
  TORCH_CHECK_VALUE(
      found_inf.defined() && found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat,
      "found_inf must be a one-element float32 tensor, got ",
      found_inf.defined() ? found_inf.toString() : std::string("an undefined tensor"));
  std::lock_guard<std::mutex> lock(mutex_);
  if (!found_inf_.defined()) {
    found_inf_ = found_inf.reshape({});
  } else {
    found_inf_ = at::maximum(found_inf_, found_inf.to(found_inf_.device()).reshape({}));
  }
}

at::Tensor DeviceSkippingOptimizer::take_found_inf() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(found_inf_, at::Tensor());
}

namespace {

using StateMap = ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>;

// What torch's fused kernels take, checked before any state is made: dense gradients, real
// parameters (torch's fused=True refuses complex ones too; the unfused optimizers step them).
void check_fusable(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                   const char* optimizer) {
  for (const auto& group : groups) {
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK_VALUE(!p.grad().is_sparse(), optimizer,
                        " needs dense gradients, got a sparse one for a parameter of shape ",
                        p.sizes());
      TORCH_CHECK_VALUE(!p.is_complex(), optimizer,
                        " needs real parameters (float32, float16, bfloat16 or float64), got ",
                        p.scalar_type(), " for a parameter of shape ", p.sizes(),
                        "; step complex parameters with torch::optim's Adam, AdamW or SGD");
    }
  }
}

// The step's overflow flag where a launch on `device` reads it (none: no guard since the last
// step, so nothing to skip).
std::optional<at::Tensor> found_inf_on(const at::Tensor& found_inf, c10::Device device) {
  if (!found_inf.defined()) return std::nullopt;
  return found_inf.device() == device ? found_inf : found_inf.to(device, /*non_blocking=*/true);
}

// The tensors of one fused launch: the kernels take one device and one dtype per call.
struct Bucket {
  c10::Device device;
  at::ScalarType dtype;
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
};

Bucket& bucket_for(std::vector<Bucket>& buckets, const at::Tensor& p) {
  for (auto& b : buckets)
    if (b.device == p.device() && b.dtype == p.scalar_type()) return b;
  return buckets.emplace_back(Bucket{p.device(), p.scalar_type(), {}, {}, {}, {}, {}, {}});
}

// The parameter's state, created as torch::optim::Adam creates it.
template <typename State>
State& state_of(StateMap& state, const at::Tensor& p, bool amsgrad) {
  auto it = state.find(p.unsafeGetTensorImpl());
  if (it == state.end()) {
    auto fresh = std::make_unique<State>();
    fresh->step(0);
    fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (amsgrad) fresh->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    it = state.emplace(p.unsafeGetTensorImpl(), std::move(fresh)).first;
  }
  return static_cast<State&>(*it->second);
}

// The step count the kernel reads: a float32 0-dim tensor on the parameter's device, started from
// the host count (a fresh state, or one loaded from a checkpoint).
at::Tensor& device_step(detail::DeviceSteps& steps, const at::Tensor& p, int64_t host_step) {
  at::Tensor& t = steps[p.unsafeGetTensorImpl()];
  if (!t.defined() || t.device() != p.device()) {
    t = at::full({}, static_cast<double>(host_step),
                 at::TensorOptions(at::kFloat).device(p.device()));
  }
  return t;
}

// torch's _fused_adam(w)_ and _fused_sgd_ write the parameters without bumping their version
// counters (torch 2.11), as every other in-place write does: bumped here, so that autograd sees a
// saved parameter changed and a step inside a scale_loss guard is seen at the guard's end.
void bump_versions(const std::vector<at::Tensor>& params) {
  for (const auto& p : params) {
    if (!p.is_inference()) p.unsafeGetTensorImpl()->bump_version();
  }
}

template <typename Options, typename State>
void fused_step(std::vector<torch::optim::OptimizerParamGroup>& groups, StateMap& state,
                detail::DeviceSteps& steps, const at::Tensor& found_inf, bool decoupled) {
  check_fusable(groups, decoupled ? "FusedAdamW" : "FusedAdam");
  for (auto& group : groups) {
    const auto& o = static_cast<const Options&>(group.options());
    std::vector<Bucket> buckets;
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      State& s = state_of<State>(state, p, o.amsgrad());
      Bucket& b = bucket_for(buckets, p);
      b.params.push_back(p);
      b.grads.push_back(p.grad());
      b.exp_avgs.push_back(s.exp_avg());
      b.exp_avg_sqs.push_back(s.exp_avg_sq());
      if (o.amsgrad()) b.max_exp_avg_sqs.push_back(s.max_exp_avg_sq());
      b.steps.push_back(device_step(steps, p, s.step()));
    }
    const auto [beta1, beta2] = o.betas();
    for (auto& b : buckets) {
      const std::optional<at::Tensor> found = found_inf_on(found_inf, b.device);
      at::_foreach_add_(b.steps, 1);
      if (decoupled) {
        at::_fused_adamw_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.steps,
                          o.lr(), beta1, beta2, o.weight_decay(), o.eps(), o.amsgrad(),
                          /*maximize=*/false, /*grad_scale=*/std::nullopt, found);
      } else {
        at::_fused_adam_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.steps,
                         o.lr(), beta1, beta2, o.weight_decay(), o.eps(), o.amsgrad(),
                         /*maximize=*/false, /*grad_scale=*/std::nullopt, found);
      }
      // A skipped step does not count (the kernel left everything else as it was).
      if (found) at::_foreach_add_(b.steps, *found, -1);
      bump_versions(b.params);
    }
  }
}

// Brings the host's AdamParamState::step up to date from the device counts (one copy).
template <typename State>
void settle_steps(const StateMap& state, const detail::DeviceSteps& steps) {
  std::vector<std::pair<State*, at::Tensor>> live;
  for (const auto& [impl, t] : steps) {
    auto it = state.find(impl);
    if (it != state.end()) live.emplace_back(static_cast<State*>(it->second.get()), t);
  }
  if (live.empty()) return;
  // Gathered on one device first, so that the host waits once, not once per parameter.
  const c10::Device device = live.front().second.device();
  std::vector<at::Tensor> counts;
  counts.reserve(live.size());
  for (const auto& [s, t] : live) counts.push_back(t.to(device).reshape({1}));
  const at::Tensor host = at::cat(counts).to(at::kCPU);
  const float* values = host.const_data_ptr<float>();
  for (size_t i = 0; i < live.size(); ++i) live[i].first->step(static_cast<int64_t>(values[i]));
}

template <typename Step>
torch::Tensor run_step(const torch::optim::Optimizer::LossClosure& closure, Step&& step) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  step();
  return loss;
}

// Which kernel and which option/state classes each family member uses.
template <typename Base>
struct Family;
template <>
struct Family<torch::optim::Adam> {
  using Options = torch::optim::AdamOptions;
  using State = torch::optim::AdamParamState;
  static constexpr bool kDecoupled = false;
};
template <>
struct Family<torch::optim::AdamW> {
  using Options = torch::optim::AdamWOptions;
  using State = torch::optim::AdamWParamState;
  static constexpr bool kDecoupled = true;
};

}  // namespace

template <typename Base>
torch::Tensor FusedAdamFamily<Base>::step(LossClosure closure) {
  using F = Family<Base>;
  return run_step(closure, [this] {
    fused_step<typename F::Options, typename F::State>(this->param_groups_, this->state_, steps_,
                                                       take_found_inf(), F::kDecoupled);
  });
}

template <typename Base>
void FusedAdamFamily<Base>::save(torch::serialize::OutputArchive& archive) const {
  settle_steps<typename Family<Base>::State>(this->state_, steps_);
  Base::save(archive);
}

template <typename Base>
void FusedAdamFamily<Base>::load(torch::serialize::InputArchive& archive) {
  Base::load(archive);
  steps_.clear();  // the loaded host counts start the device counts again
}

template class FusedAdamFamily<torch::optim::Adam>;
template class FusedAdamFamily<torch::optim::AdamW>;

namespace {

// The tensors of one fused SGD launch: one device and dtype, and one value of is_first_step
// (parameters whose momentum buffer this step creates launch apart from the others).
struct SgdBucket {
  c10::Device device;
  at::ScalarType dtype;
  bool first;
  std::vector<at::Tensor> params, grads, buffers;
};

SgdBucket& sgd_bucket_for(std::vector<SgdBucket>& buckets, const at::Tensor& p, bool first) {
  for (auto& b : buckets)
    if (b.device == p.device() && b.dtype == p.scalar_type() && b.first == first) return b;
  return buckets.emplace_back(SgdBucket{p.device(), p.scalar_type(), first, {}, {}, {}});
}

using SgdState = torch::optim::SGDParamState;

// A new momentum buffer for `p`, kept in `state`: as zeros for a kernel call that is not a first
// step (dampening 0: 0 * momentum + grad is the first step's grad, and a skipped step leaves
// zeros, so the next one is a first step again), else uninitialized (the first-step kernel
// writes it).
at::Tensor new_sgd_buffer(StateMap& state, const at::Tensor& p, bool zeros) {
  auto fresh = std::make_unique<SgdState>();
  fresh->momentum_buffer(zeros ? at::zeros_like(p, at::MemoryFormat::Preserve)
                               : at::empty_like(p, at::MemoryFormat::Preserve));
  at::Tensor buffer = fresh->momentum_buffer();
  state.emplace(p.unsafeGetTensorImpl(), std::move(fresh));
  return buffer;
}

// With dampening != 0 a first step cannot be redone on the device: the step that creates
// buffers reads the flag once (a skipped one creates none and changes nothing).
bool overflowed_on_the_host(const at::Tensor& found_inf) {
  return found_inf.defined() && found_inf.item<float>() != 0.0f;
}

// torch::optim::SGD's update written out, skipped where `found` (if given) is set without a host
// read. For what torch's fused kernel gets wrong: on the CPU (torch 2.11) its vectorized loop
// leaves fp16/bf16 parameters unchanged (it writes the momentum buffers, not the parameters) for
// every tensor of 16 elements or more.
void reference_sgd_step(const SgdBucket& b, const torch::optim::SGDOptions& o,
                        const std::optional<at::Tensor>& found) {
  for (size_t i = 0; i < b.params.size(); ++i) {
    const at::Tensor& p = b.params[i];
    at::Tensor d_p = b.grads[i];
    if (o.weight_decay() != 0) d_p = d_p.add(p, o.weight_decay());
    at::Tensor buf;
    if (o.momentum() != 0) {
      buf = b.first ? d_p.clone() : b.buffers[i].mul(o.momentum()).add(d_p, 1 - o.dampening());
      d_p = o.nesterov() ? d_p.add(buf, o.momentum()) : buf;
    }
    at::Tensor updated = p.add(d_p, -o.lr());
    if (found) {
      const at::Tensor skip = found->ne(0);
      updated = at::where(skip, p, updated);
      if (buf.defined()) buf = at::where(skip, b.buffers[i], buf);
    }
    p.copy_(updated);
    if (buf.defined()) b.buffers[i].copy_(buf);
  }
}

bool fused_kernel_is_wrong_for(const SgdBucket& b) {
  return b.device.is_cpu() && (b.dtype == at::kHalf || b.dtype == at::kBFloat16);
}

void fused_sgd_step(std::vector<torch::optim::OptimizerParamGroup>& groups, StateMap& state,
                    const at::Tensor& found_inf) {
  check_fusable(groups, "FusedSGD");
  std::optional<bool> skipped_first;  // the one host read, made at most once per step
  for (auto& group : groups) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    const bool damped = o.dampening() != 0;
    std::vector<SgdBucket> buckets;
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const auto it = o.momentum() != 0 ? state.find(p.unsafeGetTensorImpl()) : state.end();
      const bool creates = o.momentum() != 0 && it == state.end();
      if (creates && damped) {
        if (!skipped_first) skipped_first = overflowed_on_the_host(found_inf);
        if (*skipped_first) continue;
      }
      // Only a damped buffer's first step runs the first-step kernel; an undamped one is zeros.
      SgdBucket& b = sgd_bucket_for(buckets, p, creates && damped);
      b.params.push_back(p);
      b.grads.push_back(p.grad());
      if (creates) {
        b.buffers.push_back(new_sgd_buffer(state, p, /*zeros=*/!damped));
      } else if (o.momentum() != 0) {
        b.buffers.push_back(static_cast<SgdState&>(*it->second).momentum_buffer());
      }
    }
    for (auto& b : buckets) {
      // A damped first-step launch runs only after the host read found no overflow.
      const std::optional<at::Tensor> found =
          b.first ? std::nullopt : found_inf_on(found_inf, b.device);
      if (fused_kernel_is_wrong_for(b)) {
        reference_sgd_step(b, o, found);
        continue;
      }
      at::_fused_sgd_(b.params, b.grads, b.buffers, o.weight_decay(), o.momentum(), o.lr(),
                      o.dampening(), o.nesterov(), /*maximize=*/false, /*is_first_step=*/b.first,
                      /*grad_scale=*/std::nullopt, found);
      bump_versions(b.params);
    }
  }
}

}  // namespace

torch::Tensor FusedSGD::step(LossClosure closure) {
  return run_step(closure,
                  [this] { fused_sgd_step(this->param_groups_, this->state_, take_found_inf()); });
}

}  // namespace amp
