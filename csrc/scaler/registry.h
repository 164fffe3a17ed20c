#pragma once
// Internal: the process-wide loss scalers and the parameter-list form of scale_loss (used by
// the optimizer overloads and by the Python binding).

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "optamp/loss_scaler.h"
#include "optamp/opt_level.h"
#include "optamp/scale_loss.h"

namespace amp::detail {

// Creates props.num_losses scalers (replacing any previous ones). Called by amp::initialize.
void configure_loss_scalers(const Properties& props);
// From now until the next configure/reset, scale_loss accepts only these optimizers (the ones
// amp::initialize was given; an empty list accepts none). Without it, any optimizer is accepted.
void restrict_loss_scaling_to(const std::vector<const void*>& optimizers);
// Throws a ValueError unless loss scaling is unrestricted or every identity is in the list
// (descriptions[i] names identities[i] in the message).
void check_optimizers_allowed(const std::vector<const void*>& identities,
                              const std::vector<std::string>& descriptions);
// The model parameters' dtypes as initialize left them. scale_loss refuses a parameter whose
// dtype changed since (the model was cast after initialize, e.g. model->to(torch::kDouble)),
// which would otherwise fail later in a forward with torch's mixed-dtype errors. Cleared by
// configure/reset.
void record_parameter_dtypes(const std::vector<at::Tensor>& parameters);
// Throws a ValueError naming labels[i] when params[i]'s dtype differs from the recorded one.
void check_parameter_dtypes(const std::vector<at::Tensor>& params,
                            const std::vector<std::string>& labels);
// Drops every scaler (scale_loss then fails with "call amp::initialize first").
void reset_loss_scalers();
// The scaler of `loss_id`, shared: a live guard keeps its scaler alive across a
// reconfiguration (same errors as amp::loss_scaler).
std::shared_ptr<LossScaler> loss_scaler_ptr(int loss_id);
// Number of configured scalers (0 before configure).
int num_loss_scalers();

// scale_loss over an explicit parameter list. `labels[i]` names params[i] in error messages
// (may be empty: then "param <i>"). Throws on bad input with nothing changed.
ScaledLoss scale_loss_params(const at::Tensor& loss, std::vector<at::Tensor> params,
                             std::vector<std::string> labels, ScaleLossOptions options,
                             const char* owner_kind);

// Ends a guard explicitly (the Python context manager's __exit__). `unwinding`: an exception is
// in flight (restore and don't throw). Idempotent.
// Returns whether this guard's step overflowed (its grads were reset).
bool finish_scaled_loss(ScaledLoss& guard, bool unwinding);

// Optional: a better name for a parameter in the floor error (e.g. "fc.weight"), installed by
// the frontend that knows the model. Returns nullopt when unknown.
using ParamNamer = std::function<std::optional<std::string>(const at::Tensor&)>;
void set_param_namer(ParamNamer namer);

}  // namespace amp::detail
