"""Where ``TatBLiMPCallback``'s results go: ``state.log_history``, every ``report_to`` reporter, the console
and a JSONL history file, once per evaluation and at its global step.

A callback is not given the Trainer, so the results reach the Trainer's other callbacks only when the
callback holds it (``TatBLiMPCallback.attach(trainer)``, as TRL's callbacks take ``trainer``). It then
does what ``Trainer.log`` does, with two exceptions: wandb is logged directly, so that the metrics keep
their own ``tatblimp/`` section (``WandbCallback`` would file them under ``train/``); and the console
printers (``ProgressCallback``, ``PrinterCallback``) are replaced by one short line.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from transformers.trainer_callback import PrinterCallback, ProgressCallback

from ..reading.jsonl import read_complete_lines
from ..results.learning import LearningSummary
from ..results.metrics import Results
from ..results.records_file import append_record

logger = logging.getLogger(__name__)

# report_to names whose callbacks log nothing that we send (emissions trackers, ...).
_NOT_METRIC_REPORTERS = {"codecarbon"}


def _wandb_callback_class() -> type:
    from transformers.integrations import WandbCallback  # importable without wandb installed

    return WandbCallback


def running_trainer(trainer, state):
    """``trainer`` (the callback's ``trainer=``), if it is the one running the callback (not one it was attached to
    before): ``state`` is its state; else None, with a warning that the results reach fewer places."""
    if trainer is None:
        return None
    if trainer.state is not state:
        logger.warning(
            "tatblimp: the callback's trainer= does not hold it (another Trainer runs it); "
            "its results reach state.log_history, wandb, the console and the history file only"
        )
        return None
    return trainer


def reports_to_wandb(args, trainer) -> bool:
    """Whether this run logs to wandb: a ``WandbCallback`` (or subclass) on the Trainer, else ``report_to``."""
    if trainer is not None:
        return any(isinstance(cb, _wandb_callback_class()) for cb in trainer.callback_handler.callbacks)
    return "wandb" in (args.report_to or [])


def unreachable_reporters(args, trainer) -> list[str]:
    """The ``report_to`` reporters the results cannot reach: all but wandb when the Trainer is unknown."""
    if trainer is not None:
        return []
    return [name for name in (args.report_to or []) if name != "wandb" and name not in _NOT_METRIC_REPORTERS]


def log_to_trainer_callbacks(trainer, skip, args, state, control, metrics: dict[str, float]) -> None:
    """Call ``on_log`` of every callback of ``trainer`` except ``skip``, wandb's and the console printers'."""
    handler = trainer.callback_handler
    skipped = (_wandb_callback_class(), ProgressCallback, PrinterCallback)
    for callback in handler.callbacks:
        if callback is skip or isinstance(callback, skipped):
            continue
        callback.on_log(
            args,
            state,
            control,
            logs=dict(metrics),
            model=handler.model,
            processing_class=handler.processing_class,
            optimizer=handler.optimizer,
            lr_scheduler=handler.lr_scheduler,
            train_dataloader=handler.train_dataloader,
            eval_dataloader=handler.eval_dataloader,
        )


def wandb_run():
    try:
        import wandb
    except ImportError:
        return None
    return wandb.run


class WandbSection:
    """Logs to the active wandb run under ``<prefix>/...`` with ``train/global_step`` as the x-axis."""

    def __init__(self, prefixes: list[str]):
        self.prefixes = prefixes
        self._defined_for: str | None = None  # the id of the run whose metrics are defined

    def reset(self) -> None:
        self._defined_for = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        run = wandb_run()
        if run is None:
            return
        if self._defined_for != run.id:
            run.define_metric("train/global_step")
            for prefix in self.prefixes:
                run.define_metric(f"{prefix}/*", step_metric="train/global_step", step_sync=True)
            self._defined_for = run.id
        run.log({**metrics, "train/global_step": step})

    def log_results(
        self, prefix: str, results: Results, acquisition: dict[str, int | None], learning: LearningSummary | None = None
    ) -> None:
        """The end of training: a table of the final results (with ``learning``, each phenomenon's acquisition step,
        fitted step and trend), and the final numbers and acquisition steps in the summary."""
        run = wandb_run()
        if run is None:
            return
        import wandb

        columns, rows = results.phenomenon_table()
        if learning is not None:
            columns, rows = learning_columns(columns, rows, acquisition, learning)
        run.log({f"{prefix}/results": wandb.Table(columns=columns, data=rows)})
        run.summary[f"{prefix}/acc"] = results.acc
        run.summary[f"{prefix}/acc_norm"] = results.acc_norm
        for name, step in acquisition.items():
            run.summary[f"{prefix}/acquisition/{name}"] = "never" if step is None else step  # wandb drops None


def learning_columns(
    columns: list[str], rows: list[list[Any]], acquisition: dict[str, int | None], learning: LearningSummary
) -> tuple[list[str], list[list[Any]]]:
    """``phenomenon_table``'s (columns, rows) with the acquisition step (threshold), the fitted acquisition step
    with its 95% interval (or why there is none) and the latest trend of each phenomenon ("-" for overall)."""

    def threshold_step(name: str) -> str:
        return "-" if name not in acquisition else "never" if acquisition[name] is None else str(acquisition[name])

    extra = []
    for row in rows:
        name = row[0]
        fit, trend = learning.fits.get(name), learning.trends.get(name)
        extra.append(
            [
                threshold_step(name),
                fit.describe() if fit is not None else "-",
                f"{trend.direction} ({trend.difference:+.3f} since step {trend.from_step})" if trend is not None else "-",
            ]
        )
    columns = [*columns, "acquired (threshold)", "acquired (fit) [95%]", "trend"]
    return columns, [[*row, *more] for row, more in zip(rows, extra)]


def learning_line(learning: LearningSummary) -> str:
    """One line for the console at the end of training: which phenomena are still rising, flat or falling."""
    groups: dict[str, list[str]] = {"rising": [], "flat": [], "falling": []}
    for name, trend in learning.trends.items():
        groups[trend.direction].append(name)
    if not learning.trends:
        return "tatblimp: trend: fewer than two evaluations"
    step = next(iter(learning.trends.values()))
    told = "; ".join(
        f"{direction} {len(names)}" + (f" ({', '.join(names)})" if names and direction != "flat" else "")
        for direction, names in groups.items()
    )
    return f"tatblimp: trend from step {step.from_step} to {step.to_step}: {told}"


def console_line(step: int, metrics: dict[str, float], prefix: str) -> str:
    """One line per evaluation: step, acc, acc_norm (and forced-choice accuracy), seconds."""
    parts = []
    if f"{prefix}/acc" in metrics:
        parts.append(f"acc {metrics[f'{prefix}/acc']:.4f}  acc_norm {metrics[f'{prefix}/acc_norm']:.4f}")
    if f"{prefix}_fc/accuracy" in metrics:
        parts.append(f"forced-choice accuracy {metrics[f'{prefix}_fc/accuracy']:.4f}")
    seconds = sum(v for k, v in metrics.items() if k.endswith("/eval_seconds"))
    parts.append(f"({seconds:.1f} s)")
    return f"{prefix} step {step}: " + "  ".join(parts)


def print_line(line: str) -> None:
    """Print above the Trainer's progress bar, if there is one."""
    from tqdm.auto import tqdm

    tqdm.write(line)


class HistoryFile:
    """One JSON line per evaluation, ``{"step": ..., **results.to_dict()}`` without the per-pair list: the
    record of a ``tatblimp sweep`` line without "checkpoint", so ``tatblimp compare`` reads the file."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def resolve(cls, setting: str | os.PathLike | None, output_dir: str | None) -> HistoryFile | None:
        if setting is None or (output_dir is None and not Path(setting).is_absolute()):
            return None
        return cls(Path(output_dir or "") / setting)

    def start(self, kept_steps: set[int]) -> None:
        """Keep only the lines of ``kept_steps`` (a resumed run's steps up to its checkpoint; none for a new run)."""
        if not self.path.exists():
            return
        lines = [line for line in read_complete_lines(self.path) if line.strip()]
        kept = [line for line in lines if json.loads(line).get("step") in kept_steps]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def append(self, step: int, results: Results, extra: dict[str, Any] | None = None) -> None:
        """Append the line of ``step``; ``extra``: more fields for it (the step's ``alerts``)."""
        # A suite's results are lines of their own history file.
        record = {"step": step, **{k: v for k, v in results.to_dict().items() if k not in ("pairs", "suites")}, **(extra or {})}
        append_record(self.path, record)


def logged_copy(log_history: list[dict[str, Any]], logs: dict[str, Any]) -> dict[str, Any] | None:
    """The entry ``Trainer.log`` appended to ``log_history`` for ``logs`` (a copy, with "step"): the latest one of the
    last step that holds them (another TatBLiMP callback may have appended its point after it)."""
    last_step = log_history[-1].get("step") if log_history else None
    for entry in reversed(log_history):
        if entry.get("step") != last_step:
            break
        if all(key in entry and (entry[key] is value or entry[key] == value) for key, value in logs.items()):
            return entry
    return None


def is_evaluation_log(logs: dict[str, Any]) -> bool:
    """``Trainer.evaluate`` logs its metrics with ``eval_runtime`` (``eval_<name>_runtime`` for a dict of datasets)."""
    return any(key.startswith("eval_") and key.endswith("_runtime") for key in logs)


def report_at_end_of_training(
    history: str | os.PathLike, output: str | os.PathLike, wandb_key: str | None = None, threshold: float | None = None
) -> None:
    """The callback's report: ``history`` (its history file) as HTML in ``output``, and to the active wandb
    run as an HTML panel under ``wandb_key`` (None: not to wandb); acquired at the run's ``threshold`` of acc_norm
    (None: the default)."""
    from ..reports.report import write_report
    from ..results.curves import DEFAULT_THRESHOLD
    from ..results.runs import load_runs

    runs = load_runs([history])
    threshold = DEFAULT_THRESHOLD if threshold is None else threshold
    output = write_report(output, runs, title=f"TatBLiMP report: {runs[0].label}", threshold=threshold)
    logger.info("tatblimp: wrote the report %s", output)
    if wandb_key is not None:
        run = wandb_run()
        if run is not None:
            import wandb

            with output.open(encoding="utf-8") as page:  # a file object: read as HTML, whatever the file's name
                run.log({wandb_key: wandb.Html(page, inject=False)})
