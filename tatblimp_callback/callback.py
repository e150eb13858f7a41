"""``TatBLiMPCallback``: TatBLiMP curves while a Hugging Face Trainer trains.

    trainer = Trainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer)
    trainer.add_callback(TatBLiMPCallback(eval_steps=500, trainer=trainer))

The callback tokenizes the benchmark once, at the start of training, into tensors on the model's
device. When scoring is due it runs one fused forward pass over all sentences without gradients
and in eval mode, restores the model's mode and every random number generator, and logs
``tatblimp/acc``, ``tatblimp/acc_norm`` and ``tatblimp/<phenomenon>/{acc,acc_norm}`` at the
global step. Steps where no scoring is due do an integer comparison and nothing else.
"""

from __future__ import annotations

import logging
import os
import random
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from .curves import DEFAULT_THRESHOLD, acquisition_steps
from .data import Benchmark
from .evaluation import Evaluator
from .forced_choice import DEFAULT_PROMPT, ForcedChoiceEvaluator, ForcedChoiceResults
from .metrics import Results

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class TatBLiMPCallback(TrainerCallback):
    """Scores the model on TatBLiMP every ``eval_steps`` optimizer steps and logs per-phenomenon curves."""

    eval_steps: int = 500
    """Score every this many global (optimizer) steps."""

    data: Benchmark | str | os.PathLike | None = None
    """Benchmark JSONL path or ``Benchmark``; None: ``$TATBLIMP_DATA``, else the Hub dataset ``ilchats/TatBLiMP``."""

    tokenizer: Any = None
    """Tokenizer (or a raw ``SentencePieceTokenizer``); None: the Trainer's ``processing_class``."""

    trainer: Any = None
    """The Trainer, so results also reach every ``report_to`` backend (tensorboard, ...) through its
    callbacks. Without it they go to ``state.log_history`` and the active wandb run only."""

    eval_on_start: bool = True
    """Score before the first step, so every curve starts at the untrained baseline."""

    eval_on_end: bool = True
    """Score at the last step of training if it is not a multiple of ``eval_steps``."""

    eval_on_evaluate: bool = False
    """Also score whenever the Trainer evaluates (``on_evaluate``)."""

    raise_on_error: bool = False
    """Re-raise a scoring error and stop training. By default it is logged with its traceback,
    counted in ``failures`` (and ``tatblimp/failures``), and training goes on."""

    prefix_token_id: int | None = None
    """Token put before every sentence; None: the tokenizer's BOS, else its EOS."""

    allow_modified: bool = False
    """Accept a benchmark file that is not the official release (reported as modified)."""

    cache_path: str | os.PathLike | None = None
    """Save the tokenized benchmark here (safetensors) and reuse it on resume when data and tokenizer match."""

    memory_budget: int | None = None
    """Extra bytes one evaluation may use; None: a quarter of free GPU memory, 512 MiB on a CPU."""

    truncate: bool = False
    """Cut sentences longer than the model's context (counted) instead of failing."""

    log_prefix: str = "tatblimp"
    """Prefix of every logged key; in wandb it is the section name."""

    log_table: bool = True
    """At the end of training, log a wandb Table of the per-phenomenon results."""

    acquisition_threshold: float = DEFAULT_THRESHOLD
    """acc_norm a phenomenon must reach and keep through the last evaluation to count as acquired."""

    protocol: str = "logprob"
    """What to score: "logprob" (logP(good) > logP(bad), keys ``<prefix>/...``); "forced-choice"
    (a chat model names the grammatical one of sentences A and B, both orderings, from its
    chat template; keys ``<prefix>_fc/accuracy``, ``<prefix>_fc/both_orders``, ``<prefix>_fc/a_share``,
    per phenomenon; for supervised fine-tuning of instruction models); or "both"."""

    forced_choice_prompt: str | None = None
    """The forced-choice user message with ``{a}`` and ``{b}``; None: ``forced_choice.DEFAULT_PROMPT``."""

    history: list[dict[str, float]] = field(default_factory=list, init=False)
    """One entry per evaluation: ``step`` and the logged metrics."""

    failures: int = field(default=0, init=False)
    """Evaluations that raised (and were logged instead of raised)."""

    last_results: Results | None = field(default=None, init=False, repr=False)

    last_fc_results: ForcedChoiceResults | None = field(default=None, init=False, repr=False)
    """The latest forced-choice results (``protocol`` "forced-choice" or "both")."""

    acquisition: dict[str, int | None] = field(default_factory=dict, init=False)
    """Set at the end of training: per phenomenon, the first step from which acc_norm stayed at or
    above ``acquisition_threshold`` (None: never); also in the wandb summary as ``<prefix>/acquisition/<name>``
    (the string "never" there, since wandb drops None)."""

    def __post_init__(self):
        if self.eval_steps < 1:
            raise ValueError(f"eval_steps must be at least 1, got {self.eval_steps}")
        if self.protocol not in ("logprob", "forced-choice", "both"):
            raise ValueError(f"protocol must be 'logprob', 'forced-choice' or 'both', got {self.protocol!r}")
        self._fc_evaluator: ForcedChoiceEvaluator | None = None
        self._evaluator: Evaluator | None = None
        self._last_step: int | None = None
        self._wandb_metrics_defined = False

    # -- Trainer events -------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        tokenizer = self.tokenizer if self.tokenizer is not None else processing_class
        if tokenizer is None:
            raise ValueError("TatBLiMPCallback needs a tokenizer: pass tokenizer= or give the Trainer a processing_class")
        if self._fc_evaluator is None and self.protocol != "logprob":
            self._fc_evaluator = ForcedChoiceEvaluator(
                tokenizer,
                self.data,
                prompt=self.forced_choice_prompt or DEFAULT_PROMPT,
                allow_modified=self.allow_modified,
                memory_budget=self.memory_budget,
            )
            self._guarded(self._fc_evaluator.prepare, model)
        if self._evaluator is None and self.protocol != "forced-choice":
            self._evaluator = Evaluator(
                tokenizer,
                self.data,
                prefix_token_id=self.prefix_token_id,
                allow_modified=self.allow_modified,
                memory_budget=self.memory_budget,
                truncate=self.truncate,
                cache_path=self.cache_path,
            )
            self._guarded(self._evaluator.prepare, model)
        if self.eval_on_start:
            self._score(args, state, control, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if step % self.eval_steps == 0 or (self.eval_on_end and step >= state.max_steps):
            self._score(args, state, control, model)

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        if self.eval_on_evaluate:
            self._score(args, state, control, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.eval_on_end:
            self._score(args, state, control, model)
        if self.log_table and self.last_results is not None and state.is_world_process_zero:
            self._guarded(self._log_wandb_table, args, self.last_results)
        self.acquisition = acquisition_steps(self.history, self.acquisition_threshold, prefix=self.log_prefix)
        if self.acquisition and state.is_world_process_zero:
            self._guarded(self._log_wandb_acquisition, args)

    # -- scoring and logging --------------------------------------------------------------------

    def _score(self, args, state, control, model) -> None:
        if model is None or (self._evaluator is None and self._fc_evaluator is None) or self._last_step == state.global_step:
            return
        self._last_step = state.global_step
        rng = _rng_state()
        try:
            results = self._guarded(self._evaluator, model) if self._evaluator is not None else None
            fc_results = self._guarded(self._fc_evaluator, model) if self._fc_evaluator is not None else None
        finally:
            _set_rng_state(rng)
        if results is None:
            metrics = {}
        else:
            self.last_results = results
            metrics = results.flat_metrics(self.log_prefix)
            if results.partial:
                logger.warning(
                    "tatblimp: step %d: %d pairs have non-finite log-probs and are left out of the metrics (%s)",
                    state.global_step,
                    results.non_finite_pairs,
                    ", ".join(name for name, group in results.phenomena.items() if group.non_finite),
                )
            metrics[f"{self.log_prefix}/eval_seconds"] = results.run_info["seconds"]
        if fc_results is not None:
            self.last_fc_results = fc_results
            metrics.update(fc_results.flat_metrics(f"{self.log_prefix}_fc"))
            metrics[f"{self.log_prefix}_fc/eval_seconds"] = fc_results.run_info["seconds"]
        if self.failures:
            metrics[f"{self.log_prefix}/failures"] = float(self.failures)
        if results is not None or fc_results is not None:
            self.history.append({"step": state.global_step, **metrics})
        if state.is_world_process_zero:
            self._log(args, state, control, model, metrics)

    def _guarded(self, function, *arguments):
        """Run ``function``; unless ``raise_on_error``, log an exception and return None."""
        try:
            return function(*arguments)
        except Exception:
            if self.raise_on_error:
                raise
            self.failures += 1
            # The traceback goes in as text: a record holding exc_info would keep the failed
            # evaluation's frames, and every tensor they reference, alive in any handler that stores records.
            logger.error("tatblimp: scoring failed (failure %d); training continues\n%s", self.failures, traceback.format_exc())
            return None

    def _log(self, args, state, control, model, metrics: dict[str, float]) -> None:
        state.log_history.append({**metrics, "step": state.global_step})
        if self.trainer is not None:
            # Every reporter but wandb, which would file our keys under train/; wandb is logged below.
            for callback in self.trainer.callback_handler.callbacks:
                if callback is not self and type(callback).__name__ != "WandbCallback":
                    callback.on_log(args, state, control, model=model, logs=dict(metrics))
        self._guarded(self._log_wandb, args, state, metrics)

    def _log_wandb(self, args, state, metrics: dict[str, float]) -> None:
        run = _wandb_run(args)
        if run is None:
            return
        if not self._wandb_metrics_defined:
            run.define_metric("train/global_step")
            run.define_metric(f"{self.log_prefix}/*", step_metric="train/global_step", step_sync=True)
            run.define_metric(f"{self.log_prefix}_fc/*", step_metric="train/global_step", step_sync=True)
            self._wandb_metrics_defined = True
        run.log({**metrics, "train/global_step": state.global_step})

    def _log_wandb_table(self, args, results: Results) -> None:
        run = _wandb_run(args)
        if run is None:
            return
        import wandb

        columns = ["phenomenon", "n", "acc", "acc_norm", "mean_margin", "ties"]
        rows = [[name, g.n, g.acc, g.acc_norm, g.mean_margin, g.ties] for name, g in results.phenomena.items()]
        rows.append(["overall", results.overall.n, results.acc, results.acc_norm, results.overall.mean_margin, results.overall.ties])
        run.log({f"{self.log_prefix}/results": wandb.Table(columns=columns, data=rows)})
        run.summary[f"{self.log_prefix}/acc"] = results.acc
        run.summary[f"{self.log_prefix}/acc_norm"] = results.acc_norm

    def _log_wandb_acquisition(self, args) -> None:
        run = _wandb_run(args)
        if run is not None:
            for name, step in self.acquisition.items():
                run.summary[f"{self.log_prefix}/acquisition/{name}"] = "never" if step is None else step


def _wandb_run(args):
    """The active wandb run, when this Trainer reports to wandb."""
    if "wandb" not in (args.report_to or []) and args.report_to != "all":
        return None
    try:
        import wandb
    except ImportError:
        return None
    return wandb.run


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
