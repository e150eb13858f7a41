"""``TatBLiMPLightningCallback``: TatBLiMP curves while a PyTorch Lightning ``Trainer`` trains.

    trainer = lightning.Trainer(max_steps=10_000, callbacks=[TatBLiMPLightningCallback(tokenizer=tok, eval_every_n_steps=500)])

It scores the transformers model inside the ``LightningModule`` at global step 0 (before the first
optimizer step), every ``eval_every_n_steps`` and at the last step, and logs ``tatblimp/...`` (and each
suite's keys) once per evaluation, at that global step, to every logger of the Trainer (CSV,
TensorBoard, wandb, ...) and to ``trainer.callback_metrics``, where ``ModelCheckpoint`` and
``EarlyStopping`` read a monitored key (``monitor="tatblimp/acc_norm", mode="max"``; see
``lightning_monitoring.py``). The scoring itself, the history file, failures and resume are
``in_loop.InLoopMonitor``'s, as in the Hugging Face callback. Needs ``lightning`` (``pip install
tatblimp-callback[lightning]``); import it from ``tatblimp_callback.lightning``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback

from ..engine.model_checks import unwrap_model
from ..engine.precision import mixed_precision_dtype
from ..reading.data import Benchmark
from ..results.curves import DEFAULT_THRESHOLD
from ..results.metrics import Results
from . import callback_options
from .in_loop import HISTORY_FILE, InLoopMonitor, MonitoredResults, refuse_shared_history_file
from .lightning_monitoring import UnscoredChecks, expose, warn_about_monitors

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class TatBLiMPLightningCallback(MonitoredResults, Callback):
    """Scores the LightningModule's language model on TatBLiMP every ``eval_every_n_steps`` global steps.

    Every process calls the scorer under DDP (each scores a share, all get the same results); the global
    rank 0 logs. The model's train mode and every random generator are as they were after each evaluation.
    Its state (the points logged so far) is saved in Lightning checkpoints, so a run resumed with
    ``trainer.fit(..., ckpt_path=...)`` continues the same curve and history file.

    Each evaluation's metrics are also put in ``trainer.callback_metrics`` (on every rank), before
    ``ModelCheckpoint`` (which Lightning always runs after the other callbacks) and ``EarlyStopping`` (which
    checks at the end of an epoch or a validation run) read them, so either can monitor ``tatblimp/acc_norm``
    or any logged key, whatever the order of the callbacks. Between evaluations the keys keep the last
    evaluation's values (a resumed run starts with its checkpoint's last values); a key that an evaluation did not
    score (a suite ``suite_every`` skips, a failed evaluation) is NaN from it on, never another step's score.
    Two callbacks in one Trainer need other ``log_prefix``es (each has its ``state_key``, and its default
    ``history_file`` is named for it); two that would write one history file are refused when training starts.

    Raises:
        ValueError: ``eval_every_n_steps`` is not a whole number of at least 1, or ``protocol`` is unknown
            (when built); at the start of training, no tokenizer is given and the module has no ``tokenizer``,
            or no transformers model can be found in the module (see ``model``).

    Example:
        ```python
        callback = TatBLiMPLightningCallback(tokenizer=tokenizer, data="test.jsonl", eval_every_n_steps=500)
        trainer = lightning.Trainer(max_steps=5000, callbacks=[callback], logger=CSVLogger("logs"))
        trainer.fit(module, train_loader)
        print(callback.last_results.acc_norm)
        ```
    """

    eval_every_n_steps: int = 500
    """Score every this many global (optimizer) steps."""

    data: Benchmark | str | os.PathLike | None = None
    """Benchmark JSONL path or ``Benchmark``; None: ``$TATBLIMP_DATA``, else the Hub dataset ``ilchats/TatBLiMP``."""

    tokenizer: Any = None
    """Tokenizer (or a raw ``SentencePieceTokenizer``); None: the module's ``tokenizer`` attribute."""

    model: str | torch.nn.Module | None = None
    """The model to score: an attribute name of the LightningModule (dots for nested ones) or the module itself;
    None: the module's ``model`` attribute, else its one ``PreTrainedModel`` submodule."""

    eval_on_start: bool = True
    """Score before the first step (global step 0), so every curve starts at the untrained baseline."""

    eval_on_end: bool = True
    """Score the last step if it is not a multiple of ``eval_every_n_steps``: at the end of its batch when it is
    ``max_steps`` or the last batch of the last epoch (before the epoch-end checks), else when training ends."""

    raise_on_error: bool = False
    """Re-raise a scoring error and stop training. By default it is logged with its traceback,
    counted in ``failures`` (and ``tatblimp/failures``), and training goes on."""

    prefix_token_id: int | None = None
    """Token put before every sentence; None: the tokenizer's BOS, else its EOS."""

    allow_modified: bool = False
    """Accept a benchmark file that is not the official release (reported as modified)."""

    cache_path: str | os.PathLike | None = None
    """Save the tokenized benchmark here (safetensors) and reuse it when data and tokenizer match; relative to
    the Trainer's ``default_root_dir``."""

    memory_budget: int | None = None
    """Extra bytes one evaluation may use; None: a quarter of free GPU memory, 512 MiB on a CPU."""

    truncate: bool = False
    """Cut sentences longer than the model's context (counted) instead of failing."""

    head_method: str | None = None
    """How the LM head gives log-probs, "tiles" or "chunks:N"; None: timed at the first evaluation (the fastest exact one)."""

    row_length: int | None = None
    """Positions per row of the log-prob protocol's forward calls; None: the engine's default (256)."""

    cuda_graphs: bool = True
    """On a CUDA device, replay the plan's forward calls as CUDA graphs from the evaluation after the method check on
    (the same numbers, bit for bit, without launching each kernel from Python); where they cannot hold (FSDP, ZeRO-3,
    a device map across devices, offloaded weights) scoring runs as without them, the reason logged once. False: never."""

    compile: bool = False
    """``torch.compile`` the scoring forward for the plan's fixed shapes (not the model training runs): about a minute
    to compile on a GPU, so for long runs only (see the long-runs guide)."""

    precision: str = "auto"
    """What scoring computes in: "auto" (the Trainer's: bf16 under ``precision="bf16-mixed"``, fp16 under
    ``"16-mixed"``, else the weights' dtype), "float32", "bfloat16" or "float16"; recorded with every result."""

    exact_decisions: bool = True
    """Below float32, decide the pairs within rounding by a float32 rescoring, as ``TatBLiMPCallback.exact_decisions``."""

    log_prefix: str = "tatblimp"
    """Prefix of every logged key."""

    history_file: str | os.PathLike | None = HISTORY_FILE
    """Write each evaluation as a JSON line here (relative to the Trainer's ``default_root_dir``; rank 0 only),
    read by ``tatblimp compare`` and ``tatblimp report``; ``{log_prefix}`` in it is the ``log_prefix``, so the
    default is ``tatblimp_history.jsonl``, and another file for a callback of another prefix. Two callbacks of one
    Trainer that would write one file are refused when training starts. None: no file."""

    acquisition_threshold: float = DEFAULT_THRESHOLD
    """acc_norm a phenomenon must reach and keep through the last evaluation to count as acquired."""

    protocol: str = "logprob"
    """"logprob", "forced-choice" or "both", as ``TatBLiMPCallback.protocol``."""

    forced_choice_prompt: str | None = None
    """The forced-choice user message with ``{a}`` and ``{b}``; None: ``forced_choice.DEFAULT_PROMPT``."""

    suites: dict[str, Any] | None = None
    """More suites to score in the same pass, ``{name: path or suites.Suite}``, as ``TatBLiMPCallback.suites``."""

    suite_every: int | dict[str, int] = 1
    """Score the suites at every k-th evaluation only, as ``TatBLiMPCallback.suite_every``."""

    lm_eval_tasks: list[str] | None = None
    """lm-evaluation-harness tasks to score at each evaluation, as ``TatBLiMPCallback.lm_eval_tasks``."""

    lm_eval_include_path: str | list[str] | None = None
    """Folders of your own harness task YAML files, as ``TatBLiMPCallback.lm_eval_include_path``."""

    lm_eval_limit: int | None = None
    """The first N documents of each harness task only, as ``TatBLiMPCallback.lm_eval_limit``."""

    alert_on_regression: bool = True
    """Regression alerts after each evaluation, as ``TatBLiMPCallback.alert_on_regression``."""

    alert_q: float = 0.05
    """The false-alarm rate of the alerts, as ``TatBLiMPCallback.alert_q``."""

    alert_min_drop: float = 0.05
    """The fall in acc_norm an alert needs, as ``TatBLiMPCallback.alert_min_drop``."""

    alert_mode: str = "pooled"
    """``"pooled"``, ``"per_run"`` or ``"per_evaluation"``, as ``TatBLiMPCallback.alert_mode``."""

    alert_evaluations: int | None = None
    """The run's planned number of evaluations, as ``TatBLiMPCallback.alert_evaluations``; None: counted from the
    Trainer's ``max_steps``, else its ``estimated_stepping_batches``, where finite."""

    def __post_init__(self):
        every = self.eval_every_n_steps
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"eval_every_n_steps must be a whole number of at least 1, got {every!r}")
        callback_options.check_shared_options(self)
        self._monitor = InLoopMonitor(self)
        self._restored: list[dict[str, Any]] | None = None
        self._checked_step: int | None = None

    # -- Lightning events -----------------------------------------------------------------------

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint, built from ``log_prefix`` (as ``ModelCheckpoint``'s from
        its settings): two callbacks with other prefixes coexist in one Trainer, and each restores its own points."""
        return self._generate_state_key(log_prefix=self.log_prefix)

    def state_dict(self) -> dict[str, Any]:
        return {"entries": [dict(entry) for entry in self._monitor.points]}  # the same on every rank

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = list(state_dict.get("entries", []))

    def on_train_start(self, trainer, pl_module) -> None:
        entries, self._restored = self._restored, None
        if entries is None and trainer.global_step > 0:  # fit() again on the same Trainer: its steps and curve go on
            entries = [point for point in self._monitor.points if point["step"] <= trainer.global_step]
        entries = entries or []
        self._monitor.start_run(entries)
        self._monitor.alerts.plan = self.alert_evaluations or callback_options.planned_evaluations(
            _planned_steps(trainer), self.eval_every_n_steps, self.eval_on_start, self.eval_on_end
        )
        self._unscored_checks = UnscoredChecks()  # EarlyStopping counts an evaluation that failed as no improvement
        for entry in entries:  # a resumed run's monitored keys hold its last values from the start
            metrics = {k: v for k, v in entry.items() if k != "step"}
            expose(trainer, metrics, self._monitor.is_our_metric, entry["step"], self._unscored_checks)
        warn_about_monitors(trainer, self)
        self._checked_step = trainer.global_step  # the start is scored below (eval_on_start) or not at all
        refuse_shared_history_file(self._monitor, trainer.callbacks, trainer.default_root_dir)  # on every rank alike
        if trainer.is_global_zero:
            self._monitor.open_history_files(trainer.default_root_dir)
        tokenizer = self.tokenizer if self.tokenizer is not None else getattr(pl_module, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("TatBLiMPLightningCallback needs a tokenizer: pass tokenizer= or give the module a tokenizer")
        autocast = mixed_precision_dtype(getattr(trainer, "precision", None))
        self._monitor.prepare(tokenizer, self._find_model(pl_module), trainer.default_root_dir, autocast)
        if self.eval_on_start and trainer.global_step == 0:  # a resumed run has its earlier points already
            self._score(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        # Several batches end at one global step under gradient accumulation: the first one decides.
        # The last step is scored here rather than at on_train_end: before the epoch-end monitors read it.
        if step != self._checked_step and (step % self.eval_every_n_steps == 0 or (self.eval_on_end and _ends_training(trainer))):
            self._score(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        # Before the loggers are finalized; the monitor scores nothing twice for the same weights and step.
        if self.eval_on_end and trainer.global_step != self._checked_step:
            self._score(trainer, pl_module)
        self._put_back_checks()
        self._monitor.finish(trainer.is_global_zero)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._put_back_checks()

    def _put_back_checks(self) -> None:
        """Each ``EarlyStopping``'s ``check_finite`` as the user set it, once training ends or stops on an error."""
        checks = getattr(self, "_unscored_checks", None)
        if checks is not None:
            checks.put_back()

    # -- scoring and logging --------------------------------------------------------------------

    def _find_model(self, pl_module) -> torch.nn.Module:
        """The model to score (``model``): named, else the ``model`` attribute, else the one PreTrainedModel."""
        from transformers import PreTrainedModel

        if isinstance(self.model, torch.nn.Module):
            return self.model
        if isinstance(self.model, str):
            found = pl_module
            for part in self.model.split("."):
                found = getattr(found, part, None)
            if not isinstance(found, torch.nn.Module):
                raise ValueError(
                    f"TatBLiMPLightningCallback(model={self.model!r}): {type(pl_module).__name__} has no such module"
                )
            return found
        if isinstance(getattr(pl_module, "model", None), torch.nn.Module):
            return pl_module.model
        found = [m for m in pl_module.modules() if isinstance(m, PreTrainedModel)]
        outermost = [m for m in found if not any(m is not o and any(m is c for c in o.modules()) for o in found)]
        if len(outermost) != 1:
            what = "no transformers PreTrainedModel" if not outermost else f"{len(outermost)} PreTrainedModels"
            raise ValueError(
                f"TatBLiMPLightningCallback cannot tell which model to score: {type(pl_module).__name__} holds {what} "
                "and no `model` attribute; pass model='attribute name' (or the module itself)"
            )
        return outermost[0]

    def _score(self, trainer, pl_module) -> dict[str, float]:
        """Score the model's weights now (every rank) and log a new point at this global step (rank 0)."""
        self._checked_step = trainer.global_step
        model = unwrap_model(self._find_model(pl_module))

        def publish(step: int, metrics: dict[str, float], results: Results | None) -> None:
            self._log(trainer, step, metrics, results)

        with _root_unsharded(pl_module, model):
            metrics = self._monitor.score(model, trainer.global_step, publish, main=trainer.is_global_zero)
        # every rank: each one's ModelCheckpoint / EarlyStopping reads its own
        expose(trainer, metrics, self._monitor.is_our_metric, trainer.global_step, self._unscored_checks)
        return metrics

    def _log(self, trainer, step: int, metrics: dict[str, float], results: Results | None) -> None:
        """One evaluation, once, to every logger of the Trainer, the history file and the console."""
        for each in trainer.loggers:
            self._monitor.guarded(each.log_metrics, dict(metrics), step)
        self._monitor.write_history(step, results, metrics)
        self._monitor.console(step, metrics, results)


@contextlib.contextmanager
def _root_unsharded(pl_module, model: torch.nn.Module) -> Iterator[None]:
    """The root unit's parameters gathered while ``model`` is scored, when the LightningModule itself is the
    FSDP2 root (``fully_shard(self)`` in ``configure_model``) and ``model`` is inside it.

    The parameters of the root unit (those outside every inner ``fully_shard``: embeddings, final norm, head)
    are gathered by the root's own forward only, which scoring ``model`` never calls. ``unshard`` is an
    all-gather: every rank runs it, as every rank scores; the inner units gather their own, in lockstep.
    """
    if not torch.distributed.is_available():
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    if model is pl_module or not isinstance(pl_module, FSDPModule):
        yield
        return
    # FSDP2 takes the first module whose forward runs for the root: at step 0 that would be the first inner
    # layer, and training's own forward through the module would fail. Make the module the root first (a
    # private call: FSDP2 has no public one; a no-op once its forward has run).
    pl_module._get_fsdp_state()._lazy_init()
    pl_module.unshard()
    try:
        yield
    finally:
        pl_module.reshard()


def _planned_steps(trainer):
    """The run's global steps: ``max_steps``, else ``estimated_stepping_batches`` (inf or unknown: None)."""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return trainer.max_steps
    try:
        return trainer.estimated_stepping_batches
    except Exception:  # no dataloader length to estimate from (an iterable dataset): not known
        return None


def _ends_training(trainer) -> bool:
    """This batch's step is the run's last: ``max_steps`` reached, or the last batch of the last epoch."""
    if 0 < trainer.max_steps <= trainer.global_step:
        return True
    progress = getattr(trainer.fit_loop.epoch_loop, "batch_progress", None)  # what ModelCheckpoint reads too
    last_epoch = trainer.max_epochs is not None and 0 < trainer.max_epochs <= trainer.current_epoch + 1
    return last_epoch and bool(getattr(progress, "is_last_batch", False))
