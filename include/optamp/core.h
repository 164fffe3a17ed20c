#pragma once
// The tensor-level core behind both fronts: amp::initialize / amp::scale_loss for
// torch::nn::Module and torch::optim (optamp/initialize.h, optamp/scale_loss.h), and the Python
// package for torch.nn.Module and torch.optim. A front collects tensors from its framework's
// objects and calls these; validation, O2/O5 working copies, O3 casting, the loss scalers and
// the fused unscale/check all live behind them, once. Other bindings (another language, another
// module system) use this header too (docs/design.md, "Layout").

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "optamp/export.h"
#include "optamp/loss_scaler.h"
#include "optamp/opt_level.h"
#include "optamp/scale_loss.h"

namespace amp::core {

// The model(s) as tensors, split the way the level treats them.
struct OPTAMP_API ModelTensors {
  std::vector<at::Tensor> reduced;      // seen as working copies (O2/O5) or cast (O3)
  std::vector<at::Tensor> keep_fp32;    // batch-norm / keep_in_fp32 modules' tensors
  std::vector<at::Tensor> parameters;   // every parameter (optimizer checks; the reduced tensors
                                        // not among them are buffers, own data to view ops)
  std::vector<std::string> names;       // names[i] names parameters[i] ("fc1.weight"), optional
  std::vector<const void*> identities;  // the model objects, for model_boundary(model); optional
};

// One optimizer as tensors.
struct OPTAMP_API OptimizerTensors {
  const void* identity;                  // the optimizer object (twice-initialized check)
  std::string description;               // "optimizer 0 (Adam)"
  std::vector<at::Tensor> parameters;    // in param-group order
  std::vector<at::Tensor> state;         // optimizer state tensors (device check)
  std::vector<at::Tensor> state_owners;  // the parameter each state tensor belongs to
  double smallest_eps = 0.0;             // for the O3 fp16 epsilon warning; 0 = none
  bool steps_through_closure = false;    // LBFGS: re-evaluates the loss in step(); refused
};

// amp::initialize on tensors: validates everything (throws, changing nothing), then applies.
// Returns the resolved properties.
OPTAMP_API Properties initialize(const ModelTensors& model,
                                 const std::vector<OptimizerTensors>& optimizers, OptLevel level,
                                 const Options& options);
// amp::reset(): casting off, level rules, caches, loss scalers; initialize may run again.
OPTAMP_API void reset();
// Whether initialize ran since the last reset (amp::is_initialized, optamp.is_initialized).
OPTAMP_API bool is_initialized();
// The model tensors O2/O5 ops read as working copies (empty at other levels and after reset),
// for a front end that restates substitution's rules (Python's torch.compile mode).
OPTAMP_API std::vector<at::Tensor> working_copy_sources();
// The dtype ops see those tensors in on this thread now (the working copies' fp16/bf16 where the
// level's rules apply: not under no_grad, not on another thread, not under disable_casts);
// Undefined where ops see the fp32 masters, at other levels and when not initialized. Whatever
// the boundary does with the inputs (cast_model_inputs=False leaves them as given).
OPTAMP_API c10::ScalarType working_copy_dtype();
// A read-only floating argument (not fp64, not a Python number) of a call a front traces.
struct OPTAMP_API TracedTensor {
  c10::ScalarType dtype;  // its own
  bool model_tensor;      // one of working_copy_sources() (or a view of such a buffer)
  bool dimensioned;       // dim() > 0
};
// Whether ops see working copies now (working_copy_dtype()) and eager casting hands the model
// tensors among a call's arguments their fp32 masters instead: where it casts the call to fp32
// (an fp32 rule, a promotion or a widening of mixed widths to fp32) or runs the op's own
// autocast kernel. `op`: "ns::op" (a torch function's name; the overload a call with tensors
// most likely takes) or "ns::op.overload"; `device`: the first tensor's; `self`: self's dtype
// where self is a floating tensor; `dtype_given`: the call passes a dtype. For a front that
// restates substitution's rules (Python's torch.compile mode); false for an op in no table.
OPTAMP_API bool call_reads_masters(const std::string& op, c10::DeviceType device,
                                   const std::vector<TracedTensor>& tensors,
                                   std::optional<c10::ScalarType> self, bool dtype_given);
[[deprecated("renamed amp::core::is_initialized, as amp::is_initialized")]] inline bool
initialized() {
  return is_initialized();
}

// The casts at the boundary of `model` (one of ModelTensors::identities; nullptr: any model
// initialize was given) for a forward on this thread now: Properties::model_boundary(), except
// that at O2/O5 the inputs are cast to the working copies' dtype only where ops see working
// copies (the level's rules apply on this thread: not under no_grad, not on another thread,
// not under disable_casts) and to fp32 elsewhere, where the model is its fp32 masters. Nothing
// for a model initialize was not given, or when not initialized.
OPTAMP_API ModelBoundary model_boundary(const void* model);

// A floating output of an initialized model's forward cast to `dtype` (a boundary's outputs
// dtype; Undefined: returned as it is), as the fronts' boundaries cast them (autograd recorded).
// A reduced output widened to fp32 where the level runs losses in fp32 from reduced inputs
// (O2/O5), in a forward that records autograd, is also offered as the fp32 result's companion
// (its values exactly): a loss of the fp32 output then reads the reduced one instead, as at O1
// (docs/design.md, "The model boundary's outputs keep their reduced values").
OPTAMP_API at::Tensor cast_model_output(const at::Tensor& output, c10::ScalarType dtype);

// The loss scalers (one per loss_id) initialize configures. configure_loss_scalers creates
// props.num_losses of them (replacing any previous ones); reset_loss_scalers drops them.
OPTAMP_API void configure_loss_scalers(const Properties& props);
OPTAMP_API void reset_loss_scalers();
OPTAMP_API int num_loss_scalers();
// The scaler of `loss_id`, shared: a live guard keeps its scaler alive across a
// reconfiguration (same errors as amp::loss_scaler).
OPTAMP_API std::shared_ptr<LossScaler> loss_scaler_ptr(int loss_id);

// Throws a ValueError unless every optimizer identity was passed to initialize (descriptions[i]
// names identities[i] in the message).
OPTAMP_API void check_optimizers_allowed(const std::vector<const void*>& identities,
                                         const std::vector<std::string>& descriptions);

// Where a guard sends its overflow flag when the optimizers skip on the device (torch's fused
// Adam/AdamW/SGD, amp::FusedAdam): found_inf is a 0-dim float32 tensor, 0 or 1, on the
// scale's device. Called once per non-delayed finish of a scaler that checks for overflow.
using DeviceSkip = std::function<void(const at::Tensor& found_inf)>;

// Evidence, other than the parameters' version counters, that an optimizer stepped since the
// guard began (LibTorch's SGD writes its parameters through p.data(), which leaves them alone):
// returns what changed ("optimizer 0 (SGD) made or updated momentum buffers"), or nothing.
// Called once, at a guard's normal end.
using StepWitness = std::function<std::optional<std::string>()>;

// Names the i-th parameter of a scale_loss call in error messages; called only when a message is
// built (a step formats no strings).
using ParamLabeler = std::function<std::string(size_t index)>;
// The fronts' labels for the parameters of optimizers laid out as group_sizes[k][g] (the number
// of parameters of param group g of optimizer k): "optimizer k param_groups[g].params[i]".
OPTAMP_API ParamLabeler optimizer_param_labels(std::vector<std::vector<size_t>> group_sizes);

// amp::scale_loss over an explicit parameter list. labels names params[i] in error messages
// (empty: "param <i>"); owner_kind says what the parameters came from ("optimizer").
// With `device_skip`, finishing waits for nothing and resets no gradient: the flag goes to
// device_skip and the optimizer skips on the device. Without it, finishing waits for the flag
// (one device->host sync) and resets the gradients after an overflow. A trainable parameter
// changed in place inside the guard, or `step_witness`'s evidence, makes its end throw instead
// (a step with scaled gradients): gradients made inside it dropped, the scale unchanged.
// Throws on bad input with nothing changed.
OPTAMP_API ScaledLoss scale_loss(const at::Tensor& loss, std::vector<at::Tensor> params,
                                 ParamLabeler labels, ScaleLossOptions options,
                                 const char* owner_kind, DeviceSkip device_skip = {},
                                 StepWitness step_witness = {});
// The same with the labels spelled out (labels[i] names params[i]; may be empty).
OPTAMP_API ScaledLoss scale_loss(const at::Tensor& loss, std::vector<at::Tensor> params,
                                 std::vector<std::string> labels, ScaleLossOptions options,
                                 const char* owner_kind, DeviceSkip device_skip = {});
// Ends a guard explicitly (a Python context manager's __exit__). `unwinding`: an exception is in
// flight (restore, don't throw). Idempotent. Returns whether this guard's step overflowed (its
// grads were reset); always false for a guard with a DeviceSkip (the host does not know yet).
OPTAMP_API bool finish(ScaledLoss& guard, bool unwinding);

// For amp::step: refuses (c10::Error naming labels(i)) a parameter that still holds scaled
// gradients, and returns whether any of `params` overflowed in a guard since its last step
// (forgetting it).
OPTAMP_API bool take_step_overflows(const std::vector<at::Tensor>& params,
                                    const ParamLabeler& labels);

}  // namespace amp::core
