"""``optamp.initialize`` for ``torch.nn.Module`` / ``torch.optim`` objects.

The Python side only collects tensors (parameters and buffers split by batch-norm / keep flags,
optimizer params, optimizer state, eps) and hands them to the compiled core that the C++
``amp::initialize`` also uses: validation, O2/O5 working copies, O3 casting and the loss scalers
all live there, and so do the parameter names error messages use (the core's namer, given
here). What needs Python objects lives here: the model boundary's forward wrapper (_boundary.py,
as in Apex) and the fp32 state_dict hook of models cast in place.
"""
import enum
import itertools
import sys
import threading
import warnings
import weakref
from typing import (Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple, Type,
                    TypeVar, Union)

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from . import _C, _boundary, _compile, _distributed, _dtensor, _opacus, _pipelining, ab, scaler
from ._optimizers import stepping_optimizer

ModelArg = Union[torch.nn.Module, Sequence[torch.nn.Module]]
OptimizerArg = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]
_T = TypeVar("_T")


class ModelCast(str, enum.Enum):
    """What initialize does to the model's floating tensors (C++: ``amp::ModelCast``). The values
    are the strings ``Properties.model_cast`` holds, so the two compare equal."""

    NONE = "not cast"
    WORKING_COPIES = "working copies"
    IN_PLACE = "cast in place"


_lock = threading.Lock()
_fp32_marks: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # keep_in_fp32's modules
_state_dict_hooks: List[RemovableHandle] = []  # fp32 state_dict hooks of models cast in place


def _is_tensor(x: object) -> bool:
    return isinstance(x, torch.Tensor)


def keep_in_fp32(module: torch.nn.Module) -> None:
    """Keep ``module``'s own parameters and buffers in fp32 at O2/O3/O5, as batch-norm modules
    are under ``keep_batchnorm_fp32``. Call before :func:`initialize`."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    with _lock:
        _fp32_marks.add(module)


def _as_list(value: object, what: str, kind: Type[_T], kind_name: str) -> Tuple[List[_T], bool]:
    was_list = isinstance(value, (list, tuple))
    items: List[Any] = list(value) if isinstance(value, (list, tuple)) else [value]
    for i, item in enumerate(items):
        if not isinstance(item, kind):
            where = f"{what}[{i}]" if was_list else what
            raise TypeError(
                f"{where} must be a {kind_name} (or a list of them), got {type(item).__name__}"
            )
    return items, was_list


def _is_batch_norm(module: torch.nn.Module) -> bool:
    """A batch norm, eager or scripted (a TorchScript module is no ``_BatchNorm``; its type keeps
    the module path of the class it was scripted from)."""
    if isinstance(module, _BatchNorm):
        return True
    if isinstance(module, torch.jit.ScriptModule):
        name: str = module._c._type().qualified_name()
        return name.startswith("__torch__.torch.nn.modules.batchnorm.")
    return False


def _collect_models(
    models: List[torch.nn.Module], keep_batchnorm: bool
) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor], List[str]]:
    reduced: List[torch.Tensor] = []
    keep: List[torch.Tensor] = []
    parameters: List[torch.Tensor] = []
    names: List[str] = []
    seen: Set[int] = set()
    for k, model in enumerate(models):
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            raise RuntimeError(
                f"models[{k}] is a {type(model).__name__}: parallel wrappers must be applied to "
                "the model(s) AFTER optamp.initialize returns them (as in Apex)"
            )
        prefix = f"models[{k}]." if len(models) > 1 else ""
        for mod_name, module in model.named_modules(remove_duplicate=True):
            keep_this = (keep_batchnorm and _is_batch_norm(module)) or module in _fp32_marks
            target = keep if keep_this else reduced
            for p_name, p in module.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                target.append(p)
                parameters.append(p)
                names.append(prefix + (f"{mod_name}.{p_name}" if mod_name else p_name))
            for b in module.buffers(recurse=False):
                if b is None or id(b) in seen or not b.is_floating_point():
                    continue
                seen.add(id(b))
                target.append(b)
    return reduced, keep, parameters, names


def _collect_optimizers(optimizers: List[torch.optim.Optimizer]) -> List[Dict[str, object]]:
    out: List[Dict[str, object]] = []
    for i, opt in enumerate(optimizers):
        stepper = stepping_optimizer(opt)  # what scale_loss checks and skips (wrappers: the inner)
        if getattr(stepper, "_overlap_with_ddp", False):
            raise ValueError(
                f"optimizer {i} ({type(opt).__name__}) has overlap_with_ddp=True: it steps inside "
                "DDP's backward (hook_with_zero_step), on the gradients before the scale_loss "
                "guard unscales and checks them, so an overflow could not skip its updates (and "
                "a loss scale other than 1 would multiply them). Use overlap_with_ddp=False (it "
                "then steps in optimizer.step())")
        params: List[torch.Tensor] = []
        state: List[torch.Tensor] = []
        owners: List[torch.Tensor] = []
        smallest_eps = 0.0
        for group in opt.param_groups:
            eps = group.get("eps")
            if isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0:
                if smallest_eps == 0.0 or eps < smallest_eps:
                    smallest_eps = float(eps)
            for p in group["params"]:
                params.append(p)
                for key, value in opt.state.get(p, {}).items():
                    # torch keeps Adam's "step" counters on the CPU by design: not device state.
                    if not _is_tensor(value) or key == "step" or value.dim() == 0:
                        continue
                    state.append(value)
                    owners.append(p)
        out.append(
            {
                "identity": id(stepper),
                "description": f"optimizer {i} ({type(opt).__name__})",
                "parameters": params,
                "state": state,
                "state_owners": owners,
                "smallest_eps": smallest_eps,
                "steps_through_closure": isinstance(stepper, torch.optim.LBFGS),  # refused
            }
        )
    return out


def _refuse_script_modules_cast_in_place(models: List[torch.nn.Module], cast: Any) -> None:
    """O3 keeps a model cast in place saving fp32 state dicts through a state_dict hook, which a
    ScriptModule cannot take; refused before anything is changed."""
    if cast != ModelCast.IN_PLACE:
        return
    for index, model in enumerate(models):
        if isinstance(model, torch.jit.ScriptModule):
            raise ValueError(
                f"models[{index}] is a TorchScript module ({type(model).__name__}), which a level "
                "that casts the model in place (O3, or master_weights=False) cannot take: its "
                "fp32 state_dict needs a state_dict hook, which ScriptModules do not support. "
                "Use O2/O5 (fp32 master weights), or initialize the eager model and script it "
                "afterwards")


class _Sharded(NamedTuple):
    """The first sharded part of the models. ``model_index`` is -1 for DTensors only an optimizer
    holds. ``gathered``: FSDP (FSDP2's ``fully_shard``, FSDP1) gathers the shards into new
    parameters for every forward; tensor parallelism's DTensor parameters are the ones the
    forward uses."""

    model_index: int
    what: str
    gathered: bool


def _fsdp_module(model: torch.nn.Module) -> Optional[str]:
    """What names the model's first FSDP2 (``fully_shard``) or FSDP1 module, if it has one."""
    if "torch.distributed.fsdp" not in sys.modules:  # otherwise no FSDP module can exist
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            return f"FSDP2's fully_shard ({name or 'itself'})"
        if isinstance(module, FullyShardedDataParallel):
            return f"an FSDP1 FullyShardedDataParallel module ({name or 'itself'})"
    return None


def _sharded_part(models: List[torch.nn.Module],
                  optimizers: List[torch.optim.Optimizer]) -> Optional[_Sharded]:
    """The first sharded part of the models: a DTensor parameter or buffer (FSDP2's
    ``fully_shard``, tensor parallelism) or an FSDP1 ``FullyShardedDataParallel`` module; None
    when nothing is sharded."""
    for index, model in enumerate(models):
        fsdp = _fsdp_module(model)
        dtensor = _dtensor_name(model)
        if dtensor is not None:
            owner = f": {fsdp}" if fsdp else ", tensor parallelism"
            return _Sharded(index, f"sharded (DTensor) parameters ({dtensor}{owner})",
                            fsdp is not None)
        if fsdp is not None:
            return _Sharded(index, fsdp, True)
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor

        for opt in optimizers:
            if any(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"]):
                return _Sharded(-1, "", False)
    return None


def _dtensor_name(model: torch.nn.Module) -> Optional[str]:
    """The name of the model's first DTensor parameter or buffer."""
    if "torch.distributed.tensor" not in sys.modules:  # otherwise no DTensor can exist
        return None
    from torch.distributed.tensor import DTensor

    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if isinstance(tensor, DTensor):
            return name
    return None


def _refuse_sharded_models_cast(sharded: Optional[_Sharded], cast: Any, opt_level: str) -> None:
    """Levels that cannot keep a sharded model, refused before anything is changed.

    FSDP gathers the shards into new parameters (FSDP2) or views of a flat parameter (FSDP1)
    for every forward, which O2/O5's working copies never see (the run was silently O1/O4) and
    O3's in-place cast breaks; FSDP has its own way to hold fp32 shards and compute with
    fp16/bf16 parameters. Tensor parallelism's DTensor parameters are the forward's own, so
    O2/O5 cast them as any parameter (a working copy per step, cast by the DTensor); only an
    in-place cast (O3) is refused: it replaces the DTensor's data, not its local shard's."""
    if cast == ModelCast.NONE or sharded is None or sharded.model_index < 0:
        return
    if sharded.gathered:
        raise ValueError(
            f"models[{sharded.model_index}] has {sharded.what}, which opt_level {opt_level} cannot "
            "cast: FSDP gathers the shards into new parameters for every forward. For O2's "
            "arrangement (fp32 sharded master weights, fp16/bf16 compute) pass FSDP's mixed "
            "precision policy (FSDP2: fully_shard(..., mp_policy=MixedPrecisionPolicy("
            "param_dtype=torch.float16, reduce_dtype=torch.float32)); FSDP1: mixed_precision="
            "MixedPrecision(param_dtype=torch.float16)) and initialize with O1 (O4 for "
            "bfloat16), which casts the ops and scales the sharded gradients' loss")
    if cast == ModelCast.IN_PLACE:
        raise ValueError(
            f"models[{sharded.model_index}] has {sharded.what}, which opt_level {opt_level} cannot "
            "cast in place: a DTensor parameter's local shard would keep its dtype. Use O2 (fp32 "
            "master weights, fp16 working copies; O5 for bfloat16) or O1/O4")


def _flush_torchscript_plans(models: List[torch.nn.Module]) -> None:
    """Drops the execution plans TorchScript made for the models' methods before initialize.

    While casting is on, a thread runs TorchScript unoptimized (the core's carried_state.cpp
    says why: the optimizer's symbolic gradients assume the dtypes it recorded), but a method
    already optimized by earlier training steps keeps its plan; flushed, it is planned afresh.
    ``_debug_flush_compilation_cache`` is TorchScript's own reset of a method's executor."""
    for model in models:
        for module in model.modules():
            if not isinstance(module, torch.jit.ScriptModule):
                continue
            for name in module._c._method_names():  # the methods, not the boundary's forward
                method = module._c._get_method(name)
                flush = getattr(method, "_debug_flush_compilation_cache", None)
                if flush is not None:
                    flush()


def _fp32_state_dict(module: torch.nn.Module, state_dict: Dict[str, Any], prefix: str,
                     local_metadata: Dict[str, Any]) -> None:
    """Apex's O2StateDictHook: a model cast in place still saves fp32 tensors, so its
    checkpoints load anywhere (fp32 inference, another level). Loading them back casts to the
    model's dtype exactly (the values were fp16/bf16)."""
    own = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    for key, value in state_dict.items():
        if (key.startswith(prefix) and _is_tensor(value)
                and id(value) not in own  # keep_vars=True asked for the tensors themselves
                and value.dtype in (torch.float16, torch.bfloat16)):
            state_dict[key] = value.float()


def initialize(
    models: ModelArg,
    optimizers: Optional[OptimizerArg] = None,
    enabled: Union[bool, str] = True,
    opt_level: Union[str, _C.OptLevel, None] = "O1",
    cast_model_type: Union[torch.dtype, bool, None] = None,
    patch_torch_functions: Union[bool, str, None] = None,
    keep_batchnorm_fp32: Union[bool, str, None] = None,
    master_weights: Union[bool, str, None] = None,
    loss_scale: Union[float, str, None] = None,
    cast_model_outputs: Optional[torch.dtype] = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: Optional[float] = None,
    max_loss_scale: float = 2.0**24,
    process_group: Optional["torch.distributed.ProcessGroup"] = None,
    op_lists: Optional[str] = None,
    cast_model_inputs: Optional[bool] = None,
    **scaler_knobs: Union[float, int],
) -> Any:
    """Apex's ``amp.initialize``: set up ``opt_level`` for the model(s) and optimizer(s).

    Returns ``model`` alone when ``optimizers`` is None, else ``(model, optimizer)``, each a
    single object or a list as passed (hence the ``Any`` return type). The objects are the ones
    passed in (optamp changes no optimizer and, except O3's in-place cast and the forward
    wrapper, no model).

    The models' forward gets Apex's boundary wherever the model is cast (O2, O3, O5):
    floating inputs are cast to the model's dtype and floating outputs to
    ``cast_model_outputs`` (fp32 when None); at O0/O1/O4 only an explicit
    ``cast_model_outputs`` applies. At O2/O5 inputs go to fp16/bf16 only where ops see the
    working copies (not under ``no_grad``, where the model is its fp32 masters).
    ``cast_model_inputs=False`` (optamp's) leaves the inputs as given, outputs still cast: for a
    forward that takes tensors which must stay fp32 (a float timestep or noise level, a
    detection model's targets).

    ``None`` means "not overridden". ``scaler_knobs``: ``init_scale``, ``growth_factor``,
    ``backoff_factor``, ``growth_interval``, ``hysteresis``. ``process_group`` (optamp's, for
    model parallelism): every loss scaler max-reduces its overflow flag over this
    ``torch.distributed`` group, so all ranks skip the same steps (see ``scale_loss``).
    ``op_lists`` (optamp's): ``"apex"`` (the default) casts by Apex's O1 lists, ``"torch"`` by
    ``torch.autocast``'s own lists for each tensor's device (docs/casting.md, Op lists).

    Casting is per thread: it is turned on for the calling thread only. Other threads see plain
    fp32 unless they enter ``optamp.autocast()`` or ``optamp.thread_state_guard(state)`` with a
    state captured by ``optamp.ThreadState.capture()`` on this thread.
    With ``enabled=False`` the objects are returned untouched and ``scale_loss`` scales by 1;
    it still counts as the one initialize call (``reset()`` before initializing again).
    """
    model_list, models_was_list = _as_list(models, "models", torch.nn.Module, "torch.nn.Module")
    opt_list: List[torch.optim.Optimizer]
    if optimizers is None:
        opt_list, optimizers_was_list = [], False
    else:
        opt_list, optimizers_was_list = _as_list(
            optimizers, "optimizers", torch.optim.Optimizer, "torch.optim.Optimizer")
    overrides = dict(
        enabled=enabled,
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=loss_scale,
        num_losses=num_losses,
        verbosity=verbosity,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
        op_lists=op_lists,
        cast_model_outputs=cast_model_outputs,
        cast_model_inputs=cast_model_inputs,
        **scaler_knobs,
    )
    if opt_level is None and not _C.resolve("O0", enabled=enabled).enabled:
        # Apex returned at once when disabled, so scripts pass the level of a run that never
        # casts as None (``opt_level=args.opt_level, enabled=args.amp``).
        opt_level = "O0"
    _distributed.check_process_group(process_group)
    preview = _C.resolve(opt_level, **overrides)  # validates the options before collecting
    _refuse_script_modules_cast_in_place(model_list, preview.model_cast)
    _opacus.refuse_scaled_losses(opt_list, preview)
    sharded = _sharded_part(model_list, opt_list)
    _refuse_sharded_models_cast(sharded, preview.model_cast if preview.enabled else ModelCast.NONE,
                                preview.opt_level)
    with _lock:
        reduced, keep, parameters, names = _collect_models(
            model_list, bool(preview.keep_batchnorm_fp32)
        )
        opts = _collect_optimizers(opt_list)
        props = _C._initialize_core(
            reduced, keep, parameters, names, opts, opt_level, **overrides
        )
        _distributed.set_process_group(process_group if props.enabled else None, props.num_losses)
        if props.enabled:
            _pipelining.install(import_if_distributed=True)  # stages: same dtypes without grad
        if sharded is not None:
            _dtensor.install()  # the unscale ops on DTensor gradients
            # FSDP2 reduce-scatters a module's gradients when the gradients of its inputs are
            # computed: none may wait in a bucket (cast_cache.h, set_gradient_buckets).
            _C._set_gradient_buckets(False)
        if props.model_boundary != (None, None):
            for model in model_list:
                _boundary.wrap(model)
        if props.model_cast == ModelCast.IN_PLACE:
            for model in model_list:
                _state_dict_hooks.append(model.register_state_dict_post_hook(_fp32_state_dict))
        if props.casts:
            _flush_torchscript_plans(model_list)
    _warn_fused_sgd_on_cpu(opt_list)
    if props.enabled:
        _opacus.run_steps_uncast(opt_list)  # DP-SGD clips with grad mode on: not cast
    global _properties
    _properties = props
    _compile.on_initialize(props.casts, _C._working_copy_sources())
    ab._precision.start(model_list)  # python -m optamp.ab --precision-steps: from here

    models_out = model_list if models_was_list else model_list[0]
    if optimizers_was_list:
        return models_out, opt_list
    if not opt_list:
        return models_out
    return models_out, opt_list[0]


_properties: Optional[_C.Properties] = None


_fused_sgd_cpu_broken: Dict[torch.dtype, bool] = {}


def _fused_sgd_leaves_cpu_params(dtype: torch.dtype) -> bool:
    """Whether this torch's fused SGD kernel leaves a 16-element CPU parameter of ``dtype``
    unchanged (torch 2.11 does for fp16 and bf16: its vectorized loop writes no parameter).
    Asked once per dtype, by stepping one."""
    if dtype not in _fused_sgd_cpu_broken:
        p = torch.ones(16, dtype=dtype)
        torch._fused_sgd_([p], [torch.ones(16, dtype=dtype)], [], weight_decay=0.0, momentum=0.0,
                          lr=0.5, dampening=0.0, nesterov=False, maximize=False,
                          is_first_step=False)
        _fused_sgd_cpu_broken[dtype] = bool(p[0] == 1)
    return _fused_sgd_cpu_broken[dtype]


def _warn_fused_sgd_on_cpu(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """torch 2.11's ``SGD(fused=True)`` leaves fp16/bf16 CPU parameters of 16 elements or more
    unchanged: a run with such parameters (O3, or a reduced-precision model at O0) would not
    train, and nothing would say so."""
    for i, opt in enumerate(optimizers):
        if not isinstance(stepping_optimizer(opt), torch.optim.SGD):
            continue
        stuck = [p for g in opt.param_groups if g.get("fused") for p in g["params"]
                 if p.device.type == "cpu" and p.dtype in (torch.float16, torch.bfloat16)
                 and p.numel() >= 16 and _fused_sgd_leaves_cpu_params(p.dtype)]
        if stuck:
            warnings.warn(
                f"optimizer {i} (SGD with fused=True) steps {len(stuck)} {stuck[0].dtype} "
                f"parameters on the CPU, which this torch's fused CPU kernel leaves unchanged "
                f"(torch {torch.__version__}): use SGD without fused=True for them",
                stacklevel=3)


def properties() -> Optional[_C.Properties]:
    """The resolved :class:`optamp.Properties` of the last :func:`initialize` (None after reset)."""
    return _properties


def reset() -> None:
    """Turn everything off (casting on this thread, level rules, caches, loss scalers, forward
    wrappers, keep_in_fp32 marks) so that :func:`initialize` can be called again."""
    global _properties
    with _lock:
        _C._reset_core()  # the loss scalers and their found-inf reducers go with it
        scaler.drop_waiting_steps()  # skips and overflow flags left for optimizers' next steps
        _opacus.restore_steps()
        _C._set_gradient_buckets(True)
        _distributed.set_process_group(None, 0)
        _boundary.unwrap_all()
        for handle in _state_dict_hooks:
            handle.remove()
        _state_dict_hooks.clear()
        _fp32_marks.clear()
        _properties = None
        _compile.on_reset()


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Yield the parameters ``optimizer`` steps (Apex's ``amp.master_params``). In optamp's
    design these ARE the fp32 master weights at O2/O5, so ``model.parameters()`` works as well."""
    for group in optimizer.param_groups:
        yield from group["params"]
