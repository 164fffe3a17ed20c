#pragma once
// Internal events between components that must not depend on each other directly.
//
// "Weights may change": the point after which an optimizer step may update parameters. The
// loss scaler raises it when a step ends (a scale_loss guard's non-delayed unscale, through
// LossScaler::finish_step, or the low-level LossScaler::update()); the cast cache listens and
// drops its entries. The version counter alone can't tell us: LibTorch's C++ optimizers update
// through `p.data().add_(...)`, which does not bump it.

namespace amp::detail {

using StepListener = void (*)();

// Registers `listener` (idempotent for the same pointer). Safe from static initializers.
void add_weights_may_change_listener(StepListener listener);

// Calls every registered listener, in registration order.
void notify_weights_may_change();

}  // namespace amp::detail
