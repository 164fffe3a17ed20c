// The session's loss scalers (one per loss_id): making them, reading them, and what scale_loss
// checks against the session (the optimizers initialize was given, the parameters' dtypes).
#include "scaler/loss_scaler_set.h"

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "scaler/scale_loss.h"
#include "session.h"

namespace amp {

LossScaler& loss_scaler(int loss_id) { return *core::loss_scaler_ptr(loss_id); }

namespace detail {

std::vector<std::shared_ptr<LossScaler>> make_loss_scalers(const Properties& props) {
  TORCH_CHECK_VALUE(props.num_losses >= 1, "num_losses must be >= 1, got ", props.num_losses);
  std::vector<std::shared_ptr<LossScaler>> scalers;
  scalers.reserve(static_cast<size_t>(props.num_losses));
  for (int i = 0; i < props.num_losses; ++i) {
    scalers.push_back(std::make_shared<LossScaler>(props, i));
  }
  return scalers;
}

void check_parameter_dtypes(const std::vector<at::Tensor>& params,
                            const std::function<std::string(size_t)>& labels) {
  const auto session = current_session();
  for (size_t i = 0; i < params.size(); ++i) {
    const ParameterRecord* record = session->find_parameter(params[i]);
    if (record == nullptr) continue;
    TORCH_CHECK_VALUE(params[i].scalar_type() == record->dtype, param_label(params[i], labels(i)),
                      " must still be ", dtype_name(record->dtype),
                      " as when amp::initialize ran, got ", dtype_name(params[i].scalar_type()),
                      record->in_models ? kCastAfterInitialize : kOutsideModelsCastAfterInitialize);
  }
}

}  // namespace detail

namespace core {

std::shared_ptr<LossScaler> loss_scaler_ptr(int loss_id) {
  const auto session = detail::current_session();
  TORCH_CHECK(!session->loss_scalers.empty(),
              "amp: loss scaling is not configured; call amp::initialize first (no loss scaler "
              "exists yet)");
  const int n = static_cast<int>(session->loss_scalers.size());
  TORCH_CHECK_VALUE(loss_id >= 0 && loss_id < n, "loss_id must be in [0, ", n, ") (num_losses=", n,
                    "), got ", loss_id);
  return session->loss_scalers[loss_id];
}

namespace {

// Scalers on their own (without initialize): any optimizer, no parameter records.
void use_loss_scalers(std::vector<std::shared_ptr<LossScaler>> scalers) {
  detail::edit_session([&](detail::Session& s) {
    s.loss_scalers = std::move(scalers);
    s.optimizers.reset();
    s.parameters.clear();
  });
}

}  // namespace

void configure_loss_scalers(const Properties& props) {
  use_loss_scalers(detail::make_loss_scalers(props));
}

void check_optimizers_allowed(const std::vector<const void*>& identities,
                              const std::vector<std::string>& descriptions) {
  const auto session = detail::current_session();
  if (!session->optimizers) return;
  for (size_t i = 0; i < identities.size(); ++i) {
    TORCH_CHECK_VALUE(session->optimizers->count(identities[i]),
                      i < descriptions.size() ? descriptions[i] : std::string("optimizer"),
                      " must be an optimizer passed to amp::initialize, got one that was not "
                      "(its parameters would be unscaled with the loss scaler of another "
                      "optimizer's training); pass every optimizer to amp::initialize (a list), "
                      "or call amp::reset() and initialize again with this one");
  }
}

void reset_loss_scalers() { use_loss_scalers({}); }

int num_loss_scalers() { return static_cast<int>(detail::current_session()->loss_scalers.size()); }

}  // namespace core

}  // namespace amp
