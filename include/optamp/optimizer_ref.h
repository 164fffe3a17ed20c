#pragma once
// amp::OptimizerRef: an optimizer as the list forms of initialize, scale_loss and step take it,
// so `{g_opt, d_opt}` (references) and `{&g_opt, &d_opt}` (pointers) both work.

#include "optamp/export.h"

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace amp {

class OPTAMP_API OptimizerRef {
 public:
  OptimizerRef(torch::optim::Optimizer& o) : ptr_(&o) {}  // NOLINT(google-explicit-constructor)
  OptimizerRef(torch::optim::Optimizer* o) : ptr_(o) {}   // NOLINT(google-explicit-constructor)
  torch::optim::Optimizer* ptr() const { return ptr_; }

 private:
  torch::optim::Optimizer* ptr_;
};

}  // namespace amp
