#pragma once
// Internal: what scale_loss checks against the process-wide loss scalers (whose public half,
// configure/reset/loss_scaler_ptr, is in optamp/core.h).

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

#include "optamp/core.h"

namespace amp::detail {

// From now until the next configure/reset, scale_loss accepts only these optimizers (the ones
// amp::initialize was given; an empty list accepts none). Without it, any optimizer is accepted.
void restrict_loss_scaling_to(const std::vector<const void*>& optimizers);
// The model parameters' dtypes as initialize left them. scale_loss refuses a parameter whose
// dtype changed since (the model was cast after initialize, e.g. model->to(torch::kDouble)),
// which would otherwise fail later in a forward with torch's mixed-dtype errors. Cleared by
// configure/reset.
void record_parameter_dtypes(const std::vector<at::Tensor>& parameters);
// Throws a ValueError naming labels(i) when params[i]'s dtype differs from the recorded one.
void check_parameter_dtypes(const std::vector<at::Tensor>& params,
                            const std::function<std::string(size_t)>& labels);

}  // namespace amp::detail
