"""``TatBLiMPCallback``: TatBLiMP curves while a Hugging Face Trainer trains.

    trainer = Trainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer)
    TatBLiMPCallback.attach(trainer, eval_steps=500)

The callback tokenizes the benchmark once, at the start of training, into tensors on the model's
device. When scoring is due it runs one fused forward pass over all sentences without gradients
and in eval mode, restores the model's mode and every random number generator, and logs
``tatblimp/acc``, ``tatblimp/acc_norm`` and ``tatblimp/<phenomenon>/{acc,acc_norm}`` at the
global step. Steps where no scoring is due do an integer comparison and nothing else.

More minimal-pair suites (``suites={"blimp": "blimp/data"}``; see ``suites.py``) are tokenized into the
same cache and scored in the same forward sweep; each logs ``<name>/acc``, ``<name>/acc_norm`` and
``<name>/<phenomenon>/{acc,acc_norm}`` (its own wandb section) at the same steps, and writes its own
history file. A big suite can be scored less often: ``suite_every={"blimp": 10}`` scores BLiMP at every
10th evaluation (the first included), TatBLiMP at every one.

The run's life: on resume the history is rebuilt from the restored ``state.log_history`` (nothing is
scored twice); every Trainer evaluation also scores, and its metrics get ``eval_<prefix>/...`` keys for
``metric_for_best_model`` and ``EarlyStoppingCallback``; the final weights are scored, and the end-of-training
table logged, before the Trainer loads the best checkpoint and its reporters close (``on_train_end``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainerCallback

from ..engine.precision import training_autocast_dtype
from ..evaluation import Evaluator
from ..reading.data import Benchmark
from ..results.curves import DEFAULT_THRESHOLD
from ..results.metrics import Results
from . import callback_options, reporting
from .in_loop import HISTORY_FILE, InLoopMonitor, MonitoredResults, refuse_shared_history_file
from .suite_schedule import never_logged, unscored_placeholders

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class TatBLiMPCallback(MonitoredResults, TrainerCallback):
    """Scores the model on TatBLiMP every ``eval_steps`` optimizer steps and logs per-phenomenon curves.

    It also scores before the first step, at every Trainer evaluation and at the last step; each result
    goes, once and at its global step, to ``state.log_history``, the Trainer's reporters, the console and
    ``history_file``. The fields below are its options (all keyword arguments) and, after them, what it
    keeps (``history``, ``failures``, ``last_results``, ``acquisition``).

    Raises:
        ValueError: ``eval_steps`` is neither a whole number of at least 1 nor a fraction between 0 and 1, or
            ``protocol`` is unknown (when built); at the start of
            training, no tokenizer is given and the Trainer has no ``processing_class``, or
            ``metric_for_best_model`` is a TatBLiMP key while ``eval_on_evaluate`` is False.

    Example:
        ```python
        trainer = Trainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)
        callback = TatBLiMPCallback.attach(trainer, eval_steps=500)
        trainer.train()
        print(callback.last_results.acc_norm)
        ```
    """

    eval_steps: int | float = 500
    """Score every this many global (optimizer) steps; a float between 0 and 1 is a fraction of the run's total
    steps (rounded up), as in ``TrainingArguments.eval_steps``."""

    data: Benchmark | str | os.PathLike | None = None
    """Benchmark JSONL path or ``Benchmark``; None: ``$TATBLIMP_DATA``, else the Hub dataset ``ilchats/TatBLiMP``."""

    tokenizer: Any = None
    """Tokenizer (or a raw ``SentencePieceTokenizer``); None: the Trainer's ``processing_class``."""

    trainer: Any = field(default=None, repr=False)
    """The Trainer (set by ``attach``), so results also reach every ``report_to`` reporter (tensorboard,
    mlflow, ...) and the Trainer's other callbacks. Without it they go to ``state.log_history``, the
    active wandb run, the console and ``history_file`` only (a warning at the start names what is missed)."""

    eval_on_start: bool = True
    """Score before the first step, so every curve starts at the untrained baseline."""

    eval_on_end: bool = True
    """Score at the last step of training if it is not a multiple of ``eval_steps``."""

    eval_on_evaluate: bool = True
    """Also score whenever the Trainer evaluates (``eval_strategy``, ``trainer.evaluate()``) and add the
    results to that evaluation's metrics as ``eval_<prefix>/...``, so that ``metric_for_best_model=
    "tatblimp/acc_norm"`` (or any logged key, ``"tatblimp/binding/acc_norm"``) and ``EarlyStoppingCallback``
    work on TatBLiMP."""

    raise_on_error: bool = False
    """Re-raise a scoring error and stop training. By default it is logged with its traceback,
    counted in ``failures`` (and ``tatblimp/failures``), and training goes on."""

    prefix_token_id: int | None = None
    """Token put before every sentence; None: the tokenizer's BOS, else its EOS."""

    allow_modified: bool = False
    """Accept a benchmark file that is not the official release (reported as modified)."""

    cache_path: str | os.PathLike | None = None
    """Save the tokenized benchmark here (safetensors) and reuse it on resume when data and tokenizer match;
    relative to ``output_dir``, like ``history_file``."""

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
    """What scoring computes in: "auto" (the precision training computes in: bf16 under ``bf16=True``, fp16 under
    ``fp16=True``, else the weights' dtype), "float32", "bfloat16" or "float16"; recorded with every result."""

    exact_decisions: bool = True
    """Below float32, score the pairs whose margin is within rounding again in float32, so that every decision (and
    so every curve point) is float32's; the rescored pairs are recorded (``exact_decisions`` in the history line)."""

    log_prefix: str = "tatblimp"
    """Prefix of every logged key; in wandb it is the section name."""

    log_table: bool = True
    """At the end of training, log a wandb Table of the per-phenomenon results."""

    history_file: str | os.PathLike | None = HISTORY_FILE
    """Write each evaluation as a JSON line here (relative to ``output_dir``; main process only), the
    record of a ``tatblimp sweep`` line without "checkpoint": ``tatblimp compare`` reads it. ``{log_prefix}`` in it
    is the ``log_prefix``: the default is ``tatblimp_history.jsonl``, and another file for a callback of another
    prefix. Two callbacks of the Trainer the callback knows (``attach``, ``trainer=``) that would write one file are
    refused when training starts. None: no file."""

    report_file: str | os.PathLike | None = None
    """At the end of training, write this run's HTML report (``tatblimp report`` of ``history_file``) here,
    relative to ``output_dir`` (main process only), and log it to wandb as an HTML panel, ``<prefix>/report``.
    Needs ``history_file``. None (default): no report."""

    acquisition_threshold: float = DEFAULT_THRESHOLD
    """acc_norm a phenomenon must reach and keep through the last evaluation to count as acquired."""

    protocol: str = "logprob"
    """What to score: "logprob" (logP(good) > logP(bad), keys ``<prefix>/...``); "forced-choice"
    (a chat model names the grammatical one of sentences A and B, both orderings, from its
    chat template; keys ``<prefix>_fc/accuracy``, ``<prefix>_fc/both_orders``, ``<prefix>_fc/a_share``,
    per phenomenon; for supervised fine-tuning of instruction models); or "both"."""

    forced_choice_prompt: str | None = None
    """The forced-choice user message with ``{a}`` and ``{b}``; None: ``forced_choice.DEFAULT_PROMPT``."""

    suites: dict[str, Any] | None = None
    """More suites to score in the same pass as TatBLiMP, ``{name: path or suites.Suite}``: a BLiMP, TurBLiMP or
    MultiBLiMP folder or file, or your own (see ``suites.load_suite``), e.g. to see English grammar hold while
    a model learns Tatar. Each logs ``<name>/acc``, ``<name>/acc_norm``, ``<name>/<phenomenon>/{acc,acc_norm}``
    and writes ``<history_file stem>.<name>.jsonl``; ``last_results.suites[name]`` holds its results."""

    suite_every: int | dict[str, int] = 1
    """Score the suites at every k-th evaluation only (counting from the first, which scores them): one number
    for all, or ``{name: k}`` (a missing name: every evaluation). TatBLiMP is scored at every evaluation;
    ``suite_every={"blimp": 10}`` keeps a 67,000-pair BLiMP from making every evaluation 54 times longer."""

    lm_eval_tasks: list[str] | None = None
    """lm-evaluation-harness tasks (or groups) to score at each evaluation, on the training model (no second copy):
    ``["blimp", "my_mc_task"]``. Their requests are built and encoded once and scored in TatBLiMP's fused pass (sharded
    over processes with it); the harness's own ``evaluate`` turns them into its metrics (``process_results``, filters,
    aggregation), logged as ``lm_eval/<task>/<metric>``: the numbers ``lm_eval --model hf`` prints for that checkpoint.
    Needs ``pip install lm-eval``."""

    lm_eval_include_path: str | list[str] | None = None
    """Folders of your own harness task YAML files, for ``lm_eval_tasks`` (the TatBLiMP tasks are always included)."""

    lm_eval_limit: int | None = None
    """Score only the first N documents of each harness task (the harness's ``--limit``: a partial run)."""

    alert_on_regression: bool = True
    """After each evaluation, compare every phenomenon and overall score (TatBLiMP's and each suite's) with its best
    earlier evaluation pair by pair, and raise an alert for a significant fall (see ``alerts.py``): a warning line,
    ``<prefix>/alerts``, ``alerts`` in the history file and ``wandb.run.alert`` where a wandb run is active."""

    alert_q: float = 0.05
    """The false-alarm rate of the alerts. With ``alert_mode="pooled"`` or ``"per_run"``: the chance that a run which
    never regresses raises any alert, over the whole run; with ``"per_evaluation"``: the q-value (Benjamini-Hochberg)
    an alert needs at each evaluation (see ``regressions.py``)."""

    alert_mode: str = "pooled"
    """``"pooled"`` (a false-alarm budget for the whole run, however many evaluations; the last 1, 2 and 3
    evaluations against each of the 4 windows of as many before them, and the best earlier one), ``"per_run"``
    (the same budget, the previous and the best evaluations only) or ``"per_evaluation"`` (``alert_q`` at each
    evaluation, so the chances add up over a long run); see the long-runs guide."""

    alert_min_drop: float = 0.05
    """An alert needs a fall of at least this much acc_norm (0.05: 5 points) from the best earlier evaluation."""

    alert_evaluations: int | None = None
    """The run's planned number of evaluations, over which the alerts spread ``alert_q`` (``"pooled"``,
    ``"per_run"``); None: counted from the Trainer's ``max_steps`` and the schedule (``eval_on_start``, every
    ``eval_steps``, the Trainer's own evaluations at ``eval_strategy="steps"``, ``eval_on_end``). Evaluations beyond
    the plan spend a reserve, so the guarantee holds either way (see the long-runs guide)."""

    def __post_init__(self):
        self._every = callback_options.check_options(self)
        self._monitor = InLoopMonitor(self)
        self._wandb = reporting.WandbSection(list(self._monitor.prefixes()))
        self._warned_unreachable = False
        self._warned_unknown_metric = False  # metric_for_best_model names a key never logged: said once
        self._started = False  # on_train_begin ran, or an evaluation before train() did its part
        self._start_run([])

    # -- what it keeps (history, failures, last_results, ...: MonitoredResults) --------------------

    @property
    def _evaluator(self) -> Evaluator | None:
        return self._monitor.evaluator

    @classmethod
    def attach(cls, trainer, **options) -> TatBLiMPCallback:
        """Build the callback with ``options``, add it to ``trainer`` and return it; the one call that lets the
        results reach all of the Trainer's reporters (``report_to``).

        Args:
            trainer: the ``transformers.Trainer`` to score during ``trainer.train()``.
            **options: the callback's fields (``eval_steps``, ``data``, ``cache_path``, ...).

        Returns:
            The callback, already in ``trainer``'s callbacks.

        Raises:
            TypeError: an option the callback does not have.
            ValueError: an option's value is invalid (see the class).

        Example:
            ```python
            callback = TatBLiMPCallback.attach(trainer, eval_steps=500, cache_path="tatblimp_cache.safetensors")
            ```
        """
        callback = cls(trainer=trainer, **options)
        trainer.add_callback(callback)
        return callback

    # -- Trainer events -------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        self._start_run(state.log_history)
        self._begin(args, state, model, processing_class, history_file=True)
        if self.eval_on_start and state.global_step == 0:  # a resumed run has its earlier points already
            self._score(args, state, control, model)

    def _begin(self, args, state, model, processing_class, history_file: bool) -> None:
        """Find the Trainer, check the settings, open the history file (``history_file``), build the evaluators."""
        self._started = True
        self._trainer = reporting.running_trainer(self.trainer, state)
        if not self.eval_on_evaluate and self._monitor.is_our_metric(getattr(args, "metric_for_best_model", None)):
            raise ValueError(
                f"metric_for_best_model={args.metric_for_best_model!r} needs TatBLiMPCallback(eval_on_evaluate=True)"
            )
        if history_file and self._trainer is not None:  # the other callbacks are known through the Trainer only
            refuse_shared_history_file(self._monitor, self._trainer.callback_handler.callbacks, getattr(args, "output_dir", None))
        if state.is_world_process_zero and history_file:
            self._monitor.open_history_files(getattr(args, "output_dir", None))
        if state.is_world_process_zero:
            missed = reporting.unreachable_reporters(args, self._trainer)
            if missed and not self._warned_unreachable:
                self._warned_unreachable = True
                logger.warning(
                    "tatblimp: the results will not reach %s (report_to): the callback does not know the Trainer. "
                    "Add it with TatBLiMPCallback.attach(trainer, ...) instead of callbacks=[...]",
                    ", ".join(missed),
                )
        self._every = callback_options.steps_between(self.eval_steps, state.max_steps)
        self._monitor.alerts.plan = self.alert_evaluations or self._planned_evaluations(args, state.max_steps)
        tokenizer = self.tokenizer if self.tokenizer is not None else processing_class
        if tokenizer is None:
            raise ValueError("TatBLiMPCallback needs a tokenizer: pass tokenizer= or give the Trainer a processing_class")
        self._monitor.prepare(tokenizer, model, getattr(args, "output_dir", None), training_autocast_dtype(model, args))

    def _planned_evaluations(self, args, max_steps) -> int | None:
        """The evaluations this run is scheduled to score (``callback_options.planned_evaluations``)."""
        trainer_every = None
        if self.eval_on_evaluate and getattr(args, "eval_strategy", "no") == "steps" and getattr(args, "eval_steps", None):
            trainer_every = callback_options.steps_between(args.eval_steps, max_steps)
        start = self.eval_on_start or (self.eval_on_evaluate and bool(getattr(args, "eval_on_start", False)))
        return callback_options.planned_evaluations(max_steps, self._every, start, self.eval_on_end, trainer_every)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if step % self._every == 0 or (self.eval_on_end and step >= state.max_steps):
            self._score(args, state, control, model)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        # Trainer.evaluate() logs its metrics, then hands the same dict to every on_evaluate (EarlyStoppingCallback)
        # and to the best-model selection: keys added here reach all of them, whatever the callbacks' order.
        if not self.eval_on_evaluate or not logs or not reporting.is_evaluation_log(logs):
            return
        if not self._started:  # trainer.evaluate() before train(): a zero-shot baseline, an evaluation-only script
            self._start_run(state.log_history)
            self._begin(args, state, model, kwargs.get("processing_class"), history_file=False)
        # Trainer.log appended a copy of ``logs`` to log_history (trainer_state.json, the model card) before on_log.
        copy = reporting.logged_copy(state.log_history, logs)
        metrics = self._score(args, state, control, model)
        added = {f"eval_{key}": value for key, value in metrics.items()}
        wanted = getattr(args, "metric_for_best_model", None)
        if self._monitor.is_our_metric(wanted) and not wanted.startswith("eval_"):
            wanted = f"eval_{wanted}"
        if self._monitor.is_our_metric(wanted):
            if never_logged(wanted, added) and not self._warned_unknown_metric:
                self._warned_unknown_metric = True
                logger.warning(
                    "tatblimp: metric_for_best_model=%r is not a key the callback logs (it logs %s, ...); it is NaN at "
                    "every evaluation and no checkpoint is chosen by it",
                    args.metric_for_best_model,
                    ", ".join(sorted(k.removeprefix("eval_") for k in added if k.startswith(wanted.split("/")[0]))[:4]),
                )
            added.update(unscored_placeholders([wanted], added))
        logs.update(added)
        if copy is not None:
            copy.update(added)

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        # The last event before the Trainer loads the best checkpoint and its reporters close
        # (on_train_end), also when training stops early (EarlyStoppingCallback, in on_evaluate).
        if control.should_training_stop or state.global_step >= state.max_steps:
            if self.eval_on_end:
                self._score(args, state, control, model)
            self._finish(args, state)

    def on_train_end(self, args, state, control, **kwargs):
        if not self._finished:  # no epoch ran (resumed from the last checkpoint): nothing new is scored here
            self._finish(args, state)

    # -- per run --------------------------------------------------------------------------------

    def _start_run(self, log_history: list[dict[str, Any]]) -> None:
        """Per-run state, rebuilt from the restored ``log_history`` on resume (empty for a new run)."""
        self._monitor.start_run(log_history)
        self._finished = False
        self._trainer = None
        self._wandb.reset()

    def _finish(self, args, state) -> None:
        """The end of training: acquisition steps, and the wandb table and summary."""
        self._finished = True
        self._monitor.finish(state.is_world_process_zero)
        guarded, history_file = self._monitor.guarded, self._monitor.history_file
        wandb = state.is_world_process_zero and reporting.reports_to_wandb(args, self._trainer)
        if wandb and self.log_table and self.last_results is not None:
            guarded(self._wandb.log_results, self.log_prefix, self.last_results, self.acquisition, self.learning)
            for name, results in self.last_suite_results.items():
                guarded(self._wandb.log_results, name, results, {})
        if self.report_file is not None and history_file is not None and history_file.path.exists():
            output = callback_options.under_output_dir(self.report_file, args.output_dir)
            guarded(
                reporting.report_at_end_of_training,
                history_file.path,
                output,
                f"{self.log_prefix}/report" if wandb else None,
                self.acquisition_threshold,
            )

    # -- scoring and logging --------------------------------------------------------------------

    def _score(self, args, state, control, model) -> dict[str, float]:
        """Score the model's weights now and log a new point at this global step (see ``InLoopMonitor.score``)."""

        def publish(step: int, metrics: dict[str, float], results: Results | None) -> None:
            self._log(args, state, control, metrics, results)

        return self._monitor.score(model, state.global_step, publish, main=state.is_world_process_zero)

    def _log(self, args, state, control, metrics: dict[str, float], results: Results | None) -> None:
        """One evaluation, once, to every destination (see ``reporting``): the one place after each evaluation."""
        step, guarded = state.global_step, self._monitor.guarded
        state.log_history.append({**metrics, "step": step})
        if self._trainer is not None:
            guarded(reporting.log_to_trainer_callbacks, self._trainer, self, args, state, control, metrics)
        if reporting.reports_to_wandb(args, self._trainer):
            guarded(self._wandb.log, metrics, step)
        self._monitor.write_history(step, results, metrics)
        self._monitor.console(step, metrics, results)
