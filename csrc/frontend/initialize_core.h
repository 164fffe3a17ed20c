#pragma once
// The framework-neutral core of amp::initialize: it works on tensors, so the LibTorch front
// (torch::nn::Module / torch::optim) and the Python binding (torch.nn.Module / torch.optim)
// share one implementation of validation, O2 registration, O3 casting and scaler set-up.
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "optamp/opt_level.h"

namespace amp::detail {

struct ModelTensors {
  std::vector<at::Tensor> reduced;     // seen as working copies (O2/O5) or cast (O3)
  std::vector<at::Tensor> keep_fp32;   // batch-norm / keep_in_fp32 modules' tensors
  std::vector<at::Tensor> parameters;  // every parameter, for the optimizer checks
  std::vector<std::string> names;      // names[i] names parameters[i] ("fc1.weight"), optional
};

struct OptimizerTensors {
  const void* identity;                  // the optimizer object (twice-initialized check)
  std::string description;               // "optimizer 0 (Adam)"
  std::vector<at::Tensor> parameters;    // in param-group order
  std::vector<at::Tensor> state;         // optimizer state tensors (device check)
  std::vector<at::Tensor> state_owners;  // the parameter each state tensor belongs to
  double smallest_eps = 0.0;             // for the O3 fp16 epsilon warning; 0 = none
  bool steps_through_closure = false;    // LBFGS: re-evaluates the loss in step(); refused
};

// Validates everything (throws, changing nothing), then applies. Returns resolved properties.
Properties initialize_core(const ModelTensors& model, const std::vector<OptimizerTensors>& opts,
                           OptLevel level, const Options& options);

void reset_core();
bool initialized_core();

}  // namespace amp::detail
