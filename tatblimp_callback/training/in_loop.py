"""Scoring inside a training loop, whatever the framework: the part the Hugging Face Trainer callback
(``callback.py``) and the Lightning callback (``lightning_callback.py``) share.

An ``InLoopMonitor`` builds the evaluators once, scores the weights a model holds now (in eval mode,
the random generators restored), labels each result with the weights it measured (a step is not a set
of weights), turns a scoring error into a logged, counted failure, keeps the history (rebuilt on
resume) and its history files, and builds the flat metrics dict. What a framework adds is when to ask
(``score(model, step, publish)``) and where a new curve point goes: ``publish(step, metrics, results)``,
called once per point, on the main process only; that call is the one place that runs after each
evaluation, with the results and the step.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..chat.forced_choice import DEFAULT_PROMPT, ForcedChoiceEvaluator, ForcedChoiceResults
from ..engine import distributed
from ..engine.model_checks import unwrap_model, weights_label
from ..engine.model_state import rng_preserved
from ..engine.precision import precision_name
from ..evaluation import Evaluator
from ..results.curves import acquisition_steps
from ..results.learning import LearningSummary
from ..results.metrics import Results
from . import callback_options, reporting
from .alerts import RegressionAlerts
from .monitoring_errors import ErrorLog
from .suite_schedule import suite_history_files, suites_due

HARNESS_PREFIX = "lm_eval/"  # the harness tasks' keys (harness.in_training.PREFIX, whose module imports lm_eval)

logger = logging.getLogger(__name__)

Publish = Callable[[int, dict[str, float], "Results | None"], None]

_RESTORED = "restored"  # the weights of a resumed run's last restored point: its checkpoint's

HISTORY_FILE = "{log_prefix}_history.jsonl"  # the callbacks' default: tatblimp_history.jsonl, one file a prefix


class InLoopMonitor:
    """The state of one callback's scoring: evaluators, history, failures, the weights each point measured.

    ``settings`` is the callback: an object with the scoring options as attributes (``data``, ``protocol``,
    ``suites``, ``suite_every``, ``prefix_token_id``, ``allow_modified``, ``memory_budget``, ``truncate``,
    ``cache_path``, ``forced_choice_prompt``, ``log_prefix``, ``raise_on_error``, ``history_file``,
    ``acquisition_threshold``, ``alert_on_regression``, ``alert_q``, ``alert_min_drop``, ``alert_mode``), read when
    they are used.
    """

    def __init__(self, settings: Any):
        self.settings = settings
        self.evaluator: Evaluator | None = None
        self.fc_evaluator: ForcedChoiceEvaluator | None = None
        self.harness = None  # harness.in_training.HarnessTasks, with lm_eval_tasks
        self._prepared_for: tuple[Any, Any] | None = None  # (tokenizer, data) the evaluators were built for
        self.errors = ErrorLog()
        self.last_suite_results: dict[str, Results] = {}
        self.start_run([])

    # -- per run --------------------------------------------------------------------------------

    def start_run(self, log_history: list[dict[str, Any]]) -> None:
        """Per-run state, rebuilt from a resumed run's logged entries (``{"step": ..., **metrics}``; others are
        skipped), or empty for a new run."""
        ours = [entry for entry in log_history if self.is_ours(entry)]
        self.history = [{"step": e["step"], **{k: v for k, v in e.items() if k != "step"}} for e in ours if self.has_results(e)]
        self.failures = int(max((e.get(f"{self.settings.log_prefix}/failures", 0) for e in ours), default=0))
        self._last_step = ours[-1]["step"] if ours else None
        self._last_weights: str | None = _RESTORED if ours else None  # the label of the weights tried at _last_step
        self._last_metrics = {k: v for k, v in ours[-1].items() if k != "step"} if ours else {}
        # Every point recorded ({"step": ..., **metrics}, failures included), on every process alike: the state a
        # framework checkpoints (Lightning's).
        self.points = [dict(entry) for entry in ours]
        # The metrics of every set of weights scored in this run, by weights label: a step is not a set of
        # weights (load_best_model_at_end loads other weights at the same step). Restored entries have no label.
        self._by_weights: dict[str, dict[str, float]] = {}
        self._last_results_weights: str | None = None  # the label of the weights ``last_results`` measured
        self.last_results: Results | None = None
        self.last_fc_results: ForcedChoiceResults | None = None
        self.acquisition: dict[str, int | None] = {}
        self.learning: LearningSummary | None = None
        s = self.settings
        self.alerts = RegressionAlerts(s.alert_on_regression, s.alert_q, s.alert_min_drop, s.log_prefix, ours, s.alert_mode)
        self.history_file: reporting.HistoryFile | None = None
        self.suite_history_files: dict[str, reporting.HistoryFile] = {}

    def history_setting(self) -> str | None:
        """``settings.history_file`` with ``{log_prefix}`` replaced by the log prefix (None: no file)."""
        setting = self.settings.history_file
        return None if setting is None else os.fspath(setting).replace("{log_prefix}", self.settings.log_prefix)

    def open_history_files(self, output_dir: str | None) -> None:
        """Open the history file (``history_setting()`` under ``output_dir``) and the suites', keeping a
        resumed run's lines of the steps in ``history``; main process only."""
        self.history_file = reporting.HistoryFile.resolve(self.history_setting(), output_dir)
        if self.history_file is not None:
            try:
                self.history_file.start({entry["step"] for entry in self.history})
                if self.history and self.history_file.path.exists():  # resumed: the best scores so far
                    self.alerts.restore(self.history_file.path)
            except (OSError, ValueError) as err:  # unreadable, or not JSON lines: say so, and train on
                logger.warning(
                    "tatblimp: cannot use the history file %s (%s); none is written in this run", self.history_file.path, err
                )
                self.history_file = None
        self.suite_history_files = suite_history_files(self.history_file, self.settings.suites, self.history)

    def finish(self, main: bool) -> None:
        """The end of training: the acquisition steps of the history, and the fits and trends (``learning``)."""
        self.acquisition = acquisition_steps(self.history, self.settings.acquisition_threshold, prefix=self.settings.log_prefix)
        self.learning = self.alerts.summary(main)

    # -- which keys are ours ----------------------------------------------------------------------

    def prefixes(self) -> tuple[str, ...]:
        """The sections this monitor logs under: the log prefix, its forced-choice one, each suite's name."""
        prefix = self.settings.log_prefix
        harness = ("lm_eval",) if getattr(self.settings, "lm_eval_tasks", None) else ()
        return (prefix, f"{prefix}_fc", *(self.settings.suites or {}), *harness)

    def is_our_metric(self, name: str | None) -> bool:
        return (name or "").removeprefix("eval_").startswith(tuple(f"{prefix}/" for prefix in self.prefixes()))

    def is_ours(self, entry: dict[str, Any]) -> bool:
        prefix = self.settings.log_prefix
        return any(key.startswith((f"{prefix}/", f"{prefix}_fc/")) for key in entry)

    def has_results(self, entry: dict[str, Any]) -> bool:
        prefix = self.settings.log_prefix
        return f"{prefix}/acc" in entry or f"{prefix}_fc/accuracy" in entry

    # -- the evaluators ---------------------------------------------------------------------------

    def prepare(self, tokenizer, model, output_dir: str | None = None, autocast_dtype=None) -> None:
        """Build the evaluators once; keep them (and their tokenized cache) while tokenizer and data stay the same.
        ``autocast_dtype``: what the training loop autocasts to (None: it does not), for ``precision="auto"``."""
        s = self.settings
        if self._prepared_for is None or self._prepared_for[0] is not tokenizer or self._prepared_for[1] is not s.data:
            self._prepared_for = (tokenizer, s.data)
            self.evaluator = self.fc_evaluator = self.harness = None
            spans = None
            # The harness tasks are built before TatBLiMP's cache, which holds their requests; lm_eval imported only then.
            if getattr(s, "lm_eval_tasks", None):
                from ..harness.in_training import HarnessTasks

                self.harness = HarnessTasks(
                    s.lm_eval_tasks,
                    tokenizer,
                    include_path=s.lm_eval_include_path,
                    limit=s.lm_eval_limit,
                    memory_budget=s.memory_budget,
                )
                if s.protocol != "forced-choice":  # scored in TatBLiMP's pass; without it, in a pass of their own
                    spans = self.harness.prepare(unwrap_model(model))
            if s.protocol != "logprob":
                self.fc_evaluator = ForcedChoiceEvaluator(
                    tokenizer,
                    s.data,
                    prompt=s.forced_choice_prompt or DEFAULT_PROMPT,
                    allow_modified=s.allow_modified,
                    memory_budget=s.memory_budget,
                )
            if s.protocol != "forced-choice":
                self.evaluator = Evaluator(
                    tokenizer,
                    s.data,
                    prefix_token_id=s.prefix_token_id,
                    allow_modified=s.allow_modified,
                    memory_budget=s.memory_budget,
                    truncate=s.truncate,
                    head_method=s.head_method,
                    row_length=s.row_length,
                    cuda_graphs=s.cuda_graphs,
                    compile=s.compile,
                    exact_decisions=getattr(s, "exact_decisions", True),
                    cache_path=callback_options.under_output_dir(s.cache_path, output_dir),
                    suites=s.suites,
                    spans=spans,
                )
        if self.evaluator is not None:
            precision = getattr(s, "precision", "auto")
            self.evaluator.precision = precision_name(autocast_dtype) if precision == "auto" and autocast_dtype else precision
        for evaluator in (self.fc_evaluator, self.evaluator):
            if evaluator is not None:
                self._prepare_or_say_why(evaluator, model)

    def _prepare_or_say_why(self, evaluator, model) -> None:
        """Prepare ``evaluator`` now, or say once, with the traceback, why it cannot be; not counted as a failure:
        each evaluation tries again and counts its own failure (one line when the error is the same)."""
        try:
            evaluator.prepare(model)
        except Exception as error:
            if self.settings.raise_on_error:
                raise
            what = f"cannot score this model; every evaluation will fail and be counted in {self.settings.log_prefix}/failures"
            self.errors.failed(what, error, source=evaluator)  # each evaluation's failure then says "as before"

    # -- scoring ----------------------------------------------------------------------------------

    def score(self, model, step: int, publish: Publish, *, main: bool) -> dict[str, float]:
        """Score the weights ``model`` holds now (once per set of weights, by ``weights_label``) and record them
        at ``step`` (once per step: ``publish`` on the main process); returns their metrics. Under
        ``torch.distributed`` every process calls this, with the same ``step``; ``main`` (required: the framework's
        own word, the Trainer's ``is_world_process_zero``, Lightning's ``is_global_zero``) says whether this process
        logs: the curve point, the regression alerts' warnings and wandb alerts.

        A step is not a set of weights: after ``load_best_model_at_end`` the step is the last one and the
        weights are the best checkpoint's. Weights scored before give their own numbers again, unscored.
        """
        if model is None or (self.evaluator is None and self.fc_evaluator is None):
            return {}
        weights = _weights_label_or_none(model)
        new_step = self._last_step != step
        # Tried at this step with these weights already (a resumed run's restored point: its checkpoint's, unlabelled).
        same = weights is None or self._last_weights in (weights, _RESTORED)
        if distributed.all_agree(not new_step and same):
            return self._last_metrics
        known = self._by_weights.get(weights) if weights is not None else None
        self._last_step, self._last_weights = step, weights
        if distributed.all_agree(known is not None):  # these very weights were scored in this run: their numbers
            self._last_metrics = known
            if new_step:  # unchanged since an earlier step (an optimizer step skipped): a point here too
                results = self.last_results if self._last_results_weights == weights else None
                if results is not None:  # a line of the history file too: the alerts see it, as a replay of the file does
                    self.alerts.observe(step, results, main)
                    self._last_metrics = {**known, **self.alerts.agreed_count(main)}
                self._record(step, self._last_metrics, results, publish, main)
            return self._last_metrics
        with rng_preserved():
            # The label taken above is handed down: hashing every weight again would cost as much once more.
            evaluator = None if self.evaluator is None else functools.partial(self.evaluator, weights=weights)
            if self.settings.suites and evaluator is not None:  # the suites due at this evaluation (suite_every)
                # The n-th evaluation, failed ones counted (a point each): one failure must not move the schedule
                due = suites_due(self.settings.suites, self.settings.suite_every, len(self.points))
                evaluator = functools.partial(evaluator, suites=due)
            fc_evaluator = None if self.fc_evaluator is None else functools.partial(self.fc_evaluator, weights=weights)
            results = self.guarded(evaluator, model) if evaluator is not None else None
            fc_results = self.guarded(fc_evaluator, model) if fc_evaluator is not None else None
            harness = None
            if self.harness is not None and self.evaluator is None:  # forced choice only: a pass of their own
                harness = self.guarded(self.harness, model)
            elif self.harness is not None and results is not None:  # from the fused pass's log-likelihoods
                harness = self.guarded(self.harness.metrics, self.evaluator.span_scores)
        metrics = self._metrics(step, results, fc_results, weights)
        metrics.update(harness or {})  # the harness tasks' own metrics, lm_eval/<task>/<metric>
        if results is not None and new_step:  # regression alerts: <prefix>/alerts from the first one on
            self.alerts.observe(step, results, main)
            metrics.update(self.alerts.agreed_count(main))
        elif self.alerts.count:  # a count of the run, as failures: at every point once there are any (never NaN)
            metrics[f"{self.settings.log_prefix}/alerts"] = float(self.alerts.count)
        self._last_metrics = metrics
        if weights is not None and self.has_results(metrics):  # a failure may pass (out of memory): tried again
            self._by_weights[weights] = metrics
        if new_step:
            self._record(step, metrics, results, publish, main)
        else:  # other weights at a step already on the curve: this evaluation's metrics only, one point per step
            logger.info("tatblimp: step %d scored again for other weights (%s); not a second curve point", step, weights)
        return metrics

    def _metrics(self, step: int, results: Results | None, fc_results: ForcedChoiceResults | None, weights) -> dict[str, float]:
        """The flat metrics of one evaluation (``<prefix>/...``, each suite's, forced choice's, the failures)."""
        prefix = self.settings.log_prefix
        metrics = {}
        if results is not None:
            self.last_results, self._last_results_weights = results, weights
            metrics = results.flat_metrics(prefix)
            if results.non_finite_pairs:
                logger.warning(
                    "tatblimp: step %d: %d pairs have non-finite log-probs and are left out of the metrics (%s)",
                    step,
                    results.non_finite_pairs,
                    ", ".join(name for name, group in results.phenomena.items() if group.non_finite),
                )
            metrics[f"{prefix}/eval_seconds"] = results.run_info["seconds"]
            self.last_suite_results.update(results.suites)
        if fc_results is not None:
            self.last_fc_results = fc_results
            metrics.update(fc_results.flat_metrics(f"{prefix}_fc"))
            metrics[f"{prefix}_fc/eval_seconds"] = fc_results.run_info["seconds"]
        if self.failures:
            metrics[f"{prefix}/failures"] = float(self.failures)
        return metrics

    def _record(self, step: int, metrics: dict[str, float], results: Results | None, publish: Publish, main: bool) -> None:
        """The curve point of this step: in ``history``, and published (main process)."""
        if self.has_results(metrics):
            self.history.append({"step": step, **metrics})
        if metrics:
            self.points.append({"step": step, **metrics})
        if main and metrics:
            publish(step, metrics, results)

    def write_history(self, step: int, results: Results | None, metrics: dict[str, float] | None = None) -> None:
        """The evaluation's lines in the history file and the suites' (main process); the harness tasks' metrics
        (``lm_eval/<task>/<metric>`` of ``metrics``) in TatBLiMP's line, under ``lm_eval``."""
        harness = {key.split("/", 1)[1]: value for key, value in (metrics or {}).items() if key.startswith(HARNESS_PREFIX)}
        if results is not None and self.history_file is not None:
            extra = {**self.alerts.fields(step), **({"lm_eval": harness} if harness else {})}
            self.guarded(self.history_file.append, step, results, extra)
        for name, suite in (results.suites if results is not None else {}).items():
            if name in self.suite_history_files:
                self.guarded(self.suite_history_files[name].append, step, suite)

    def console(self, step: int, metrics: dict[str, float], results: Results | None) -> None:
        """The one-line console message of an evaluation with results."""
        prefix = self.settings.log_prefix
        if self.has_results(metrics):
            line = reporting.console_line(step, metrics, prefix)
            for name in results.suites if results is not None else ():
                line += f"  {name} acc_norm {metrics[f'{name}/acc_norm']:.4f}"
            reporting.print_line(line)

    def guarded(self, function, *arguments):
        """Run ``function``; unless ``raise_on_error``, log and count an exception and return None."""
        try:
            result = function(*arguments)
        except Exception as error:
            if self.settings.raise_on_error:
                raise
            self.failures += 1
            self.errors.failed(f"scoring failed (failure {self.failures}); training continues", error, source=function)
            return None
        self.errors.succeeded(function)
        return result


class MonitoredResults:
    """What a callback holding an ``InLoopMonitor`` (as ``_monitor``) shows of it: the same for every framework."""

    _monitor: InLoopMonitor

    @property
    def history(self) -> list[dict[str, float]]:
        """One entry per evaluation: ``step`` and the logged metrics."""
        return self._monitor.history

    @property
    def failures(self) -> int:
        """Evaluations that raised (and were logged instead of raised)."""
        return self._monitor.failures

    @property
    def last_results(self) -> Results | None:
        """The latest log-prob results (None before the first evaluation)."""
        return self._monitor.last_results

    @property
    def last_fc_results(self) -> ForcedChoiceResults | None:
        """The latest forced-choice results (``protocol`` "forced-choice" or "both")."""
        return self._monitor.last_fc_results

    @property
    def last_suite_results(self) -> dict[str, Results]:
        """The latest results of each suite, by name."""
        return self._monitor.last_suite_results

    @property
    def acquisition(self) -> dict[str, int | None]:
        """Set when training ends: per phenomenon, the first step from which acc_norm stayed at or
        above ``acquisition_threshold`` (None: never); with wandb also in its summary as ``<prefix>/acquisition/<name>``
        (the string "never" there, since wandb drops None)."""
        return self._monitor.acquisition

    @property
    def learning(self) -> LearningSummary | None:
        """Set when training ends: per phenomenon, the fitted acquisition step with its 95% interval and the latest
        trend (rising, flat, falling); see ``learning.py``. With wandb also in the end-of-training table."""
        return self._monitor.learning


def refuse_shared_history_file(monitor: InLoopMonitor, callbacks: Iterable[Any], output_dir: str | None) -> None:
    """``ValueError`` when another TatBLiMP callback among ``callbacks`` (a Trainer's) would log under the same keys
    as ``monitor`` (a suite of one name in both: the loggers got two values a step, and the monitors whichever came
    last) or write the same history file: their lines would interleave in one file, and each would cut the other's
    on resume."""
    mine = reporting.HistoryFile.resolve(monitor.history_setting(), output_dir)
    for other in callbacks:
        theirs = getattr(other, "_monitor", None)
        if not isinstance(theirs, InLoopMonitor) or theirs is monitor:
            continue
        prefixes = f"log_prefix {monitor.settings.log_prefix!r} and {theirs.settings.log_prefix!r}"
        shared = sorted(set(monitor.prefixes()) & set(theirs.prefixes()))
        if shared:
            raise ValueError(
                f"two TatBLiMP callbacks ({prefixes}) would log under the same keys ({', '.join(f'{s}/...' for s in shared)}): "
                "give each its own log_prefix, and their suites (and harness tasks) to one of them or other names"
            )
        if mine is None:
            continue
        found = reporting.HistoryFile.resolve(theirs.history_setting(), output_dir)
        if found is not None and Path(os.path.abspath(found.path)) == Path(os.path.abspath(mine.path)):
            raise ValueError(
                f"two TatBLiMP callbacks ({prefixes}) would write the same history file {mine.path}: give each its "
                "own history_file, or its own log_prefix (the default file is named for it: {log_prefix}_history.jsonl)"
            )


def _weights_label_or_none(model) -> str | None:
    try:
        return weights_label(unwrap_model(model))
    except Exception:  # weights that cannot be read (meta): the evaluator says why, and counts it
        return None
