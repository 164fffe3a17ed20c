// The tensor-level scale_loss (optamp/core.h): the guard's state, rescaling for gradient
// accumulation, the fused unscale/check at its end, overflow handling, and the records amp::step
// reads. The torch::optim overloads and amp::step: scale_loss.cpp.
#include "optamp/core.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "common/compiled_autograd.h"
#include "dispatch/cast_decision.h"
#include "optamp/loss_scaler.h"
#include "scaler/loss_scaler_set.h"
#include "scaler/scalable_dtypes.h"
#include "scaler/scale_loss.h"
#include "session.h"

namespace amp {
namespace detail {
namespace {

// A guard's parameters by address (sorted), each with its index in the guard's parameter list.
using ParamsByAddress = std::vector<std::pair<c10::TensorImpl*, size_t>>;

// The first parameter (lowest index) of `mine` that `other` holds too, if any: a merge of the two
// sorted lists.
std::optional<size_t> first_shared(const ParamsByAddress& mine, const ParamsByAddress& other) {
  std::optional<size_t> first;
  auto a = mine.begin();
  auto b = other.begin();
  while (a != mine.end() && b != other.end()) {
    if (a->first == b->first) {
      first = std::min(first.value_or(a->second), a->second);
      ++a;
    } else {
      a->first < b->first ? ++a : ++b;
    }
  }
  return first;
}

// The bookkeeping shared by all guards.
//  - live: the parameters of each live guard (nesting on the same optimizer is an error). One
//    entry per guard, not per parameter: there is rarely more than one live guard (usually none),
//    so a step's guard costs no per-parameter hashing here.
//  - pending: parameters whose .grad holds *scaled* gradients after a guard with delay_unscale
//    (the next guard must not scale them again, and amp::step must not step them).
//  - overflowed: parameters a guard reset after an overflow since their last amp::step. A later
//    guard's backward refills those grads, so only this record lets amp::step skip the step.
struct Pending {
  c10::weak_intrusive_ptr<c10::TensorImpl> param;
};

struct Book {
  std::mutex mutex;
  std::vector<const ParamsByAddress*> live;
  std::unordered_map<c10::TensorImpl*, Pending> pending;
  std::unordered_map<c10::TensorImpl*, c10::weak_intrusive_ptr<c10::TensorImpl>> overflowed;

  // Records an overflow of `p`. Users stepping with the plain step() never consume the records,
  // so dead parameters' entries are pruned whenever the map has doubled since the last prune.
  void mark_overflowed(const at::Tensor& p) {
    overflowed.insert_or_assign(p.unsafeGetTensorImpl(),
                                c10::weak_intrusive_ptr<c10::TensorImpl>(p.getIntrusivePtr()));
    if (overflowed.size() < 2 * overflowed_after_prune + 64) return;
    for (auto it = overflowed.begin(); it != overflowed.end();) {
      it = it->second.expired() ? overflowed.erase(it) : std::next(it);
    }
    overflowed_after_prune = overflowed.size();
  }
  // Whether `p` overflowed since its last amp::step; forgets it.
  bool take_overflowed(const at::Tensor& p) {
    auto it = overflowed.find(p.unsafeGetTensorImpl());
    if (it == overflowed.end()) return false;
    const bool live = it->second.lock().get() == p.unsafeGetTensorImpl();
    overflowed.erase(it);
    return live;
  }
  size_t overflowed_after_prune = 0;

  // The live record for `p` (drops a record whose parameter died and whose address was reused).
  Pending* find(const at::Tensor& p) {
    if (pending.empty()) return nullptr;  // the common case: no delayed guard came before
    auto it = pending.find(p.unsafeGetTensorImpl());
    if (it == pending.end()) return nullptr;
    if (it->second.param.lock().get() != p.unsafeGetTensorImpl()) {
      pending.erase(it);
      return nullptr;
    }
    return &it->second;
  }
};

Book& book() {
  // Leaked, as the published session and the cast cache are: at process exit a guard on another
  // thread may still be ending.
  static auto* instance = new Book();
  return *instance;
}

// The model's name for `p` ("fc1.weight"), when initialize was given one.
std::optional<std::string> model_name(const at::Tensor& p) {
  const ParameterRecord* record = current_session()->find_parameter(p);
  if (record == nullptr || record->name.empty()) return std::nullopt;
  return record->name;
}

}  // namespace

ScaledGradMarks take_scaled_grad_marks(const c10::TensorImpl* impl) {
  auto& b = book();
  std::lock_guard<std::mutex> lock(b.mutex);
  auto* key = const_cast<c10::TensorImpl*>(impl);
  ScaledGradMarks marks;
  marks.pending = b.pending.erase(key) != 0;
  marks.overflowed = b.overflowed.erase(key) != 0;
  return marks;
}

void put_scaled_grad_marks(const at::Tensor& p, ScaledGradMarks marks) {
  auto& b = book();
  std::lock_guard<std::mutex> lock(b.mutex);
  const c10::weak_intrusive_ptr<c10::TensorImpl> ref(p.getIntrusivePtr());
  if (marks.pending) b.pending.insert_or_assign(p.unsafeGetTensorImpl(), Pending{ref});
  if (marks.overflowed) b.overflowed.insert_or_assign(p.unsafeGetTensorImpl(), ref);
}

struct ScaleLossState {
  std::shared_ptr<LossScaler> scaler;
  ScaleLossOptions options;
  core::DeviceSkip device_skip;    // set: the optimizers skip on the device
  core::StepWitness step_witness;  // set: the front watches its optimizers' state too
  at::Tensor scaled_loss;
  at::Tensor inv_scale;  // 1/scale the loss was multiplied by (unscaling uses this, see below)
  // False once the guard has finished: a backward through scaled_loss then raises (its
  // gradients would stay multiplied by the scale, since nothing unscales them any more).
  std::shared_ptr<std::atomic<bool>> live = std::make_shared<std::atomic<bool>>(true);
  // Set when a backward passed through scaled_loss (from the autograd engine's thread).
  std::shared_ptr<std::atomic<bool>> backpropagated = std::make_shared<std::atomic<bool>>(false);
  // Set when such a backward accumulates into .grad everywhere it reaches (a plain backward, not
  // torch.autograd.grad nor backward(inputs=...)).
  std::shared_ptr<std::atomic<bool>> accumulated = std::make_shared<std::atomic<bool>>(false);
  std::vector<at::Tensor> params;
  core::ParamLabeler labeler;        // names the caller's i-th parameter
  std::vector<size_t> caller_index;  // params[j] is the caller's caller_index[j]-th parameter
  std::string label(size_t j) const { return labeler(caller_index[j]); }
  ParamsByAddress by_address;  // params, sorted by address (Book::live)
  // Gradient accumulation (docs/loss_scaling.md): at entry, params[i] had no gradient (fresh),
  // an unscaled one, which the guard multiplied by the scale (rescaled: the backward accumulates
  // onto it at the same scale), or a scaled one from a delay_unscale guard (neither).
  std::vector<bool> fresh;
  std::vector<size_t> unscaled;  // the params with an unscaled gradient at entry
  // Once the rescale succeeded: each such param, with its gradient as the backward found it
  // (tensor and version; one the backward changed got a gradient inside the guard).
  struct Rescaled {
    size_t param;
    c10::TensorImpl* grad;
    int64_t version;
  };
  std::vector<Rescaled> rescaled;
  std::vector<at::Tensor> carried;  // the rescale's non-finite flags (LossScaler::rescale)
  // Each trainable parameter's version counter at entry (kUntracked for the others): one that
  // moved by the guard's end was changed in place inside it (a step on the scaled gradients).
  static constexpr int64_t kUntracked = -1;
  std::vector<int64_t> versions_at_entry;
  int uncaught_at_entry = 0;
  bool finished = false;
  bool skipped = false;  // this guard's own step overflowed (not another thread's)
};

struct ScaledLossAccess {
  static ScaledLoss make(std::unique_ptr<ScaleLossState> s) { return ScaledLoss(std::move(s)); }
  static ScaleLossState* state(ScaledLoss& g) { return g.state_.get(); }
};

std::string param_label(const at::Tensor& p, const std::string& where) {
  const auto name = model_name(p);
  return name ? *name + " (" + where + ")" : where;
}

namespace {

// The guard's hook on the scaled loss (on its grad_fn, which has that one output): records that
// a backward passed through it and refuses one after the guard finished. A named hook rather
// than Tensor::register_hook's, so that compiled autograd's refusal says what refused.
struct ScaledLossReached final : torch::autograd::FunctionPreHook {
  ScaledLossReached(std::shared_ptr<std::atomic<bool>> live,
                    std::shared_ptr<std::atomic<bool>> reached,
                    std::shared_ptr<std::atomic<bool>> accumulated, int loss_id)
      : live_(std::move(live)),
        reached_(std::move(reached)),
        accumulated_(std::move(accumulated)),
        loss_id_(loss_id) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    reached_->store(true);
    const auto* asked_for = torch::autograd::get_current_graph_task_exec_info();
    if (asked_for == nullptr || asked_for->empty()) accumulated_->store(true);
    TORCH_CHECK(live_->load(), "backward through the scaled loss of a scale_loss guard (loss_id ",
                loss_id_,
                ") that has already finished: its gradients would stay multiplied by the "
                "loss scale, since the guard unscales only on its own exit. Call backward "
                "inside the guard (C++: while the ScaledLoss lives; Python: inside the "
                "`with amp.scale_loss(...) as scaled_loss:` block).");
    return grads;
  }

  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    refuse_compiled_autograd("scale_loss guard (its hook on the scaled loss)");
  }

 private:
  std::shared_ptr<std::atomic<bool>> live_, reached_, accumulated_;
  int loss_id_;
};

std::string describe_param(const ScaleLossState& s, size_t i) {
  const auto name = model_name(s.params[i]);
  std::ostringstream out;
  out << (name ? *name + " " : std::string()) << "(" << s.label(i) << ", shape "
      << s.params[i].sizes() << ")";
  return out.str();
}

bool in_live_guard(const Book& b, const at::Tensor& p) {
  const std::pair<c10::TensorImpl*, size_t> key{p.unsafeGetTensorImpl(), 0};
  for (const ParamsByAddress* guard : b.live) {
    auto it = std::lower_bound(guard->begin(), guard->end(), key,
                               [](const auto& x, const auto& y) { return x.first < y.first; });
    if (it != guard->end() && it->first == key.first) return true;
  }
  return false;
}

// Nesting: a parameter of `s` inside another live guard is an error. Callers hold the book's lock.
void refuse_live_params(const Book& b, const ScaleLossState& s, const char* owner_kind) {
  for (const ParamsByAddress* other : b.live) {
    const std::optional<size_t> j = first_shared(s.by_address, *other);
    TORCH_CHECK(!j, "scale_loss guards must not be nested on the same ", owner_kind, ": ",
                j ? param_label(s.params[*j], s.label(*j)) : std::string(),
                " is already inside an active scale_loss guard; let the outer guard finish "
                "(leave its scope) first");
  }
}

// Unwinding (or an explicit abort): no check, no scale update. Gradients that appeared inside the
// guard are dropped and rescaled ones are divided by the scale again, which gives back the
// gradients of entry where the backward did not reach them, and adds the (unscaled) part it
// computed before the error where it did; delayed (scaled) ones stay as they are.
void restore(ScaleLossState& s) {
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (s.fresh[i]) s.params[i].mutable_grad() = at::Tensor();
  }
  for (const auto& r : s.rescaled) {
    const at::Tensor& grad = s.params[r.param].grad();
    if (!grad.defined()) continue;
    at::Tensor values = grad.is_sparse() ? grad._values() : grad;
    values.mul_(s.inv_scale.to(values.device()).reshape({}));
  }
}

// The end of every guard, however it ended: its parameters are free for other guards.
void release_guard(ScaleLossState& s) {
  auto& b = book();
  std::lock_guard<std::mutex> lock(b.mutex);
  const auto it = std::find(b.live.begin(), b.live.end(), &s.by_address);
  if (it != b.live.end()) b.live.erase(it);
}

// delay_unscale: the grads stay scaled, which records say to the next guard (and amp::step).
void record_scaled_grads(ScaleLossState& s) {
  auto& b = book();
  std::lock_guard<std::mutex> lock(b.mutex);
  for (const at::Tensor& p : s.params) {
    b.pending.insert_or_assign(
        p.unsafeGetTensorImpl(),
        Pending{c10::weak_intrusive_ptr<c10::TensorImpl>(p.getIntrusivePtr())});
  }
}

// The error after kFloorSkipLimit consecutive skips at the minimum scale. Only now: a
// per-parameter check of this step's gradients (one sync per gradient) names the culprits.
std::string floor_message(const ScaleLossState& s, const LossScaler& scaler,
                          const LossScaler::StepResult& result,
                          const std::vector<at::Tensor>& grads,
                          const std::vector<size_t>& grad_param) {
  std::ostringstream names;
  int count = 0;
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& g = grads[k];
    if (!at::isfinite(g.is_sparse() ? g._values() : g).all().item<bool>()) {
      names << (count++ ? ", " : "") << describe_param(s, grad_param[k]);
    }
  }
  std::ostringstream msg;
  const char* bottom = !scaler.dynamic()                                 ? "its fixed loss scale"
                       : scaler.lowest_scale() > LossScaler::kScaleFloor ? "min_loss_scale"
                                                                         : "the scale floor";
  msg << "amp: loss scaler " << scaler.loss_id() << " skipped " << result.floor_skips
      << " consecutive steps at " << bottom << " (" << result.loss_scale
      << ") because of non-finite gradients; the model diverged"
      << (scaler.dynamic() ? " or min_loss_scale is too high" : "")
      << ". Parameters with non-finite gradients in the last step: "
      << (count ? names.str()
                : std::string("(none now: the overflow was in an earlier step's gradients)"));
  return msg.str();
}

// As torch's GradScaler: an fp16 sparse gradient is coalesced before its values are checked,
// since duplicate indices summed later (by the optimizer) could overflow where each was finite.
void coalesce_if_half_sparse(at::Tensor& grad) {
  if (grad.defined() && grad.is_sparse() && grad.scalar_type() == at::kHalf &&
      !grad.is_coalesced()) {
    grad = grad.coalesce();
  }
}

void finish_normally(ScaleLossState& s) {
  if (s.options.delay_unscale) return record_scaled_grads(s);  // grads stay scaled
  LossScaler& scaler = *s.scaler;

  std::vector<at::Tensor> grads;
  std::vector<size_t> grad_param;
  grads.reserve(s.params.size());  // growing them copied every tensor again (refcounts)
  grad_param.reserve(s.params.size());
  for (size_t i = 0; i < s.params.size(); ++i) {
    coalesce_if_half_sparse(s.params[i].mutable_grad());
    const at::Tensor& g = s.params[i].grad();
    if (g.defined()) {
      grads.push_back(g);
      grad_param.push_back(i);
    }
  }

  // The records of delay_unscale guards before this one stay until the unscale succeeded.
  auto settle_book = [&s](bool overflowed) {
    auto& b = book();
    std::lock_guard<std::mutex> lock(b.mutex);
    for (size_t i = 0; i < s.params.size(); ++i) {
      if (!b.pending.empty()) b.pending.erase(s.params[i].unsafeGetTensorImpl());
      if (overflowed) b.mark_overflowed(s.params[i]);
    }
  };
  LossScaler::check_gradients(grads, {});  // bad gradients: an error, nothing changed
  LossScaler::StepResult result;
  try {
    // Unscale with this guard's own 1/scale and overflow flag; the step's only device->host sync,
    // none when the optimizers skip on the device.
    result = scaler.finish_step(grads, {}, s.inv_scale,
                                /*on_device=*/static_cast<bool>(s.device_skip), s.carried);
  } catch (...) {
    // A found_inf reducer failed (e.g. a collective timed out), or the unscale itself: whether
    // this or another rank overflowed is unknown, so this step is skipped as on an overflow, and
    // the error propagates. The scale is unchanged.
    settle_book(true);
    for (auto& p : s.params) p.mutable_grad() = at::Tensor();
    throw;
  }
  settle_book(result.skipped);
  s.skipped = result.skipped;
  const std::string floor_error =
      result.floor_limit ? floor_message(s, scaler, result, grads, grad_param) : std::string();
  if (result.skipped) {
    for (auto& p : s.params) p.mutable_grad() = at::Tensor();
  }
  if (result.found_inf.defined()) s.device_skip(result.found_inf);
  TORCH_CHECK(floor_error.empty(), floor_error);
}

// `loss.backward()` in place of `scaled_loss.backward()` inside the guard (Apex's and GradScaler's
// users make that slip too) gives unscaled gradients, which the guard's exit then divides by the
// scale: training goes on, silently, with gradients thousands of times too small. Seen here as
// gradients that appeared during the guard (its parameters had none at entry) while no backward
// passed through the scaled loss, or rescaled gradients that it changed.
void warn_if_the_scaled_loss_was_bypassed(const ScaleLossState& s) {
  if (s.backpropagated->load()) return;
  size_t appeared = 0;
  for (size_t i = 0; i < s.params.size(); ++i) {
    appeared += s.fresh[i] && s.params[i].grad().defined();
  }
  for (const auto& r : s.rescaled) {
    const at::Tensor& grad = s.params[r.param].grad();
    appeared +=
        grad.defined() && (grad.unsafeGetTensorImpl() != r.grad || grad._version() != r.version);
  }
  if (appeared == 0) return;
  TORCH_WARN("amp: scale_loss guard (loss_id ", s.options.loss_id, ") finished without a backward ",
             "through its scaled loss, but ", appeared, " of its parameters received gradients ",
             "inside it: they were not scaled, and unscaling divides them by the loss scale. ",
             "Call backward on the scaled loss the guard gives (C++: `scaled.backward()`; ",
             "Python: `with amp.scale_loss(loss, optimizer) as scaled_loss: ",
             "scaled_loss.backward()`), not on the loss itself.");
}

// A backward through the scaled loss that reached none of the guard's trainable parameters: the
// optimizers hold other tensors than the forward used (built before FSDP's fully_shard replaced
// the model's parameters, or over a model re-created since). Each step then changes nothing,
// silently; torch's GradScaler raises there ("No inf checks were recorded for this optimizer").
void warn_if_no_parameter_got_a_gradient(const ScaleLossState& s) {
  if (!s.accumulated->load()) return;
  size_t trainable = 0;
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (s.params[i].grad().defined() || !s.fresh[i]) return;
    trainable += s.params[i].requires_grad();
  }
  if (trainable == 0) return;
  TORCH_WARN("amp: scale_loss guard (loss_id ", s.options.loss_id, "): the backward of the ",
             "scaled loss gave no gradient to any of its optimizers' ", trainable,
             " trainable parameters, so their step changes nothing. The optimizers do not hold ",
             "the tensors the forward used: build them over the model's parameters after any ",
             "wrapper that replaces them (FSDP's fully_shard: shard first, then build the ",
             "optimizer and call initialize) and pass initialize and scale_loss those optimizers.");
}

// Gradients an earlier guard left unscaled are brought to this guard's scale (LossScaler::rescale):
// the backward accumulates onto them, and anything that reads .grad in between (DDP's all-reduce
// after no_sync) sees the whole sum. The common step (grads reset before it) has none.
void rescale_accumulated(ScaleLossState& s) {
  if (s.unscaled.empty()) return;
  std::vector<at::Tensor> grads;
  grads.reserve(s.unscaled.size());
  for (size_t i : s.unscaled) grads.push_back(s.params[i].grad());
  s.carried = s.scaler->rescale(grads, s.inv_scale, /*flags=*/static_cast<bool>(s.device_skip));
  s.rescaled.reserve(grads.size());  // from here on restore() divides them again
  for (size_t k = 0; k < grads.size(); ++k) {
    s.rescaled.push_back({s.unscaled[k], grads[k].unsafeGetTensorImpl(), grads[k]._version()});
  }
}

// An optimizer stepped inside the guard: C++'s `auto scaled = amp::scale_loss(...);
// scaled.backward(); optimizer.step();` without braces around the first two (the guard then
// lives past the step), a step from a post-accumulate-grad hook during the backward, or a
// hand-written update inside the block. The step used gradients still multiplied by the scale
// and not checked for inf/NaN, which the guard can no longer undo; training on would go on
// silently with updates thousands of times too large. Seen, after the fact, as a trainable
// parameter whose version counter moved (every in-place write bumps it; the forward, the
// backward and the guard's own unscale write only gradients), or from the front's step witness
// (what a write through p.data() leaves: LibTorch SGD's momentum buffers). Python refuses a step
// of the guard's optimizers before it runs (a step pre-hook); LibTorch's optimizers have no hooks.
std::optional<std::string> parameters_changed_inside(const ScaleLossState& s) {
  size_t changed = 0;
  std::optional<size_t> first;
  for (size_t i = 0; i < s.params.size(); ++i) {
    const int64_t at_entry = s.versions_at_entry[i];
    if (at_entry == ScaleLossState::kUntracked || s.params[i]._version() == at_entry) continue;
    if (!first) first = i;
    ++changed;
  }
  if (!first) return std::nullopt;
  std::ostringstream what;
  what << describe_param(s, *first);
  if (changed > 1) what << " and " << changed - 1 << " more parameters";
  what << (changed > 1 ? " were" : " was") << " changed in place";
  return what.str();
}

std::optional<std::string> stepped_inside(const ScaleLossState& s) {
  std::optional<std::string> what = parameters_changed_inside(s);
  if (!what && s.step_witness) what = s.step_witness();
  if (!what) return std::nullopt;
  std::ostringstream msg;
  msg << "amp: " << *what << " inside the scale_loss guard "
      << "(loss_id " << s.options.loss_id << "): an optimizer step inside the guard updates "
      << "with gradients still multiplied by the loss scale and not checked for inf/NaN. Step "
      << "after the guard has finished: C++ `{ auto scaled = amp::scale_loss(loss, optimizer); "
      << "scaled.backward(); } optimizer.step();` (the braces end the guard; without them it "
      << "lives past the step), Python `optimizer.step()` after the `with amp.scale_loss(...)` "
      << "block, no optimizer stepped from a gradient hook during the backward. That update has "
      << "already been applied; the gradients made inside the guard were dropped and the loss "
      << "scale is unchanged.";
  return msg.str();
}

void finish(ScaleLossState& s, bool unwinding) {
  if (s.finished) return;
  s.finished = true;
  s.live->store(false);
  struct Release {
    ScaleLossState& s;
    ~Release() { release_guard(s); }
  } release{s};
  if (unwinding) {
    restore(s);
    return;
  }
  if (auto stepped = stepped_inside(s)) {
    restore(s);  // as an unwinding guard: no check, no scale update
    TORCH_CHECK(false, *stepped);
  }
  warn_if_the_scaled_loss_was_bypassed(s);
  warn_if_no_parameter_got_a_gradient(s);
  finish_normally(s);
}

// initialize turns casting on for the thread that calls it. A loss scaled on another thread was
// (most likely) computed there in plain fp32: say so once instead of training silently in fp32.
void warn_if_casting_is_off_here() {
  if (level_low_dtype() == c10::ScalarType::Undefined || thread_key_on()) return;
  TORCH_WARN_ONCE(
      "amp::scale_loss runs on a thread where optamp's casting is off, although amp::initialize "
      "set up a casting level: initialize turns casting on only for the thread that called it, "
      "so the forward on this thread ran in plain fp32. Carry the state over with "
      "amp::ThreadState::capture() / amp::thread_state_guard (Python: optamp.ThreadState.capture() "
      "/ optamp.thread_state_guard), or call initialize on the training thread.");
}

}  // namespace

}  // namespace detail

ScaledLoss::ScaledLoss(std::unique_ptr<detail::ScaleLossState> state) : state_(std::move(state)) {}
ScaledLoss::ScaledLoss(ScaledLoss&& other) noexcept = default;

ScaledLoss::~ScaledLoss() noexcept(false) {
  if (!state_ || state_->finished) return;
  if (std::uncaught_exceptions() > state_->uncaught_at_entry) {
    try {
      detail::finish(*state_, /*unwinding=*/true);
    } catch (...) {  // never throw while another exception unwinds
    }
    return;
  }
  detail::finish(*state_, /*unwinding=*/false);
}

const at::Tensor& ScaledLoss::loss() const {
  TORCH_CHECK(state_ && !state_->finished,
              "ScaledLoss::loss() must be called on a live guard, got a finished or moved-from "
              "one");
  return state_->scaled_loss;
}

// NOLINTNEXTLINE(readability-make-member-function-const): runs the backward, not a const read
void ScaledLoss::backward(const std::optional<at::Tensor>& gradient,
                          std::optional<bool> retain_graph, bool create_graph) {
  loss().backward(gradient.value_or(at::Tensor()), retain_graph, create_graph);
}

namespace core {

using namespace detail;  // this file's internals

bool finish(ScaledLoss& guard, bool unwinding) {
  ScaleLossState* s = ScaledLossAccess::state(guard);
  if (!s) return false;
  detail::finish(*s, unwinding);
  return s->skipped;
}

ParamLabeler optimizer_param_labels(std::vector<std::vector<size_t>> group_sizes) {
  return [sizes = std::move(group_sizes)](size_t index) {
    size_t rest = index;
    for (size_t k = 0; k < sizes.size(); ++k) {
      for (size_t g = 0; g < sizes[k].size(); ++g) {
        if (rest < sizes[k][g]) {
          return "optimizer " + std::to_string(k) + " param_groups[" + std::to_string(g) +
                 "].params[" + std::to_string(rest) + "]";
        }
        rest -= sizes[k][g];
      }
    }
    return "param " + std::to_string(index);  // beyond the layout given
  };
}

ScaledLoss scale_loss(const at::Tensor& loss, std::vector<at::Tensor> params,
                      std::vector<std::string> labels, ScaleLossOptions options,
                      const char* owner_kind, DeviceSkip device_skip) {
  ParamLabeler labeler = [labels = std::move(labels)](size_t i) {
    return i < labels.size() ? labels[i] : "param " + std::to_string(i);
  };
  return scale_loss(loss, std::move(params), std::move(labeler), options, owner_kind,
                    std::move(device_skip));
}

ScaledLoss scale_loss(const at::Tensor& loss, std::vector<at::Tensor> params, ParamLabeler labels,
                      ScaleLossOptions options, const char* owner_kind, DeviceSkip device_skip,
                      StepWitness step_witness) {
  std::shared_ptr<LossScaler> scaler_ptr = loss_scaler_ptr(options.loss_id);  // configured? id?
  TORCH_CHECK_VALUE(loss.defined(), "loss must be a defined tensor, got an undefined tensor");
  // Any shape, as Apex's `loss.float() * scale` and GradScaler.scale take: per-sample losses
  // reach backward through `scaled.backward(gradient)`.
  TORCH_CHECK_VALUE(at::isFloatingType(loss.scalar_type()) && loss.numel() > 0,
                    "loss must be a floating-point tensor with at least one element, got a ",
                    loss.scalar_type(), " tensor of shape ", loss.sizes());
  TORCH_CHECK_VALUE(loss.requires_grad() && loss.grad_fn() != nullptr,
                    "loss must have a grad_fn (be computed from parameters that require grad, "
                    "with grad mode on), got a tensor with requires_grad=",
                    loss.requires_grad() ? "True" : "False", " and no grad_fn");
  // The scaled loss is made here and must record its graph for the backward (and carry the
  // guard's hook on its grad_fn).
  TORCH_CHECK_VALUE(c10::GradMode::is_enabled(),
                    "scale_loss must be entered with grad mode on: the scaled loss it makes "
                    "needs a graph for its backward; got grad mode off (torch.no_grad() / "
                    "inference_mode, C++ NoGradGuard) around the guard");
  TORCH_CHECK_VALUE(!params.empty(), owner_kind,
                    " must have at least one parameter, got one with no parameters");
  if (!labels) labels = [](size_t i) { return "param " + std::to_string(i); };

  auto s = std::make_unique<ScaleLossState>();
  s->labeler = std::move(labels);
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_VALUE(params[i].defined(), owner_kind, " parameter ", s->labeler(i),
                      " must be a defined tensor");
  }
  // Deduplicate (a parameter may appear in several optimizers / groups), keeping first
  // occurrences in order: sorted addresses, no per-parameter allocation.
  std::vector<std::pair<c10::TensorImpl*, size_t>> order;
  order.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) order.emplace_back(params[i].unsafeGetTensorImpl(), i);
  std::sort(order.begin(), order.end());
  std::vector<bool> keep(params.size(), false);
  for (size_t j = 0; j < order.size(); ++j) {
    keep[order[j].second] = j == 0 || order[j].first != order[j - 1].first;
  }
  std::vector<size_t> position(params.size());  // a kept params[i]'s index in s->params
  s->params.reserve(params.size());
  s->caller_index.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (!keep[i]) continue;
    position[i] = s->params.size();
    s->params.push_back(std::move(params[i]));
    s->caller_index.push_back(i);
  }
  // The kept ones by address, for Book::live (order is sorted by address already).
  s->by_address.reserve(s->params.size());
  for (const auto& [impl, i] : order) {
    if (keep[i]) s->by_address.emplace_back(impl, position[i]);
  }
  const ScaleLossState& state = *s;
  check_parameter_dtypes(s->params, [&state](size_t j) { return state.label(j); });
  for (size_t i = 0; i < s->params.size(); ++i) {
    const auto t = s->params[i].scalar_type();
    TORCH_CHECK_VALUE(loss_scalable(t), "parameters must be ", kLossScalableDtypes,
                      " for loss scaling, got ", t, " for ",
                      param_label(s->params[i], s->label(i)));
  }
  LossScaler& scaler = *scaler_ptr;
  s->scaler = scaler_ptr;
  s->options = options;
  s->device_skip = std::move(device_skip);
  s->step_witness = std::move(step_witness);
  s->uncaught_at_entry = std::uncaught_exceptions();

  auto& b = book();
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    refuse_live_params(b, *s, owner_kind);
  }
  warn_if_casting_is_off_here();
  // No sync; moves the scaler state to the loss's device.
  LossScaler::ScaledLossValue scaled = scaler.scale_for_step(loss);
  s->scaled_loss = std::move(scaled.scaled);
  s->inv_scale = std::move(scaled.inv_scale);
  s->scaled_loss.grad_fn()->add_tensor_pre_hook(std::make_unique<ScaledLossReached>(
      s->live, s->backpropagated, s->accumulated, options.loss_id));

  s->fresh.assign(s->params.size(), false);
  s->versions_at_entry.reserve(s->params.size());
  for (const at::Tensor& p : s->params) {
    // Frozen parameters are left out (an EMA codebook held as a parameter may be written in a
    // forward run inside the guard; no step writes one), and inference tensors have no counter.
    const bool tracked = p.requires_grad() && !p.is_inference();
    s->versions_at_entry.push_back(tracked ? p._version() : ScaleLossState::kUntracked);
  }
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    refuse_live_params(b, *s, owner_kind);  // again: another thread's guard may have begun since
    // From here on nothing throws until the guard exists: a guard registered in Book::live is
    // always released by its end.
    b.live.push_back(&s->by_address);
    for (size_t i = 0; i < s->params.size(); ++i) {
      const at::Tensor& p = s->params[i];
      if (b.find(p)) continue;  // grads already scaled (a delayed micro-batch came before)
      if (p.grad().defined()) {
        s->unscaled.push_back(i);
      } else {
        s->fresh[i] = true;
      }
    }
  }
  ScaledLoss guard = ScaledLossAccess::make(std::move(s));
  rescale_accumulated(*ScaledLossAccess::state(guard));  // throws: the guard ends unwinding
  return guard;
}

bool take_step_overflows(const std::vector<at::Tensor>& params, const ParamLabeler& labels) {
  auto& b = detail::book();
  std::lock_guard<std::mutex> lock(b.mutex);
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(!detail::in_live_guard(b, params[i]),
                "amp::step: ", detail::param_label(params[i], labels(i)),
                " is inside an active scale_loss guard (its gradients are still scaled); step "
                "after the guard has finished (left its scope)");
    TORCH_CHECK(!b.find(params[i]), "amp::step: ", detail::param_label(params[i], labels(i)),
                " still holds scaled gradients (the last scale_loss guard used delay_unscale); "
                "finish with a guard without delay_unscale before stepping");
  }
  bool overflowed = false;
  for (const auto& p : params) overflowed |= b.take_overflowed(p);
  return overflowed;
}

}  // namespace core

}  // namespace amp
