#pragma once
// amp::scale_loss: the RAII guard around backward (Apex's `with amp.scale_loss(...)`).
//
//   {
//     auto scaled = amp::scale_loss(loss, optimizer);   // {loss_id, delay_unscale}
//     scaled.backward();                                  // or scaled.loss().backward()
//   }                                                     // unscale + check + scale update
//   optimizer.step();                                     // a no-op after an overflow
//
// On scope exit (unless delay_unscale) the grads of every parameter of the optimizer(s) are
// unscaled in one fused pass, checked for inf/NaN, and the scale is updated. On overflow those
// grads are reset to undefined, so the plain optimizer.step() skips every parameter. The braces
// matter: without them the guard lives to the end of the enclosing scope, past the step, which
// then steps with gradients still multiplied by the scale and unchecked. amp::step refuses that
// before it runs; a plain step() (LibTorch's optimizers have no hooks) is seen at the guard's end,
// whose destructor then throws (a trainable parameter changed in place inside the guard, or SGD's
// momentum buffers), except torch::optim::SGD's without momentum, which writes through p.data()
// and keeps no state: it leaves no trace.
//
// Several guards before one step (several losses, or accumulation without delay_unscale): a
// plain optimizer.step() only sees the overflow of the LAST guard, because an earlier guard's
// reset grads are refilled by the later backward. Step with amp::step(optimizer) there: it
// skips when any guard since the previous amp::step overflowed (Apex's rule; LibTorch's C++
// optimizers have no step hooks that could make the plain step() do this). Python needs nothing:
// optamp.scale_loss installs a one-shot step pre-hook after an overflow.

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <memory>
#include <optional>
#include <vector>

#include "optamp/export.h"
#include "optamp/optimizer_ref.h"

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace amp {

struct OPTAMP_API ScaleLossOptions {
  int loss_id = 0;
  // Leave the grads scaled (a non-final gradient-accumulation micro-batch).
  bool delay_unscale = false;
};

namespace detail {
struct ScaleLossState;
struct ScaledLossAccess;
}  // namespace detail

class OPTAMP_API ScaledLoss {
 public:
  ScaledLoss(ScaledLoss&& other) noexcept;
  ScaledLoss& operator=(ScaledLoss&&) = delete;
  ScaledLoss(const ScaledLoss&) = delete;
  ScaledLoss& operator=(const ScaledLoss&) = delete;
  // Finishes the step (see above). Errors surface as exceptions, except while another exception
  // is unwinding the stack: then nothing is checked or thrown, gradients that appeared inside the
  // guard are dropped, earlier micro-batches' gradients are divided by the scale again (with what
  // the interrupted backward added to them), and delay_unscale's scaled ones stay scaled.
  ~ScaledLoss() noexcept(false);

  // loss.float() * scale.
  const at::Tensor& loss() const;
  // loss().backward(gradient, retain_graph, create_graph).
  void backward(const std::optional<at::Tensor>& gradient = std::nullopt,
                std::optional<bool> retain_graph = std::nullopt, bool create_graph = false);

 private:
  explicit ScaledLoss(std::unique_ptr<detail::ScaleLossState> state);
  friend struct detail::ScaledLossAccess;
  std::unique_ptr<detail::ScaleLossState> state_;
};

OPTAMP_API ScaledLoss scale_loss(const at::Tensor& loss, torch::optim::Optimizer& optimizer,
                                 ScaleLossOptions options = {});
OPTAMP_API ScaledLoss scale_loss(const at::Tensor& loss,
                                 const std::vector<torch::optim::Optimizer*>& optimizers,
                                 ScaleLossOptions options = {});
// scale_loss(loss, {opt_a, opt_b}) with references (or pointers).
OPTAMP_API ScaledLoss scale_loss(const at::Tensor& loss,
                                 std::initializer_list<OptimizerRef> optimizers,
                                 ScaleLossOptions options = {});
// scale_loss(loss, optimizer, loss_id[, delay_unscale]): Apex's positional loss_id.
OPTAMP_API ScaledLoss scale_loss(const at::Tensor& loss, torch::optim::Optimizer& optimizer,
                                 int loss_id, bool delay_unscale = false);

// Steps the optimizer(s) unless a scale_loss guard covering any of their parameters overflowed
// since the previous amp::step of them; then every parameter's gradient is reset to undefined
// instead and nothing else changes. Returns whether the step ran. Throws (changing nothing) while
// gradients are still scaled: inside a live guard, or when the last guard used delay_unscale.
OPTAMP_API bool step(torch::optim::Optimizer& optimizer);
OPTAMP_API bool step(const std::vector<torch::optim::Optimizer*>& optimizers);
OPTAMP_API bool step(std::initializer_list<OptimizerRef> optimizers);

}  // namespace amp
