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
// grads are reset to undefined, so the plain optimizer.step() skips every parameter.

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <vector>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace amp {

struct ScaleLossOptions {
  int loss_id = 0;
  // Leave the grads scaled (a non-final gradient-accumulation micro-batch).
  bool delay_unscale = false;
};

namespace detail {
struct ScaleLossState;
struct ScaledLossAccess;
}  // namespace detail

class ScaledLoss {
 public:
  ScaledLoss(ScaledLoss&& other) noexcept;
  ScaledLoss& operator=(ScaledLoss&&) = delete;
  ScaledLoss(const ScaledLoss&) = delete;
  ScaledLoss& operator=(const ScaledLoss&) = delete;
  // Finishes the step (see above). Errors surface as exceptions, except while another exception
  // is unwinding the stack: then the grads are left scaled (never half-unscaled), stashed grads
  // are restored, and nothing is thrown.
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

ScaledLoss scale_loss(const at::Tensor& loss, torch::optim::Optimizer& optimizer,
                      ScaleLossOptions options = {});
ScaledLoss scale_loss(const at::Tensor& loss,
                      const std::vector<torch::optim::Optimizer*>& optimizers,
                      ScaleLossOptions options = {});

}  // namespace amp
