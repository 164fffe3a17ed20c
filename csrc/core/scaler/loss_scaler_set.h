#pragma once
// Internal: the session's loss scalers (whose public half, configure/reset/loss_scaler_ptr, is in
// optamp/core.h) and what scale_loss checks against the session.

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

#include "optamp/core.h"

namespace amp::detail {

// The scalers of a session (props.num_losses of them; throws a ValueError when it is < 1).
std::vector<std::shared_ptr<LossScaler>> make_loss_scalers(const Properties& props);
// scale_loss refuses a parameter whose dtype changed since initialize recorded it in the session
// (the model was cast after initialize, e.g. model->to(torch::kDouble)), which would otherwise
// fail later in a forward with torch's mixed-dtype errors.
// Throws a ValueError naming labels(i) when params[i]'s dtype differs from the recorded one.
void check_parameter_dtypes(const std::vector<at::Tensor>& params,
                            const std::function<std::string(size_t)>& labels);

}  // namespace amp::detail
