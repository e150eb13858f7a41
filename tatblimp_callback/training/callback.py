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

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainerCallback

from ..chat.forced_choice import DEFAULT_PROMPT, ForcedChoiceEvaluator, ForcedChoiceResults
from ..engine import distributed
from ..engine.model_checks import unwrap_model, weights_label
from ..evaluation import Evaluator
from ..reading.data import Benchmark
from ..results.curves import DEFAULT_THRESHOLD, acquisition_steps
from ..results.learning import LearningSummary
from ..results.metrics import Results
from . import callback_options, reporting
from .alerts import RegressionAlerts
from .monitoring_errors import ErrorLog, rng_preserved
from .suite_schedule import check_suite_options, suite_history_files, suites_due

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class TatBLiMPCallback(TrainerCallback):
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

    log_prefix: str = "tatblimp"
    """Prefix of every logged key; in wandb it is the section name."""

    log_table: bool = True
    """At the end of training, log a wandb Table of the per-phenomenon results."""

    history_file: str | os.PathLike | None = "tatblimp_history.jsonl"
    """Write each evaluation as a JSON line here (relative to ``output_dir``; main process only), the
    record of a ``tatblimp sweep`` line without "checkpoint": ``tatblimp compare`` reads it. None: no file."""

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

    alert_on_regression: bool = True
    """After each evaluation, compare every phenomenon and overall score (TatBLiMP's and each suite's) with its best
    earlier evaluation pair by pair, and raise an alert for a significant fall (see ``alerts.py``): a warning line,
    ``<prefix>/alerts``, ``alerts`` in the history file and ``wandb.run.alert`` where a wandb run is active."""

    alert_q: float = 0.05
    """An alert needs a q-value below this: the McNemar p-value, corrected for the choice of the best earlier
    evaluation and Benjamini-Hochberg adjusted (see ``regressions.py``)."""

    alert_min_drop: float = 0.05
    """An alert needs a fall of at least this much acc_norm (0.05: 5 points) from the best earlier evaluation."""

    history: list[dict[str, float]] = field(default_factory=list, init=False)
    """One entry per evaluation: ``step`` and the logged metrics."""

    failures: int = field(default=0, init=False)
    """Evaluations that raised (and were logged instead of raised)."""

    last_results: Results | None = field(default=None, init=False, repr=False)
    """The latest log-prob results (None before the first evaluation)."""

    last_fc_results: ForcedChoiceResults | None = field(default=None, init=False, repr=False)
    """The latest forced-choice results (``protocol`` "forced-choice" or "both")."""

    acquisition: dict[str, int | None] = field(default_factory=dict, init=False)
    """Set when training ends: per phenomenon, the first step from which acc_norm stayed at or
    above ``acquisition_threshold`` (None: never); also in the wandb summary as ``<prefix>/acquisition/<name>``
    (the string "never" there, since wandb drops None)."""

    learning: LearningSummary | None = field(default=None, init=False, repr=False)
    """Set when training ends: per phenomenon, the fitted acquisition step with its 95% interval and the latest
    trend (rising, flat, falling); see ``learning.py``. Also in the end-of-training wandb table."""

    def __post_init__(self):
        self._every = callback_options.check_eval_steps(self.eval_steps)
        if self.protocol not in ("logprob", "forced-choice", "both"):
            raise ValueError(f"protocol must be 'logprob', 'forced-choice' or 'both', got {self.protocol!r}")
        if self.report_file is not None and self.history_file is None:
            raise ValueError("report_file is drawn from the history file: it needs history_file (not None)")
        self._fc_evaluator: ForcedChoiceEvaluator | None = None
        self._evaluator: Evaluator | None = None
        self._prepared_for: tuple[Any, Any] | None = None  # (tokenizer, data) the evaluators were built for
        check_suite_options(self.suites, self.suite_every, self.log_prefix, self.protocol)
        self._wandb = reporting.WandbSection([self.log_prefix, f"{self.log_prefix}_fc", *(self.suites or {})])
        self._suite_history_files: dict[str, reporting.HistoryFile] = {}
        self.last_suite_results: dict[str, Results] = {}
        self._warned_unreachable = False
        self._started = False  # on_train_begin ran, or an evaluation before train() did its part
        self._errors = ErrorLog()
        self._start_run([])

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
        self._trainer = self._running_trainer(state)
        if not self.eval_on_evaluate and self._is_our_metric(getattr(args, "metric_for_best_model", None)):
            raise ValueError(
                f"metric_for_best_model={args.metric_for_best_model!r} needs TatBLiMPCallback(eval_on_evaluate=True)"
            )
        if state.is_world_process_zero and history_file:
            self._history_file = reporting.HistoryFile.resolve(self.history_file, getattr(args, "output_dir", None))
            if self._history_file is not None:
                try:
                    self._history_file.start({entry["step"] for entry in self.history})
                    if self.history and self._history_file.path.exists():  # resumed: the best scores so far
                        self._alerts.restore(self._history_file.path)
                except (OSError, ValueError) as err:  # unreadable, or not JSON lines: say so, and train on
                    logger.warning(
                        "tatblimp: cannot use the history file %s (%s); none is written in this run", self._history_file.path, err
                    )
                    self._history_file = None
            self._suite_history_files = suite_history_files(self._history_file, self.suites, self.history)
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
        tokenizer = self.tokenizer if self.tokenizer is not None else processing_class
        if tokenizer is None:
            raise ValueError("TatBLiMPCallback needs a tokenizer: pass tokenizer= or give the Trainer a processing_class")
        self._prepare(tokenizer, model, getattr(args, "output_dir", None))

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
        if self._is_our_metric(wanted) and not wanted.startswith("eval_"):
            wanted = f"eval_{wanted}"
        if self._is_our_metric(wanted) and not self._has_results(metrics):
            added[wanted] = float("nan")  # scoring failed: never the best, and training goes on
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
        ours = [entry for entry in log_history if self._is_ours(entry)]
        self.history = [{"step": e["step"], **{k: v for k, v in e.items() if k != "step"}} for e in ours if self._has_results(e)]
        self.failures = int(max((e.get(f"{self.log_prefix}/failures", 0) for e in ours), default=0))
        self._last_step = ours[-1]["step"] if ours else None
        self._last_weights: str | None = _RESTORED if ours else None  # the label of the weights tried at _last_step
        self._last_metrics = {k: v for k, v in ours[-1].items() if k != "step"} if ours else {}
        # The metrics of every set of weights scored in this run, by weights label: a step is not a set of
        # weights (load_best_model_at_end loads other weights at the same step). Restored entries have no label.
        self._by_weights: dict[str, dict[str, float]] = {}
        self._last_results_weights: str | None = None  # the label of the weights ``last_results`` measured
        self.last_results = None
        self.last_fc_results = None
        self.acquisition = {}
        self._alerts = RegressionAlerts(self.alert_on_regression, self.alert_q, self.alert_min_drop, self.log_prefix, ours)
        self._finished = False
        self._history_file = None
        self._trainer = None
        self._wandb.reset()

    def _running_trainer(self, state):
        """``trainer``, if it is the one running this callback (not one it was attached to before)."""
        if self.trainer is None:
            return None
        if self.trainer.state is not state:
            logger.warning(
                "tatblimp: the callback's trainer= does not hold it (another Trainer runs it); "
                "its results reach state.log_history, wandb, the console and the history file only"
            )
            return None
        return self.trainer

    def _is_our_metric(self, name: str | None) -> bool:
        prefixes = (self.log_prefix, f"{self.log_prefix}_fc", *(self.suites or {}))
        return (name or "").removeprefix("eval_").startswith(tuple(f"{prefix}/" for prefix in prefixes))

    def _is_ours(self, entry: dict[str, Any]) -> bool:
        return any(key.startswith((f"{self.log_prefix}/", f"{self.log_prefix}_fc/")) for key in entry)

    def _has_results(self, entry: dict[str, Any]) -> bool:
        return f"{self.log_prefix}/acc" in entry or f"{self.log_prefix}_fc/accuracy" in entry

    def _prepare(self, tokenizer, model, output_dir: str | None = None) -> None:
        """Build the evaluators once; keep them (and their tokenized cache) while tokenizer and data stay the same."""
        if self._prepared_for is None or self._prepared_for[0] is not tokenizer or self._prepared_for[1] is not self.data:
            self._prepared_for = (tokenizer, self.data)
            self._evaluator = self._fc_evaluator = None
            if self.protocol != "logprob":
                self._fc_evaluator = ForcedChoiceEvaluator(
                    tokenizer,
                    self.data,
                    prompt=self.forced_choice_prompt or DEFAULT_PROMPT,
                    allow_modified=self.allow_modified,
                    memory_budget=self.memory_budget,
                )
            if self.protocol != "forced-choice":
                self._evaluator = Evaluator(
                    tokenizer,
                    self.data,
                    prefix_token_id=self.prefix_token_id,
                    allow_modified=self.allow_modified,
                    memory_budget=self.memory_budget,
                    truncate=self.truncate,
                    cache_path=callback_options.under_output_dir(self.cache_path, output_dir),
                    suites=self.suites,
                )
        for evaluator in (self._fc_evaluator, self._evaluator):
            if evaluator is not None:
                self._prepare_or_say_why(evaluator, model)

    def _prepare_or_say_why(self, evaluator, model) -> None:
        """Prepare ``evaluator`` now, or say once, with the traceback, why it cannot be; not counted as a failure:
        each evaluation tries again and counts its own failure (one line when the error is the same)."""
        try:
            evaluator.prepare(model)
        except Exception as error:
            if self.raise_on_error:
                raise
            what = f"cannot score this model; every evaluation will fail and be counted in {self.log_prefix}/failures"
            self._errors.failed(what, error, source=evaluator)  # each evaluation's failure then says "as before"

    def _finish(self, args, state) -> None:
        """The end of training: acquisition steps, and the wandb table and summary."""
        self._finished = True
        self.acquisition = acquisition_steps(self.history, self.acquisition_threshold, prefix=self.log_prefix)
        self.learning = self._alerts.summary(state.is_world_process_zero)
        wandb = state.is_world_process_zero and reporting.reports_to_wandb(args, self._trainer)
        if wandb and self.log_table and self.last_results is not None:
            self._guarded(self._wandb.log_results, self.log_prefix, self.last_results, self.acquisition, self.learning)
            for name, results in self.last_suite_results.items():
                self._guarded(self._wandb.log_results, name, results, {})
        if self.report_file is not None and self._history_file is not None and self._history_file.path.exists():
            output = callback_options.under_output_dir(self.report_file, args.output_dir)
            self._guarded(
                reporting.report_at_end_of_training,
                self._history_file.path,
                output,
                f"{self.log_prefix}/report" if wandb else None,
            )

    # -- scoring and logging --------------------------------------------------------------------

    def _score(self, args, state, control, model) -> dict[str, float]:
        """Score the weights the model holds now (once per set of weights, by ``weights_label``) and log them at
        this global step (once per step); returns their metrics.

        A step is not a set of weights: after ``load_best_model_at_end`` the step is the last one and the
        weights are the best checkpoint's. Weights scored before give their own numbers again, unscored.
        """
        if model is None or (self._evaluator is None and self._fc_evaluator is None):
            return {}
        weights = _weights_label_or_none(model)
        new_step = self._last_step != state.global_step
        # Tried at this step with these weights already (a resumed run's restored point: its checkpoint's, unlabelled).
        same = weights is None or self._last_weights in (weights, _RESTORED)
        if distributed.all_agree(not new_step and same):
            return self._last_metrics
        known = self._by_weights.get(weights) if weights is not None else None
        self._last_step, self._last_weights = state.global_step, weights
        if distributed.all_agree(known is not None):  # these very weights were scored in this run: their numbers
            self._last_metrics = known
            if new_step:  # unchanged since an earlier step (an optimizer step skipped): a point here too
                self._record(args, state, control, known, self.last_results if self._last_results_weights == weights else None)
            return known
        with rng_preserved():
            evaluator = self._evaluator
            if self.suites and evaluator is not None:  # the suites due at this evaluation (suite_every)
                evaluator = functools.partial(evaluator, suites=suites_due(self.suites, self.suite_every, len(self.history)))
            results = self._guarded(evaluator, model) if evaluator is not None else None
            fc_results = self._guarded(self._fc_evaluator, model) if self._fc_evaluator is not None else None
        metrics = {}
        if results is not None:
            self.last_results, self._last_results_weights = results, weights
            metrics = results.flat_metrics(self.log_prefix)
            if results.non_finite_pairs:
                logger.warning(
                    "tatblimp: step %d: %d pairs have non-finite log-probs and are left out of the metrics (%s)",
                    state.global_step,
                    results.non_finite_pairs,
                    ", ".join(name for name, group in results.phenomena.items() if group.non_finite),
                )
            metrics[f"{self.log_prefix}/eval_seconds"] = results.run_info["seconds"]
            for name, suite in results.suites.items():
                self.last_suite_results[name] = suite
                metrics.update(suite.flat_metrics(name))
        if fc_results is not None:
            self.last_fc_results = fc_results
            metrics.update(fc_results.flat_metrics(f"{self.log_prefix}_fc"))
            metrics[f"{self.log_prefix}_fc/eval_seconds"] = fc_results.run_info["seconds"]
        if self.failures:
            metrics[f"{self.log_prefix}/failures"] = float(self.failures)
        if results is not None and new_step:
            metrics.update(self._alerts.observe(state.global_step, results, state.is_world_process_zero))
        self._last_metrics = metrics
        if weights is not None and self._has_results(metrics):  # a failure may pass (out of memory): tried again
            self._by_weights[weights] = metrics
        if new_step:
            self._record(args, state, control, metrics, results)
        else:  # other weights at a step already on the curve: this evaluation's metrics only, one point per step
            logger.info(
                "tatblimp: step %d scored again for other weights (%s); not a second curve point", state.global_step, weights
            )
        return metrics

    def _record(self, args, state, control, metrics: dict[str, float], results: Results | None) -> None:
        """The curve point of this step: in ``history``, and logged everywhere (main process)."""
        if self._has_results(metrics):
            self.history.append({"step": state.global_step, **metrics})
        if state.is_world_process_zero and metrics:
            self._log(args, state, control, metrics, results)

    def _guarded(self, function, *arguments):
        """Run ``function``; unless ``raise_on_error``, log and count an exception and return None."""
        try:
            result = function(*arguments)
        except Exception as error:
            if self.raise_on_error:
                raise
            self.failures += 1
            self._errors.failed(f"scoring failed (failure {self.failures}); training continues", error, source=function)
            return None
        self._errors.succeeded(function)
        return result

    def _log(self, args, state, control, metrics: dict[str, float], results: Results | None) -> None:
        """One evaluation, once, to every destination (see ``reporting``)."""
        step = state.global_step
        state.log_history.append({**metrics, "step": step})
        if self._trainer is not None:
            self._guarded(reporting.log_to_trainer_callbacks, self._trainer, self, args, state, control, metrics)
        if reporting.reports_to_wandb(args, self._trainer):
            self._guarded(self._wandb.log, metrics, step)
        if results is not None and self._history_file is not None:
            self._guarded(self._history_file.append, step, results, self._alerts.fields(step))
        for name, suite in (results.suites if results is not None else {}).items():
            if name in self._suite_history_files:
                self._guarded(self._suite_history_files[name].append, step, suite)
        if f"{self.log_prefix}/acc" in metrics or f"{self.log_prefix}_fc/accuracy" in metrics:
            line = reporting.console_line(step, metrics, self.log_prefix)
            for name in results.suites if results is not None else ():
                line += f"  {name} acc_norm {metrics[f'{name}/acc_norm']:.4f}"
            reporting.print_line(line)


_RESTORED = "restored"  # the weights of a resumed run's last restored point: its checkpoint's


def _weights_label_or_none(model) -> str | None:
    try:
        return weights_label(unwrap_model(model))
    except Exception:  # weights that cannot be read (meta): the evaluator says why, and counts it
        return None
