#include "optamp/core.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <iostream>
#include <unordered_map>
#include <unordered_set>

#include "cache/autograd_cast.h"
#include "cache/companion_casts.h"
#include "dispatch/cast_kernel.h"
#include "dispatch/registration.h"
#include "dispatch/substitution.h"
#include "dispatch/thread_frames.h"
#include "optamp/cast_cache.h"
#include "optamp/policy.h"
#include "scaler/loss_scaler_set.h"
#include "session.h"

namespace amp::detail {

using core::ModelTensors;
using core::OptimizerTensors;

namespace {

std::string shape_of(const at::Tensor& t) {
  std::ostringstream out;
  out << t.scalar_type() << t.sizes();
  return out.str();
}

void check_model(const ModelTensors& model) {
  // A model on the meta device has no data: O2/O5 would make working copies of nothing and O3
  // would cast nothing, and training fails later far from the cause.
  for (const auto i : c10::irange(model.parameters.size())) {
    TORCH_CHECK_VALUE(!model.parameters[i].is_meta(),
                      "models must be materialized before "
                      "amp::initialize, got parameter ",
                      i < model.names.size() ? model.names[i] + " " : std::string(), "(",
                      shape_of(model.parameters[i]),
                      ") on the meta device; materialize the model first (model.to_empty(device) "
                      "and initialize its parameters, or load a checkpoint), then initialize");
  }
  for (const auto* list : {&model.reduced, &model.keep_fp32}) {
    for (const auto& t : *list) {
      TORCH_CHECK_VALUE(!t.is_meta(),
                        "models must be materialized before amp::initialize, got a "
                        "buffer (",
                        shape_of(t),
                        ") on the meta device; materialize the model "
                        "first (model.to_empty(device) and initialize it), then initialize");
    }
  }
  bool any_floating = false;
  for (const auto& t : model.parameters) any_floating = any_floating || t.is_floating_point();
  TORCH_CHECK_VALUE(any_floating, "models must have at least one floating-point parameter, got ",
                    model.parameters.size(),
                    " parameters and none floating: nothing to "
                    "run in mixed precision");
}

// Apex's check: the levels that keep fp32 weights (O1/O4, and O2/O5's masters) need fp32
// trainable parameters, or the "fp32 master weights" are fp16 and nothing says so. A model cast
// in place (O3), or whose dtypes the caller keeps (cast_model_type=False, what Apex's own tests
// did with allow_incoming_model_not_fp32), takes any dtype; frozen parameters (requires_grad
// false, e.g. an fp16 teacher) are not stepped and are not checked. float64 parameters are taken
// (Apex refused them, torch.amp takes them): a precision someone chose for a physical constant or
// a scale, which ops read as they are (never cast, no working copy) and loss scaling unscales in
// float64.
void check_model_dtypes(const ModelTensors& model, const Properties& p, const Options& o) {
  const bool kept_as_is = o.cast_model_type && *o.cast_model_type == c10::ScalarType::Undefined;
  if (!p.casts() || p.model_cast() == ModelCast::kInPlace || kept_as_is) return;
  for (const auto i : c10::irange(model.parameters.size())) {
    const at::Tensor& t = model.parameters[i];
    const bool wide = t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble;
    if (!t.is_floating_point() || !t.requires_grad() || wide) continue;
    TORCH_CHECK_VALUE(
        false, "models' trainable parameters must be torch.float32 at opt_level ",
        to_string(p.opt_level), ", got parameter ",
        i < model.names.size() ? model.names[i] + " " : std::string(), "(", shape_of(t), ") of ",
        dtype_name(t.scalar_type()),
        ": do not call .half()/.bfloat16() on the model before initialize (as in "
        "Apex); the level casts what it needs and keeps fp32 weights ",
        p.model_cast() == ModelCast::kWorkingCopies ? "as master weights" : "for the optimizer",
        ". To train reduced-precision weights directly use opt_level 'O3'; to "
        "keep the model's dtypes as they are, pass cast_model_type=False (C++: "
        "c10::ScalarType::Undefined; at O2/O3/O5 nothing is cast then); frozen "
        "parameters need requires_grad=False.");
  }
}

// Where the level casts models (O2/O3/O5), an optimizer parameter outside every model passed is
// refused: usually a model left out, which would then train uncast beside the cast ones. At
// O1/O4 models are not cast and nothing depends on which were passed, so a parameter of no
// model passed (learned loss weights, a temperature: Apex and torch.amp take them) is taken.
void check_optimizers(const ModelTensors& model, const std::vector<OptimizerTensors>& opts,
                      bool models_cast) {
  // Model parameters by identity, with the model's name for them ("fc1.weight") when known.
  std::unordered_map<const c10::TensorImpl*, std::string> in_model;
  for (const auto i : c10::irange(model.parameters.size())) {
    in_model.emplace(model.parameters[i].unsafeGetTensorImpl(),
                     i < model.names.size() ? model.names[i] + " " : std::string());
  }
  std::unordered_map<const c10::TensorImpl*, std::string> owner;
  std::unordered_set<const void*> seen;
  for (const auto& opt : opts) {
    TORCH_CHECK_VALUE(!opt.steps_through_closure, opt.description,
                      " is LBFGS, which is not supported: its step() re-evaluates the loss "
                      "through a closure, outside scale_loss, so gradients would be unscaled "
                      "twice or not at all. Use SGD/Adam/AdamW/RMSprop/Adagrad.");
    TORCH_CHECK_VALUE(!seen.count(opt.identity), opt.description,
                      " was already passed to amp::initialize; call "
                      "amp::reset() before initializing it again");
    seen.insert(opt.identity);
    TORCH_CHECK_VALUE(!opt.parameters.empty(), opt.description,
                      " must have parameters, got "
                      "none");
    for (const auto i : c10::irange(opt.parameters.size())) {
      const auto* impl = opt.parameters[i].unsafeGetTensorImpl();
      TORCH_CHECK_VALUE(!models_cast || in_model.count(impl), opt.description, " parameter ", i,
                        " (", shape_of(opt.parameters[i]),
                        ") must be a parameter of the model(s) passed to amp::initialize at "
                        "this level, which casts them, but it is not: pass every model whose "
                        "parameters the optimizer updates (a parameter of no module, such as "
                        "learned loss weights: register it on a module you pass; at O1/O4 "
                        "such parameters are taken as they are)");
      auto [it, fresh] = owner.emplace(impl, opt.description);
      const auto named = in_model.find(impl);
      TORCH_CHECK_VALUE(fresh || it->second == opt.description, "parameter ",
                        named == in_model.end() ? std::string() : named->second, "(",
                        shape_of(opt.parameters[i]), ")",
                        " must belong to one optimizer, but it is "
                        "in both ",
                        it->second, " and ", opt.description);
    }
    for (const auto i : c10::irange(opt.state.size())) {
      const auto& param = opt.state_owners[i];
      const auto name = in_model.find(param.unsafeGetTensorImpl());
      TORCH_CHECK_VALUE(opt.state[i].device() == param.device(), opt.description,
                        " state of parameter ",
                        name == in_model.end() ? std::string() : name->second, "(", shape_of(param),
                        ") must be on the device of its parameter (", param.device(),
                        "), got a state tensor on ", opt.state[i].device(),
                        ": move the model "
                        "before creating/loading the optimizer state");
    }
  }
}

void warn_fp16_epsilon(const Properties& p, const std::vector<OptimizerTensors>& opts) {
  if (p.model_cast() != ModelCast::kInPlace || p.cast_model_type != c10::ScalarType::Half) return;
  constexpr double kSmallestNormalHalf = 6.103515625e-05;  // 2^-14
  for (const auto& opt : opts) {
    if (opt.smallest_eps > 0 && opt.smallest_eps < kSmallestNormalHalf) {
      TORCH_WARN(to_string(p.opt_level), " (fp16 parameters stepped directly): ", opt.description,
                 " has eps=", opt.smallest_eps,
                 ", below fp16's smallest normal number (6.1e-05); its denominator can "
                 "underflow and steps blow up. Use eps >= 1e-4, or fp32 master weights (O2).");
    }
  }
}

// set_data keeps the same Variable, so everything holding it (module, optimizer) sees the change.
void cast_in_place(at::Tensor t, c10::ScalarType dtype) {
  if (t.is_floating_point() && t.scalar_type() != dtype) t.set_data(t.detach().to(dtype));
}

// O3: the model's tensors become fp16/bf16 in place, and with them what the optimizer already
// holds for a cast parameter (Adagrad's accumulators from its constructor, moments of steps taken
// before initialize); fp32 state next to an fp16 parameter would fail the next step. State of
// another shape (step counters) stays as it is.
void cast_model(const ModelTensors& model, const std::vector<OptimizerTensors>& opts,
                c10::ScalarType dtype) {
  std::unordered_set<const c10::TensorImpl*> cast;
  for (const auto& t : model.reduced) {
    cast_in_place(t, dtype);
    cast.insert(t.unsafeGetTensorImpl());
  }
  for (const auto& opt : opts) {
    for (const auto i : c10::irange(opt.state.size())) {
      const auto& param = opt.state_owners[i];
      if (cast.count(param.unsafeGetTensorImpl()) && opt.state[i].sizes() == param.sizes()) {
        cast_in_place(opt.state[i], dtype);
      }
    }
  }
}

// What scale_loss checks parameters against: their dtypes as training runs them (after O3's
// cast), and the model's names for them, which error messages use. The optimizers' parameters of
// no model (taken at O1/O4) are recorded too: a loss that casts its own weights to its input's
// dtype would otherwise have them stepped in fp16/bf16 without a word.
ParameterRecords parameter_records(const ModelTensors& model,
                                   const std::vector<OptimizerTensors>& opts) {
  ParameterRecords records;
  auto record = [&records](const at::Tensor& p, std::string name, bool in_models) {
    records.emplace(p.unsafeGetTensorImpl(),
                    ParameterRecord{std::make_shared<TensorRef>(p), p.scalar_type(),
                                    std::move(name), in_models});
  };
  const bool named = model.names.size() == model.parameters.size();
  for (const auto i : c10::irange(model.parameters.size())) {
    record(model.parameters[i], named ? model.names[i] : std::string(), true);
  }
  for (const auto& opt : opts) {
    for (const auto& p : opt.parameters) record(p, std::string(), false);  // kept if a model's
  }
  return records;
}

// The session initialize publishes. Called after O3's cast (the records hold the dtypes training
// runs in); the scalers are made before anything changes, since making them validates.
std::shared_ptr<Session> build_session(const ModelTensors& model,
                                       const std::vector<OptimizerTensors>& opts,
                                       const Properties& p,
                                       std::vector<std::shared_ptr<LossScaler>> scalers) {
  auto session = std::make_shared<Session>();
  session->initialized = true;
  session->rules = level_rules_for(p);
  if (p.enabled && p.model_cast() == ModelCast::kWorkingCopies) {
    session->working_copy_sources = make_working_copy_sources(model.reduced, model.parameters);
  }
  session->parameters = parameter_records(model, opts);
  session->loss_scalers = std::move(scalers);
  session->optimizers.emplace();
  for (const auto& opt : opts) session->optimizers->insert(opt.identity);
  session->models = model.identities;
  session->boundary = p.model_boundary();
  return session;
}

}  // namespace

}  // namespace amp::detail

namespace amp::core {

using namespace amp::detail;  // this file's internals

Properties initialize(const ModelTensors& model, const std::vector<OptimizerTensors>& opts,
                      OptLevel level, const Options& options) {
  auto lock = lock_session_changes();
  const auto current = current_session();
  // ---- validate: nothing changes before every check passed -----------------------------
  Properties p = resolve(level, options);
  TORCH_CHECK_VALUE(!current->initialized || opts.empty() || !current->optimizers ||
                        !current->optimizers->count(opts.front().identity),
                    opts.empty() ? "" : opts.front().description,
                    " was already passed to amp::initialize; call amp::reset() first");
  TORCH_CHECK_VALUE(!current->initialized,
                    "amp::initialize was already called; call amp::reset() "
                    "before initializing a new model/optimizer");
  check_model(model);
  check_model_dtypes(model, p, options);
  check_optimizers(model, opts, p.model_cast() != ModelCast::kNone);
  Properties scaler_properties = p;
  if (!p.enabled) scaler_properties.loss_scale = LossScale::fixed(1.0);
  auto scalers = make_loss_scalers(scaler_properties);
  // Registers optamp's kernels (key conflicts surface here, still before any change) and gives
  // the ops of libraries loaded since the last look their own autocast kernels.
  register_own_autocast_ops();
  warn_fp16_epsilon(p, opts);

  // ---- apply ------------------------------------------------------------------------------
  // Regions and disable_casts left open on any thread (or stuck by mismatched exits) end here.
  reset_all_thread_states();
  if (p.enabled && p.model_cast() == ModelCast::kInPlace)
    cast_model(model, opts, p.cast_model_type);
  auto next = build_session(model, opts, p, std::move(scalers));
  const auto replaced = publish_session(next);
  move_substitution_key(replaced->working_copy_sources, next->working_copy_sources);
  if (p.enabled) {
    activate_substitution_thread(p.model_cast() == ModelCast::kWorkingCopies);
    activate_thread(p.casts());
  }
  // Apex printed its ~40-line report on every start; here it takes verbosity 2.
  if (p.verbosity >= 2) {
    std::cout << p.describe() << std::flush;
  } else if (p.verbosity == 1) {
    std::cout << p.summary() << std::flush;
  }
  return p;
}

void reset() {
  auto lock = lock_session_changes();
  const auto replaced = publish_session(std::make_shared<Session>());
  reset_all_thread_states();  // every thread's regions, key and substitution: back to initial
  activate_thread(false);
  activate_substitution_thread(false);
  move_substitution_key(replaced->working_copy_sources, {});
  clear_cache();
}

bool is_initialized() { return current_session()->initialized; }

std::vector<at::Tensor> working_copy_sources() {
  std::vector<at::Tensor> tensors;
  for (const auto& entry : current_session()->working_copy_sources) {
    if (auto impl = entry.second.ref->lock()) tensors.emplace_back(std::move(impl));
  }
  return tensors;
}

c10::ScalarType working_copy_dtype() {
  const auto session = current_session();
  if (!session->initialized || session->working_copy_sources.empty()) {
    return c10::ScalarType::Undefined;
  }
  return working_copy_dtype_now(*session);
}

bool call_reads_masters(const std::string& op, c10::DeviceType device,
                        const std::vector<TracedTensor>& tensors,
                        std::optional<c10::ScalarType> self, bool dtype_given) {
  const c10::ScalarType working = working_copy_dtype();
  if (working == c10::ScalarType::Undefined) return false;
  const std::optional<detail::KernelOfCall> found = detail::kernel_of_call(op);
  if (!found) return false;  // in no table: substitution hands the op working copies
  std::vector<detail::DescribedTensor> described;
  described.reserve(tensors.size());
  for (const TracedTensor& t : tensors) {
    described.push_back({t.model_tensor ? working : t.dtype, t.dimensioned});
  }
  try {
    return detail::described_call_reads_masters(found->op, *found->kernel, device, described, self,
                                                dtype_given);
  } catch (const c10::NotImplementedError&) {
    return false;  // a banned op: the call itself raises, as in eager
  }
}

ModelBoundary model_boundary(const void* model) {
  const auto session = current_session();
  const auto& models = session->models;
  if (!session->initialized ||
      (model != nullptr && std::find(models.begin(), models.end(), model) == models.end())) {
    return {};
  }
  ModelBoundary boundary = session->boundary;
  if (!session->working_copy_sources.empty() && boundary.inputs != c10::ScalarType::Undefined) {
    // O2/O5: the model is its working copies only where ops are substituted; elsewhere its fp32
    // masters, which fp16 inputs would not match (docs/casting.md, "The no_grad gate").
    const c10::ScalarType working = working_copy_dtype_now(*session);
    boundary.inputs = working != c10::ScalarType::Undefined ? working : c10::ScalarType::Float;
  }
  return boundary;
}

at::Tensor cast_model_output(const at::Tensor& output, c10::ScalarType dtype) {
  if (dtype == c10::ScalarType::Undefined || !output.defined() || !output.is_floating_point() ||
      output.scalar_type() == dtype) {
    return output;
  }
  at::Tensor cast = output.to(dtype);
  // Only where a loss would take it (the fp32 loss rule for this dtype) and only in a training
  // forward: until a loss takes it, the companion holds the reduced output (an activation the
  // size of a language model's logits), and a step's end (scale_loss) drops what no loss took.
  // Nor for functorch's wrappers (torch.func.grad/vmap through the model), which have no storage
  // to hold the companion by: they keep the plain cast.
  if (dtype != c10::ScalarType::Float || !output.requires_grad() || !c10::GradMode::is_enabled() ||
      !detail::is_plain_for_autograd(output)) {
    return cast;
  }
  const CastRules rules = cast_rules_now(output.device().type());
  if (rules.low == output.scalar_type() && policy_applies(CastPolicy::kFp32Loss, rules.rules)) {
    detail::offer_companion(cast, output, /*exact=*/true);
  }
  return cast;
}

}  // namespace amp::core
