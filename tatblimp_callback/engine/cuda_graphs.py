"""The plan replayed as CUDA graphs: each batch's body and head captured once, replayed at every later evaluation.

The plan's batches are fixed tensors on the device (``packing.Batches.prepared``), so a batch's whole forward
call (its inputs widened from the plan, the tree mask, the body, the head's log-probs) reads the same memory at
every evaluation: the ideal case for a CUDA graph, which replays its kernels without launching them one by one
from Python. A plan's graphs are captured at its second evaluation (after the method check and the head's choice;
a one-off evaluation never pays for a capture), per batch:

1. the batch is scored eagerly on a side stream with host synchronisation forbidden
   (``torch.cuda.set_sync_debug_mode("error")``): that gives this evaluation's values, warms the kernels up, and
   shows whether the forward can be captured at all (a ``.item()``, ``.tolist()`` or data-dependent shape in it
   cannot);
2. the same call is captured into a graph (all batches' graphs share one memory pool, replayed in order);
3. the graph is replayed once and its log-probs compared with the eager ones, bit for bit; a difference drops
   the graphs for good (for this plan and model), with the reason logged.

What a graph read is keyed by (``GraphKey``): the plan (the layout object, made again for a new budget), the scoring
method and the head's, and the model's structure (each parameter's and buffer's storage, by ``data_ptr``; the
modules, their hooks and PEFT adapters' merged and active state). An optimizer's in-place step changes none of
these (the graph reads the new weights); a parameter whose storage was replaced, a method chosen again, a LoRA
adapter merged does, and the graphs are captured again. Where graphs cannot hold, scoring runs as without them,
and the reason is logged once (``reason``): not a CUDA device, weights sharded (FSDP, ZeRO-3) or split by tensor
parallelism, a device map across devices or offloaded weights, a plan not kept on the device, harness requests in
the same pass, a forward that synchronises with the host, a replay that differs from eager.

The CUDA parts are one object (``TorchGraphs``); tests on a CPU give another (``graph_factory``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import tree_mask
from .model_state import modules_of, parameters_of

logger = logging.getLogger(__name__)

# Module attributes that change what a module computes without changing its parameters' storage: PEFT's adapter
# state (merged into the base weight, disabled, which adapters are active).
ADAPTER_STATE = ("merged_adapters", "_disable_adapters", "_active_adapter", "disable_adapters", "active_adapters")


class TorchGraphs:
    """The CUDA parts: a memory pool, capture, replay, and the host-synchronisation check."""

    def supports(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def warm(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``fn()`` with host synchronisation an error: the warm-up a capture needs, and the test that it can be one.

        On the current stream: its output is used there, and the caching allocator ties memory to a stream.
        """
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Any, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a data loader's pinned memory) do not break the capture
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            output = fn()
        return graph, output

    def replay(self, graph: Any) -> None:
        graph.replay()


@dataclass
class GraphKey:
    """What a capture depends on; graphs are captured again when any part differs."""

    layout: Any  # the plan (compared by identity: a new budget makes a new one)
    methods: tuple  # the scoring method and the head's
    structure: tuple  # ``model_structure``

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, GraphKey)
            and self.layout is other.layout
            and self.methods == other.methods
            and self.structure == other.structure
        )


def model_structure(lm: torch.nn.Module) -> tuple:
    """Each module (by identity) with its hooks and adapter state, and each of its parameters' and buffers' name,
    storage (``data_ptr``), shape, dtype and device. In-place updates (an optimizer step) leave it as it is;
    replacing a tensor or a module, adding a hook or merging an adapter does not.

    Read at every evaluation with graphs, so it reads the modules' own dictionaries (a 24-layer Llama: 0.5 ms on a
    2-core VM, where ``named_parameters`` and ``getattr`` on every module took 6 to 7 ms).
    """
    structure = []
    for module in modules_of(lm):
        own = module.__dict__
        tensors = tuple(
            (name, t.data_ptr(), t.shape, t.dtype, t.device)
            for name, t in (*own["_parameters"].items(), *own["_buffers"].items())
            if t is not None
        )
        hooks = (tuple(own["_forward_hooks"]), tuple(own["_forward_pre_hooks"]))
        structure.append((id(module), tensors, hooks, _adapter_state(module)))
    return tuple(structure)


_ADAPTER_NAMES: dict[type, tuple[str, ...]] = {}  # a module class -> which ``ADAPTER_STATE`` it holds as data


def _adapter_state(module: torch.nn.Module) -> tuple | None:
    """The module's ``ADAPTER_STATE`` values, or None for a module without them (most). Found once per class: a
    missing name costs ``nn.Module.__getattr__`` an exception, and a method of that name (transformers' models have
    ``active_adapters()``) is not state: its ``str`` is the whole model's ``repr`` (3 ms for a 24-layer model)."""
    kind = type(module)
    names = _ADAPTER_NAMES.get(kind)
    if names is None:
        names = _ADAPTER_NAMES[kind] = tuple(
            name for name in ADAPTER_STATE if hasattr(kind, name) and not callable(getattr(kind, name))
        )
    if not names and module.__dict__.keys().isdisjoint(ADAPTER_STATE):
        return None
    held = [name for name in ADAPTER_STATE if name in names or name in module.__dict__]
    return tuple((name, _frozen(getattr(module, name))) for name in held)


def _frozen(value):
    if isinstance(value, (list, tuple, set)):
        return tuple(sorted(map(str, value)))
    return value if value is None or isinstance(value, (bool, int, str)) else str(value)


def placement_reason(lm: torch.nn.Module, device: torch.device, sharded: bool, tensor_parallel: bool) -> str | None:
    """Why this model's forward cannot be a graph whatever the plan, or None (``device``: where it is scored)."""
    if sharded:
        return "the weights are sharded (FSDP, ZeRO-3): each forward call gathers them"
    if tensor_parallel:
        return "the weights are split by tensor parallelism: each forward call adds up the processes' parts"
    places = {str(v) for v in (getattr(lm, "hf_device_map", None) or {}).values()}
    if places & {"cpu", "disk", "meta"}:
        return "weights offloaded by a device map (to the CPU or disk)"
    devices = {p.device for p in parameters_of(lm)}
    if len(places) > 1 or len(devices) > 1:
        return "a device map across several devices"
    if any(d.type != device.type for d in devices):
        return f"weights on {', '.join(sorted(d.type for d in devices))}, scored on {device.type}"
    return None


@dataclass
class Captured:
    graph: Any
    output: torch.Tensor  # the graph's log-probs (or the body's output): overwritten by each replay
    sentences: torch.Tensor
    slots: torch.Tensor
    kept: Any = None  # where only the body is captured: the batch it reads, for the head run after it


@dataclass(repr=False)
class CudaGraphs:
    """The scorer's graphs: ``batches`` gives what an evaluation iterates, ``logprobs`` each batch's log-probs.

    ``enabled``: ``cuda_graphs=``; ``sharded``/``tensor_parallel``/``upcast``: the scorer's model facts; ``graph_factory``: the
    CUDA parts (``TorchGraphs``). ``captures`` and ``replays`` count what was done; ``reason`` says why the latest
    evaluation ran without graphs (None when it replayed them, or before the first).
    """

    lm: torch.nn.Module
    enabled: bool = True
    sharded: bool = False
    tensor_parallel: bool = False
    upcast: bool = False  # float32 scoring of lower-precision weights: upcast a module at a time, in Python hooks
    graph_factory: Any = field(default_factory=TorchGraphs)
    captures: int = 0
    replays: int = 0
    reason: str | None = None
    body_only: str | None = None  # why only the bodies are captured (the head reads back to the host), if so
    _key: GraphKey | None = None
    _failed: GraphKey | None = None  # a key whose capture failed: not tried again until the key changes
    _graphs: dict = field(default_factory=dict)
    _pool: Any = None
    _seen: Any = None  # the plan evaluated last (its graphs are captured from its second evaluation on)
    _logged: set = field(default_factory=set)
    _kept: list = field(default_factory=list)  # tensors the graphs read that are cached outside them

    def batches(self, layout, methods: tuple, choosing: bool = False, spans=None) -> Sequence:
        """What an evaluation on ``layout`` iterates: its batches (no graphs), or one ``GraphBatch`` per batch.

        ``methods``: the scoring method and the head's; ``choosing``: the head's method is being timed (nothing is
        captured in that evaluation); ``spans``: harness requests scored in this pass (``scored_spans``), if any.
        """
        device = torch.device(layout.batches.options["device"])
        reason = self._reason(layout, device, choosing, spans is not None)
        if reason is not None:
            self._say(reason)
            self._seen = layout if choosing else self._seen  # the head's choice is the plan's first evaluation
            return layout.batches
        key = GraphKey(layout, methods, model_structure(self.lm))
        if key == self._failed:
            return layout.batches
        if key != self._key:
            if self._graphs:
                logger.info("tatblimp: the plan, the method or the model changed; CUDA graphs captured again")
            self.drop()
            self._key = key
            if self._seen is not layout:  # the plan's first evaluation: as without graphs; captured at the next
                self._seen, self.reason = layout, "first evaluation of this plan (graphs are captured at the next)"
                return layout.batches
        if self._pool is None:
            self._pool = self.graph_factory.pool()
        self.reason = None
        return GraphBatches(layout.batches, self)

    def logprobs(self, batch, scorer, head: str, spans=None) -> torch.Tensor:
        """The batch's log-probs, by ``scorer`` (the ``Scorer`` these forward calls are for: its ``_batch_logprobs``,
        and its ``_model_output`` and ``_read`` for the body and the head apart) with ``head``: eagerly for a plain
        ``Batch``; for a ``GraphBatch`` its graph replayed, captured first when it has none (the eager values kept for
        this evaluation, the replay checked against them)."""
        if not isinstance(batch, GraphBatch):
            return scorer._batch_logprobs(batch, head, spans)
        captured = self._graphs.get(batch.index)
        if captured is None and self._key is None:  # the graphs were dropped earlier in this evaluation
            return scorer._batch_logprobs(batch.build(), head, spans)
        if captured is None:
            return self._capture(batch, scorer, head)
        self.graph_factory.replay(captured.graph)
        self.replays += 1
        return captured.output if captured.kept is None else scorer._read(captured.kept, head, captured.output)

    def drop(self) -> None:
        """Let every graph and its memory go."""
        self._graphs.clear()
        self._kept.clear()
        self._key = self._pool = None

    def _capture(self, batch: GraphBatch, scorer, head: str) -> torch.Tensor:
        """Batch ``batch``'s graph captured: its whole forward call (the batch built from the plan inside it), or where
        the head reads values back to the host, the body alone (its inputs built once and kept), the head run as before."""
        key, kept = self._key, None
        fn = lambda: scorer._batch_logprobs(batch.build(), head, None)  # noqa: E731
        try:
            values = self._warm(fn)
        except RuntimeError as error:  # a host synchronisation (sync debug mode "error")
            kept = batch.build()
            fn = lambda: scorer._model_output(kept, head)  # noqa: E731
            try:
                values = self._warm(fn)
            except RuntimeError as error:
                return self._fail(key, f"the forward synchronises with the host ({_first_line(error)})", scorer, batch, head)
            self.body_only = f"the head synchronises with the host ({_first_line(error)}): the body alone is replayed"
        try:
            self._kept.extend(tree_mask._OFFSETS.values())  # read by the graph, cached outside it
            graph, output = self.graph_factory.capture(fn, self._pool)
            self.graph_factory.replay(graph)
        except torch.OutOfMemoryError:
            self.drop()
            raise
        except RuntimeError as error:
            return self._fail(key, f"capture failed ({_first_line(error)})", scorer, batch, head)
        if not _bitwise_equal(output, values):
            return self._fail(key, "a graph replay differs from the eager forward", scorer, batch, head)
        built = kept or batch.build()
        self._graphs[batch.index] = Captured(graph, output, built.score_sentences, built.score_slots, kept)
        self.captures += 1
        return values if kept is None else scorer._read(kept, head, values)

    def _warm(self, fn: Callable) -> torch.Tensor:
        try:
            return self.graph_factory.warm(fn)
        except torch.OutOfMemoryError:
            self.drop()
            raise

    def _fail(self, key, reason: str, scorer, batch, head: str) -> torch.Tensor:
        self.drop()
        self._failed = key
        self._say(reason, level=logging.WARNING)
        return scorer._batch_logprobs(batch.build(), head, None)

    def _reason(self, layout, device: torch.device, choosing: bool, same_pass: bool) -> str | None:
        if not self.enabled:
            return "cuda_graphs=False"
        if not self.graph_factory.supports(device):
            return f"not a CUDA device ({device.type})"
        placement = placement_reason(self.lm, device, self.sharded, self.tensor_parallel)
        if placement is not None:
            return placement
        if self.upcast:
            return "the weights are upcast to float32 a module at a time for each forward (precision='float32')"
        if same_pass:
            return "harness requests are scored in the same pass"
        if getattr(layout.batches, "prepared", None) is None:
            return "the plan is not kept on the device (larger than its share of the memory budget)"
        if choosing:
            return "the LM head's method is being chosen (graphs are captured at the next evaluation)"
        return None

    def _say(self, reason: str, level: int = logging.INFO) -> None:
        self.reason = reason
        if reason not in self._logged and not reason.startswith("the LM head"):
            self._logged.add(reason)
            logger.log(level, "tatblimp: scoring without CUDA graphs: %s", reason)


class GraphBatches(Sequence):
    """A plan's batches as the graphs see them: an index each, the batch built from the plan only when needed."""

    def __init__(self, batches, graphs: CudaGraphs):
        self._batches, self._graphs = batches, graphs
        self.positions = batches.positions

    def __len__(self) -> int:
        return len(self._batches)

    def __getitem__(self, index: int) -> GraphBatch:
        return GraphBatch(index, self._batches, self._graphs)

    def __iter__(self) -> Iterator[GraphBatch]:
        return (self[i] for i in range(len(self)))


class GraphBatch:
    """Batch ``index`` of a plan: its cells (``score_sentences``, ``score_slots``) without building its inputs."""

    def __init__(self, index: int, batches, graphs: CudaGraphs):
        self.index, self._batches, self._graphs = index, batches, graphs

    def build(self):
        return self._batches[self.index]

    @property
    def score_sentences(self) -> torch.Tensor:
        captured = self._graphs._graphs.get(self.index)
        return captured.sentences if captured is not None else self.build().score_sentences

    @property
    def score_slots(self) -> torch.Tensor:
        captured = self._graphs._graphs.get(self.index)
        return captured.slots if captured is not None else self.build().score_slots


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:200]
