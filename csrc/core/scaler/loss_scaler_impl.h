#pragma once
// Internal: the state behind amp::LossScaler (optamp/loss_scaler.h), kept out of the installed
// header. Members keep the names they had as the class's own.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "optamp/loss_scaler.h"
#include "scaler/step_status.h"

namespace amp::detail {

struct LossScalerImpl {
  using DeviceFlags = std::vector<std::pair<c10::Device, at::Tensor>>;
  LossScalerImpl(const Properties& props, int loss_id);

  int loss_id_;
  bool dynamic_, checks_;
  double fixed_scale_;
  double init_scale_, growth_factor_, backoff_factor_;
  int64_t growth_interval_, hysteresis_;
  double min_loss_scale_, max_loss_scale_, lowest_scale_;  // min: 0 when no floor
  bool has_min_;
  int verbosity_;

  // Guards the tensors, the two-call API's flags and the reducer; never held while calling the
  // reducer or another scaler.
  std::mutex mutex_;
  at::Tensor scale_, growth_tracker_, hysteresis_tracker_;
  // The two-call API: one found_inf flag per device touched since the last update().
  DeviceFlags found_inf_;
  bool pending_ = false;
  LossScaler::FoundInfReducer found_inf_reducer_;

  // Step results on their way to the host, and the host counters they update (the const
  // accessors settle the queue first). Guarded by mutex_.
  std::unique_ptr<detail::StepStatusQueue> statuses_;
  double loss_scale_;
  bool last_step_skipped_ = false;
  int64_t skipped_steps_ = 0;
  int64_t floor_skips_ = 0;
  bool floor_limit_ = false;
  int64_t host_waits_ = 0;  // set by settling, taken by the step that reports it
};

}  // namespace amp::detail
