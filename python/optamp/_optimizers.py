"""Which optimizer steps: wrappers that subclass ``torch.optim.Optimizer`` without being one."""
import torch


def stepping_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose ``step()`` runs step hooks and reads GradScaler's ``found_inf``. For a
    wrapper, the optimizer it wraps, found as the attribute sharing its ``param_groups`` (the
    wrapper's ``step`` runs that one's): torch's ``PostLocalSGDOptimizer`` and Accelerate's
    ``AcceleratedOptimizer`` subclass ``Optimizer`` without running its ``__init__`` (no hooks of
    their own); Lightning's ``LightningOptimizer`` and Fabric's optimizer copy the wrapped one's
    ``__dict__``, its hooks included, so wrappers are looked through before hooks are looked
    for. Else ``optimizer`` itself. ``initialize`` records this optimizer and ``scale_loss``
    checks it, so a wrapper made after ``initialize`` (``accelerator.prepare``) is the optimizer
    given there; an optimizer optamp cannot skip is refused there and when a guard opens, before
    the backward, not at the first overflow."""
    for value in vars(optimizer).values():
        if (isinstance(value, torch.optim.Optimizer) and value is not optimizer
                and value.param_groups is optimizer.param_groups):
            return stepping_optimizer(value)
    if hasattr(optimizer, "_optimizer_step_pre_hooks"):
        return optimizer
    raise TypeError(
        f"optimizer {type(optimizer).__name__} subclasses torch.optim.Optimizer without running "
        "Optimizer.__init__ (it has no step hooks) and wraps no optimizer that shares its "
        "param_groups: optamp cannot skip its step after an overflow. Pass the optimizer it "
        "wraps to initialize and scale_loss instead")
