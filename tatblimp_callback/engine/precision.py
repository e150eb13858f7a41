"""The precision scoring computes in, and how to compute in another one for a forward: autocast, or weights
upcast to float32 a layer at a time.

``precision=`` names it: "auto" (the default) is the precision the model computes in while it trains: the
autocast dtype when the training loop (the Hugging Face Trainer's ``bf16=True``, accelerate's
``mixed_precision="bf16"``, Lightning's ``"bf16-mixed"``) runs its forwards under autocast, else the dtype of the
weights; "float32", "bfloat16" and "float16" force one. ``computing_in(lm, dtype)`` runs what is inside in that
precision: under autocast where ``dtype`` is below the weights' dtype; with every module's weights upcast to
float32 for its own call only (one float32 copy of one layer at a time, never of the whole model) where ``dtype``
is float32 and the weights are not; as the weights are otherwise. The weights' precision of a model sharded by FSDP2 (``fully_shard``)
with a ``MixedPrecisionPolicy`` is its ``param_dtype``, what its layers compute in (``compute_dtype``); upcast, its
layers' gathered weights are upcast inside their own call, and their inputs kept as they come (not cast by FSDP).
A DeepSpeed ZeRO-3 model's partitioned weights are upcast the same way, once its hooks have gathered them, and an
FSDP1 wrapper's gathered weights (or the views it sets in their place) inside each module's call.

A method check below float32 compares each method with that float32 truth of the same weights, and accepts
one whose error is no larger than the plain forward's own (``within_plain_rounding``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .scoring_method import reference_readout

PRECISIONS = ("auto", "float32", "bfloat16", "float16")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A method may be off the float32 truth by this many times the plain forward's own (relative) error.
PLAIN_ERROR_MARGIN = 2.0


def check_precision(precision) -> str:
    """``precision`` as given, if it is one of ``PRECISIONS`` (a ``torch.dtype`` among them is taken by name).

    Raises:
        ValueError: anything else, naming the option, the value and the choices.
    """
    if isinstance(precision, torch.dtype):
        precision = str(precision).removeprefix("torch.")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(repr(p) for p in PRECISIONS)}, got {precision!r}")
    return precision


def weights_dtype(lm: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point weight (float32 when it has none)."""
    for parameter in lm.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def compute_dtype(lm: torch.nn.Module) -> torch.dtype:
    """The dtype ``lm``'s forward computes its weights in: the ``param_dtype`` that FSDP's mixed precision gathers
    them in (FSDP2's ``MixedPrecisionPolicy``, FSDP1's ``MixedPrecision`` of a wrapped layer), else ``weights_dtype``."""
    for module in lm.modules():  # the outermost FSDP module's policy
        policy = _fsdp_policy(module)
        if policy is not None:
            return policy.param_dtype or weights_dtype(lm)
    return weights_dtype(lm)


def _fsdp_policy(module: torch.nn.Module):
    """The mixed-precision setting of an FSDP module: FSDP2's ``MixedPrecisionPolicy`` (``fully_shard``), FSDP1's
    ``MixedPrecision`` (a ``FullyShardedDataParallel`` wrapper); None for any other module."""
    state = getattr(module, "_get_fsdp_state", None)  # FSDPModule's; its state holds the policy
    if callable(state):
        return getattr(state(), "_mp_policy", None)
    return module.mixed_precision if _is_fsdp1(module) else None


def _is_fsdp1(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "FullyShardedDataParallel" and hasattr(module, "_fsdp_wrapped_module")


def training_autocast_dtype(model: torch.nn.Module, trainer_args=None) -> torch.dtype | None:
    """The dtype the training loop's forwards autocast to, or None when it trains without autocast.

    Read from the Trainer's arguments (``bf16``, ``fp16``), from accelerate's wrapping of the model's forward
    (``_original_forward`` beside an autocast-wrapped ``forward``), or from autocast being on right now (a
    Lightning ``"bf16-mixed"`` step, a plain loop's ``torch.autocast``).
    """
    if trainer_args is not None:
        if getattr(trainer_args, "bf16", False):
            return torch.bfloat16
        if getattr(trainer_args, "fp16", False):
            return torch.float16
    for module in (model, getattr(model, "module", None)):
        dtype = _accelerate_autocast_dtype(module)
        if dtype is not None:
            return dtype
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    return None


def mixed_precision_dtype(setting) -> torch.dtype | None:
    """The autocast dtype a mixed-precision setting names (Lightning's ``"bf16-mixed"``, ``"16-mixed"``; accelerate's
    ``"bf16"``, ``"fp16"``), or None: no autocast (``"32-true"``, ``"bf16-true"``, whose weights are bf16 themselves)."""
    return {"bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16, "16-mixed": torch.float16, "fp16": torch.float16}.get(
        str(setting)
    )


def precision_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> "bfloat16", as results record it."""
    return str(dtype).removeprefix("torch.")


def _accelerate_autocast_dtype(module) -> torch.dtype | None:
    """The dtype of the autocast accelerate wrapped ``module.forward`` in (``prepare_model`` with mixed precision)."""
    if module is None or not hasattr(module, "_original_forward"):
        return None
    forward = getattr(module, "forward", None)
    # accelerate: forward = convert_outputs_to_fp32(torch.autocast(...)(model.forward)); the autocast object sits
    # in the wrapped function's closure (functools.wraps keeps __wrapped__ chains).
    seen = 0
    while forward is not None and seen < 8:
        for cell in getattr(forward, "__closure__", None) or ():
            content = cell.cell_contents
            if isinstance(content, torch.autocast):
                return content.fast_dtype
        forward = getattr(forward, "__wrapped__", None) or getattr(forward, "__func__", None)
        seen += 1
    return None


def resolve_precision(precision: str, lm: torch.nn.Module, autocast_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype ``precision`` scores ``lm`` in: "auto" is ``autocast_dtype`` where training autocasts, else the
    weights' dtype; the others are what they name."""
    precision = check_precision(precision)
    if precision == "auto":
        return autocast_dtype if autocast_dtype is not None else compute_dtype(lm)
    return DTYPES[precision]


def scoring_precision(model: torch.nn.Module, lm: torch.nn.Module, precision, device: torch.device) -> torch.dtype:
    """The dtype ``precision`` scores ``model`` (unwrapped: ``lm``) in on ``device``; None: the weights' dtype.

    Raises:
        ValueError: an unknown ``precision``, or one the device cannot run (``check_runs``).
    """
    if precision is None:
        return compute_dtype(lm)
    dtype = resolve_precision(precision, lm, training_autocast_dtype(model))
    check_runs(lm, dtype, device)
    return dtype


def check_runs(lm: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Raise where ``dtype`` cannot be computed in on ``device`` (float16 or bfloat16 autocast on a device without it).

    Raises:
        ValueError: naming the option, the value and the choices.
    """
    if dtype == compute_dtype(lm) or dtype == torch.float32:
        return
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"precision='bfloat16' cannot run on {device} (no bfloat16 support); choose one of 'auto', 'float32', 'float16'"
        )
    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        raise ValueError(
            f"precision={str(dtype).removeprefix('torch.')!r} needs autocast, which {device.type} lacks; choose 'auto' or 'float32'"
        )


@contextmanager
def computing_in(
    lm: torch.nn.Module, dtype: torch.dtype, device: torch.device, head=None, weights: torch.dtype | None = None
) -> Iterator[None]:
    """What runs inside computes ``lm`` in ``dtype``: under autocast below the weights' dtype, with the weights
    upcast a module at a time for float32 above it, as the weights are otherwise (autocast of the caller off).

    ``head``: the LM head module, upcast whole for all of the context instead (its weight read directly by the
    tiled head, ``tiled_head``, outside its own call), left without hooks so that it stays a plain linear layer.
    ``weights``: ``compute_dtype(lm)`` where the caller knows it (it walks every module)."""
    weights = weights or compute_dtype(lm)
    with ExitStack() as stack:
        if dtype == weights or (dtype == torch.float32 and weights == torch.float64):
            stack.enter_context(_no_autocast(device))
        elif dtype == torch.float32 and getattr(lm, "reads_weights_anywhere", False):
            # A callable's own code may use a weight outside its module's call (nanoGPT's head tied as
            # F.linear(h, wte.weight)), where no module hook upcasts it: every weight float32 for the whole block.
            stack.enter_context(_no_autocast(device))
            for module in lm.modules():
                stack.enter_context(_upcast_module(module, dtype))
        elif dtype == torch.float32:
            stack.enter_context(_no_autocast(device))
            if head is not None:
                stack.enter_context(_upcast_module(head, dtype))
            stack.enter_context(upcast_weights(lm, skip=head))
        else:
            stack.enter_context(torch.autocast(device.type, dtype=dtype))
        yield


def _upcast_tensors(module: torch.nn.Module, dtype: torch.dtype, views: tuple[str, ...] = ()) -> list:
    """``module``'s own low-precision weights and buffers made ``dtype`` in place; [(tensor, its original data)].
    ``views``: the names of weights FSDP1 sets as plain tensor attributes for the forward (``_fsdp1_views``)."""
    saved = []
    for tensors in (module._parameters.values(), module._buffers.values(), [vars(module).get(n) for n in views]):
        for tensor in tensors:
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.is_floating_point()
                and tensor.dtype != dtype
                and tensor.element_size() < 4
            ):
                saved.append((tensor, tensor.data))
                tensor.data = tensor.data.to(dtype)
    return saved


@contextmanager
def _upcast_module(module: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    saved = _upcast_tensors(module, dtype)
    try:
        yield
    finally:
        for tensor, data in saved:
            tensor.data = data


def _no_autocast(device: torch.device):
    """The caller's autocast off, on a device that has autocast (elsewhere there is none to turn off)."""
    available = torch.amp.autocast_mode.is_autocast_available(device.type)
    return torch.autocast(device.type, enabled=False) if available else nullcontext()


@contextmanager
def upcast_weights(lm: torch.nn.Module, dtype: torch.dtype = torch.float32, skip=None) -> Iterator[None]:
    """Every module's own low-precision weights and buffers are ``dtype`` while that module runs, and as they were
    after: one module's upcast copy exists at a time. The originals are put back, bit for bit (on an exception too).
    ``skip``: a module left alone (no hooks).

    Under FSDP2 (``fully_shard``) and DeepSpeed ZeRO-3 a module's weights are gathered by their own hooks: ours run
    inside them (the upcast after the pre-forward has gathered the weights, the restore before the post-forward
    frees them). Under FSDP1 a wrapper gathers its layers' weights before they run: ours upcast what each module
    is given (its parameters, or the plain tensor views FSDP1 sets in their place). The inputs that FSDP's mixed
    precision would cast to its ``param_dtype`` are kept as they came."""
    handles = []
    views = _fsdp1_views(lm)

    def before(module, args):
        saved = _upcast_tensors(module, dtype, views.get(module, ()))
        if saved:
            module.__dict__.setdefault("_tatblimp_upcast", []).append(saved)

    def after(module, args, output):
        restore(module)

    def restore(module):
        stack = module.__dict__.get("_tatblimp_upcast")
        if stack:
            for tensor, data in stack.pop():
                tensor.data = data

    modules = [
        m for m in lm.modules() if m is not skip and (any(True for _ in m.parameters(recurse=False)) or m._buffers or m in views)
    ]
    try:
        for module in modules:
            gathered = (_fsdp_policy(module) is not None and not _is_fsdp1(module)) or _zero3_partitioned(module)
            handles.append(module.register_forward_pre_hook(before))  # after FSDP's (prepended) or ZeRO-3's gather
            handles.append(module.register_forward_hook(after, always_call=True, prepend=gathered))  # before the release
        handles += _keep_inputs_from_fsdp_cast(lm)
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in modules:
            while module.__dict__.get("_tatblimp_upcast"):
                restore(module)
            module.__dict__.pop("_tatblimp_upcast", None)


def _fsdp1_views(lm: torch.nn.Module) -> dict[torch.nn.Module, tuple[str, ...]]:
    """The modules whose weights FSDP1 (``use_orig_params=False``) flattens: each one's weight names, which its
    wrapper sets as plain tensor attributes (views of the gathered ``FlatParameter``) for the forward."""
    views: dict = {}
    for module in lm.modules():
        for flat in module._parameters.values():
            for info in (*getattr(flat, "_param_infos", ()), *getattr(flat, "_shared_param_infos", ())):
                views[info.module] = (*views.get(info.module, ()), info.param_name)
    return views


def _zero3_partitioned(module: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions ``module``'s own weights (gathered by its hooks for each call)."""
    return any(hasattr(p, "ds_id") for p in module.parameters(recurse=False))


def _keep_inputs_from_fsdp_cast(lm: torch.nn.Module) -> list:
    """Hooks on every FSDP module whose mixed precision casts its floating-point inputs to ``param_dtype`` that hand
    it the inputs as they came instead (each one FSDP cast), FSDP's pre-forward running as usual between: on an
    FSDP2 module, its own hooks around FSDP's; on an FSDP1 wrapper, a hook on it and one on the module it wraps."""
    handles, inputs = [], {}  # inputs: by the module that runs after FSDP's cast, what was given

    def cast_module(module):  # what runs after FSDP's cast of the inputs
        return module._fsdp_wrapped_module if _is_fsdp1(module) else module

    def keep(module, args, kwargs):
        inputs[cast_module(module)] = (args, kwargs)

    def put_back(module, args, kwargs):
        given, spec = tree_flatten(inputs.pop(module))
        cast, cast_spec = tree_flatten((args, kwargs))
        if spec != cast_spec:
            raise RuntimeError(f"tatblimp: FSDP changed the inputs of {type(module).__name__} beyond casting them")
        kept = [
            old.to(new.device) if isinstance(old, torch.Tensor) and old.is_floating_point() and old.dtype != new.dtype else new
            for old, new in zip(given, cast, strict=True)
        ]
        return tree_unflatten(kept, spec)

    for module in lm.modules():
        policy = _fsdp_policy(module)
        if policy is not None and policy.cast_forward_inputs and policy.param_dtype is not None:
            handles.append(module.register_forward_pre_hook(keep, prepend=True, with_kwargs=True))  # before FSDP's
            handles.append(cast_module(module).register_forward_pre_hook(put_back, with_kwargs=True))  # after FSDP's
    return handles


def float32_truth(lm, forward, cache, precision: torch.dtype, sharded: bool):
    """The method check's float32 truth below float32: a function of the sample's sequences that scores them plainly
    (``scoring_method.reference_readout``) in float32, the weights upcast a layer at a time. None in float32, and for
    a model split by tensor parallelism (DTensor weights outside FSDP2), whose shards no module hook gathers. A
    sharded model's forward (FSDP1, FSDP2, ZeRO-3) is a collective: every process must compute the truth of the same
    sequences, as the method check and ``exact_decisions`` do."""
    gathered_by_hooks = _fsdp1_views(lm) or any(_fsdp_policy(m) is not None or _zero3_partitioned(m) for m in lm.modules())
    if precision.itemsize >= 4 or (sharded and not gathered_by_hooks):
        return None

    def truth(sequences: list[int]) -> torch.Tensor:
        with computing_in(lm, torch.float32, cache.device):
            return reference_readout(forward, cache, sequences)

    return truth


def relative_errors(values: torch.Tensor, truth: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``|values - truth| / scale`` where ``truth`` is finite (a flat tensor)."""
    finite = torch.isfinite(truth)
    return ((values - truth).abs() / scale)[finite]


def within_plain_rounding(
    values: torch.Tensor, plain: torch.Tensor, truth: torch.Tensor, scale: torch.Tensor, float32_rtol: float
) -> bool:
    """Whether ``values`` are as close to the float32 ``truth`` as the plain forward (``plain``) of the model in its
    own precision is: each within (``PLAIN_ERROR_MARGIN`` x the plain forward's largest relative error +
    ``float32_rtol``) x ``scale``, and non-finite where ``truth`` is.

    ``scale``: what each value's rounding is relative to (``|truth| + LOGIT_SCALE x tokens``).
    """
    finite = torch.isfinite(truth)
    if not torch.equal(torch.isfinite(values), finite) or not finite.any():
        return False
    plain_error = relative_errors(plain, truth, scale)
    plain_error = plain_error[torch.isfinite(plain_error)]
    allowed = (PLAIN_ERROR_MARGIN * (plain_error.max().item() if plain_error.numel() else 0.0) + float32_rtol) * scale
    return bool(((values - truth).abs() <= allowed)[finite].all())


def per_token_error(values: torch.Tensor, truth: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each sequence's error against the float32 ``truth``, per scored token (finite ones only)."""
    finite = torch.isfinite(truth) & torch.isfinite(values)
    return ((values - truth).abs() / tokens.clamp(min=1))[finite]
