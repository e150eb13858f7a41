"""Score the checkpoints a training run saved to disk: ``tatblimp sweep RUN_DIR``; or the revisions of a Hub
repository, ``tatblimp sweep HUB_ID --revisions PATTERN`` (``revision_sweep``), the same way.

Checkpoints (``checkpoints.py``: what counts as one, and when one is complete) are
scored in step order and each result is appended, as one JSON line, to ``RUN_DIR/tatblimp.jsonl``;
checkpoints already in that file are skipped, so a sweep can be stopped and run again.

With ``watch`` the folder is polled until ``max_wait`` seconds pass without a new checkpoint, or Ctrl-C.

Under torchrun (or ``accelerate launch``) the checkpoints are shared out among the processes
(``sweep_processes``); process 0 writes the file. A checkpoint that fails to load or score is named,
written to ``RUN_DIR/tatblimp-failures.jsonl`` and left for the next run; the others go on.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..reading.option_types import non_negative_float
from ..reading.suites import add_suite_arguments, parse_suite_option
from ..results.curves import acquisition_steps, add_acquisition_arguments, flat_record, history_from_records
from ..results.positions import readable
from ..results.records_file import drop_records, sole_writer
from ..results.runs import without_replaced
from .backends import backend_options
from .checkpoint_scoring import CheckpointScorer, score_or_failure
from .checkpoints import CheckpointWatcher, SweepError, find_checkpoints, has_weights, no_checkpoints_message, weights_identity
from .loading import add_model_arguments
from .outputs import check_output_file, say
from .placement import placement_options
from .revision_sweep import RevisionSeries, add_revision_arguments, check_repo_id, default_results_path, revision_summary
from .sweep_options import SweepOptions, SweepReport
from .sweep_records import append_sweep_record, check_same_files, other_settings, read_records

if TYPE_CHECKING:  # torch.distributed comes with it: imported when a sweep runs, not for `tatblimp sweep --help`
    from .sweep_processes import SweepProcesses

__all__ = ["SweepError", "SweepOptions", "SweepReport", "check_same_files", "find_checkpoints", "read_records", "sweep"]

logger = logging.getLogger(__name__)

RESULTS_FILE = "tatblimp.jsonl"
FAILURES_FILE = "tatblimp-failures.jsonl"


class _WandbLogger:
    def __init__(self, options: SweepOptions, config: dict[str, str]):
        import wandb

        self.run = wandb.init(
            project=options.wandb_project,
            entity=options.wandb_entity,
            id=options.wandb_run_id,
            resume="allow" if options.wandb_run_id else None,
            job_type="tatblimp-sweep",
            config=config,
        )
        self.run.define_metric("train/global_step")
        for section in ("tatblimp", *(parse_suite_option(text)[0] for text in options.suite)):
            self.run.define_metric(f"{section}/*", step_metric="train/global_step", step_sync=True)

    def log(self, record: dict[str, Any]) -> None:
        flat = {k: v for k, v in flat_record(record, phenomenon_intervals=False).items() if k != "step"}
        for name, suite in record.get("suites", {}).items():  # each suite its own section: <name>/acc, ...
            flat.update({k: v for k, v in flat_record(suite, name, phenomenon_intervals=False).items() if k != "step"})
        self.run.log({**flat, "train/global_step": record["step"]})

    def finish(self, acquisition: dict[str, int | None]) -> None:
        for name, step in acquisition.items():
            self.run.summary[f"tatblimp/acquisition/{name}"] = "never" if step is None else step  # wandb drops None
        self.run.finish()


def sweep(source: str | os.PathLike, options: SweepOptions | None = None, *, revisions: str | None = None) -> SweepReport:
    """Score every complete, not yet scored checkpoint of a run folder and append to its ``tatblimp.jsonl``; with
    ``revisions``, the revisions of a Hub repository instead (``revision_sweep``).

    Under torchrun every process calls this; the checkpoints are shared out (``sweep_processes``) and
    every process returns the same report.

    Args:
        source: the training run's folder, with ``checkpoint-<step>`` (or other ``*<step>``) sub-folders; with
            ``revisions``, a Hub model id.
        options: how to find, load and score them (default ``SweepOptions()``).
        revisions: the Hub revisions to score, comma-separated names or globs (``"step*"``); the same as
            ``options.revisions``.

    Returns:
        What was scored, skipped, failed, and every record of the results file in step order.

    Raises:
        SweepError: no such folder, two checkpoints with one step, a bad line in the results file, a Hub repository
            or revision that does not exist.
        ValueError: options that do not go together.
    """
    options = options or SweepOptions()
    if revisions is not None:
        options = replace(options, revisions=revisions)
    if options.acquisition not in ("estimate", "lower-bound"):
        raise ValueError(f"acquisition must be 'estimate' or 'lower-bound', got {options.acquisition!r}")
    if options.max_wait is not None and not options.watch:
        raise ValueError(
            "max_wait (--max-wait) needs watch (--watch): without it the sweep ends once the checkpoints there are scored"
        )
    if options.revisions is not None:
        check_revision_pattern(options.revisions)
    if options.revisions and options.watch:
        raise ValueError("watch (--watch) polls a run folder; a sweep over Hub revisions (--revisions) scores those listed")
    if not options.revisions and (options.x or options.results or not options.keep_downloads):
        raise ValueError("x, results and keep_downloads (--x, --results, --keep-downloads) go with revisions (--revisions)")
    if options.revisions:
        check_repo_id(str(source))
    # Fails early on a missing folder or a step claimed twice; and on a folder without checkpoints, unless watching for them.
    elif not find_checkpoints(source) and not options.watch:
        raise SweepError(no_checkpoints_message(source))
    if options.device_map and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise ValueError("device_map spreads one model over every device: sweep on one process, or drop device_map")
    from .sweep_processes import SweepProcesses

    processes = SweepProcesses()
    try:
        device = processes.device(options.device)
        if options.revisions:
            series = RevisionSeries(str(source), options, device)
        else:
            series = _RunFolder(Path(source), options, device)
        try:
            with sole_writer(series.results_path) if processes.is_first else contextlib.nullcontext() as busy:
                busy = processes.from_first(busy)  # process 0's answer, on every process
                if busy:
                    raise SweepError(busy)
                report = _sweep(series, options, read_records(series.results_path), processes)
        except BaseException:
            series.close(wait=False)  # Ctrl-C, an error: not held up by a download
            raise
        series.close(wait=True)
    finally:
        processes.close()
    report.acquisition = acquisition_steps(
        history_from_records(report.records), options.threshold, use_lower_bound=options.acquisition == "lower-bound"
    )
    return report


def check_revision_pattern(pattern: str) -> None:
    """ValueError for a ``revisions`` pattern that names nothing (``''``) or holds a glob that cannot be read
    (``'step['``: a ``[`` without its ``]``), before any Hub repository or run folder is looked at."""
    items = [item.strip() for item in pattern.split(",")]
    if not any(items):
        raise ValueError(f"--revisions {pattern!r} names no revision: give names or globs, e.g. --revisions 'step*'")
    for item in items:
        if re.search(r"\[(?![^\]]*\])", item.replace("[]]", "")):  # fnmatch would take the [ as a plain character
            raise ValueError(
                f"--revisions {pattern!r}: the pattern {item!r} is malformed, a [ without its ] (a set of characters "
                "is [0-9]; the globs are * and ?)"
            )


class _RunFolder:
    """A training run's folder as a sweep's checkpoints: polled until complete (``revision_sweep.RevisionSeries``
    is the other kind, a Hub repository's revisions)."""

    axis = "step"

    def __init__(self, run_dir: Path, options: SweepOptions, device: str | None):
        self.run_dir = run_dir
        self.options = options
        self.results_path = run_dir / RESULTS_FILE
        self.failures_path = run_dir / FAILURES_FILE
        self.wandb_config = {"tatblimp_sweep_dir": str(run_dir)}
        self.watcher = CheckpointWatcher(run_dir, options.poll_interval)
        self.scorer = CheckpointScorer(run_dir, options, device)

    def poll(self, done: set[str], settled: bool, report: SweepReport) -> tuple[list, list[str], bool]:
        """(checkpoints to score, those not complete yet, whether to wait an interval first); on process 0 only."""
        ready, pending = self.watcher.poll()
        # One-shot: a checkpoint with weights but no trainer_state.json gets one interval to prove it is finished.
        settle = not self.options.watch and not settled and any(has_weights(c.path) for c in pending)
        # Saved again since its line was written (a new run into the same folder): scored again, its new line the one read
        last = {record["checkpoint"]: record.get("weights_files") for record in report.records}
        rewritten = {c.name for c in ready if last.get(c.name) not in (None, weights_identity(c.path))} - set(report.failed)
        report.rewritten = sorted({*report.rewritten, *rewritten})
        # In the results file before this call: not scored now, nor failed now (``done`` holds those too).
        report.skipped = sorted({c.name for c in ready if c.name in done} - {*report.scored, *report.failed, *rewritten})
        return [c for c in ready if c.name not in done or c.name in rewritten], [c.name for c in pending], settle

    def begin(self, mine: list) -> None:
        """The checkpoints this process will score, in order (a run folder's need nothing fetched ahead)."""

    def score(self, checkpoint) -> tuple[str, Any]:
        return score_or_failure(self.scorer, checkpoint)

    def close(self, wait: bool) -> None:
        pass


def _waiting_line(run_dir: Path, options: SweepOptions, incomplete: list[str]) -> str:
    """What a watching sweep waits for, said once when it has nothing to score."""
    line = f"tatblimp sweep: watching {run_dir} for new checkpoints (every {options.poll_interval:g} s"
    line += f"; stops after {options.max_wait:g} s without one)" if options.max_wait is not None else "; Ctrl-C stops)"
    return line + (f"; not complete yet: {', '.join(incomplete)}" if incomplete else "")


def _poll(source: Any, done: set[str], settled: bool, report: SweepReport) -> tuple | SweepError:
    try:
        return source.poll(done, settled, report)
    except SweepError as error:  # two checkpoints with one step, no such revision, ...
        return error


def _sweep(source: Any, options: SweepOptions, records: list[dict[str, Any]], processes: SweepProcesses) -> SweepReport:
    from tqdm.auto import tqdm

    first = processes.is_first
    results_path = source.results_path
    done = {record["checkpoint"] for record in records}
    report = SweepReport(results_path=results_path, records=records, failures_path=source.failures_path)
    check_same_files(records, source.scorer.benchmark, source.scorer.suites, results_path)
    wandb_logger = (
        _WandbLogger(options, source.wandb_config) if first and (options.wandb_project or options.wandb_run_id) else None
    )
    bar = None
    last_new = time.monotonic()
    settled = said_waiting = False
    try:
        while True:
            polled = _poll(source, done, settled, report) if first else None
            polled = processes.from_first(polled)  # an error too, so that no process waits for process 0
            if isinstance(polled, SweepError):
                raise polled
            todo, report.incomplete, settle = polled
            if settle:
                settled = True
                time.sleep(options.poll_interval)
                continue
            if todo and bar is None:
                show = options.progress and first
                bar = tqdm(total=len(todo), desc="tatblimp sweep", unit="ckpt", disable=not show, file=sys.stderr)
            elif todo:
                bar.total = len(report.scored) + len(report.failed) + len(todo)
                bar.refresh()
            source.begin([mine for mine in processes.rounds(todo) if mine is not None])
            for mine in processes.rounds(todo):
                outcome = source.score(mine) if mine is not None else None
                outcomes = processes.gather((mine, outcome))
                stop = None
                for checkpoint, (kind, value) in sorted((o for o in outcomes or () if o[0] is not None), key=lambda o: o[0].step):
                    if kind == "stop":  # written after the round's other checkpoints, then every process stops
                        stop = stop or value["error"]
                    elif kind == "scored" and (mixed := other_settings(records, value, results_path)):
                        stop = stop or mixed  # not written: the lines before keep one setting
                    elif kind == "scored":
                        append_sweep_record(results_path, value)
                        drop_records(
                            source.failures_path, lambda failure, name=checkpoint.name: failure.get("checkpoint") == name
                        )
                        records.append(value)
                        done.add(checkpoint.name)
                        report.scored.append(checkpoint.name)
                        if wandb_logger:
                            wandb_logger.log(value)
                        bar.write(
                            f"{source.axis} {readable(value['step'], source.axis):>8}  acc {value['acc']:.4f}  acc_norm {value['acc_norm']:.4f}  "
                            f"({checkpoint.name})"
                        )
                    elif kind == "failed":
                        append_sweep_record(
                            source.failures_path, {"step": checkpoint.step, "checkpoint": checkpoint.name, **value}
                        )
                        done.add(checkpoint.name)  # not again in this run; the next run tries it again
                        report.failed[checkpoint.name] = value["error"]
                        bar.write(
                            f"{source.axis} {readable(checkpoint.step, source.axis):>8}  FAILED: {value['error']}  ({checkpoint.name})"
                        )
                    else:
                        report.vanished.append(checkpoint.name)
                        logger.warning("tatblimp: %s was deleted before it could be scored", checkpoint.name)
                    if kind != "stop":
                        bar.update(1)
                stop = processes.from_first(stop)
                if stop is not None:
                    raise SweepError(stop)
                last_new = time.monotonic()
            stop = not options.watch or (options.max_wait is not None and time.monotonic() - last_new >= options.max_wait)
            if processes.from_first(stop):
                break
            if first and options.progress and not todo and not said_waiting:  # once: what the silence is
                tqdm.write(_waiting_line(source.run_dir, options, report.incomplete), file=sys.stderr)
                said_waiting = True
            time.sleep(options.poll_interval)
    except KeyboardInterrupt:
        if not options.watch:
            raise
        report.interrupted = True
    finally:
        if bar is not None:
            bar.close()
    report.records = sorted(without_replaced(records), key=lambda record: record["step"])
    report = processes.from_first(report)  # process 0 holds what every process scored
    if wandb_logger:
        wandb_logger.finish(
            acquisition_steps(
                history_from_records(report.records),
                options.threshold,
                use_lower_bound=options.acquisition == "lower-bound",
            )
        )
    if report.incomplete and first:
        named = ", ".join(_incomplete(source, name) for name in report.incomplete)
        logger.warning("tatblimp: %d checkpoint(s) not complete yet, not scored: %s", len(report.incomplete), named)
    return report


def _incomplete(source: Any, name: str) -> str:
    """A checkpoint of a run folder left unscored, with why: no weights file (a save under way, or one that failed),
    or files that were still changing."""
    run_dir = getattr(source, "run_dir", None)
    if run_dir is None:
        return name
    return f"{name} ({'no weights file yet' if not has_weights(run_dir / name) else 'its files were still changing'})"


# -- the command ----------------------------------------------------------------------------------


def add_sweep_parser(commands) -> None:
    """Add ``tatblimp sweep`` to the CLI's sub-commands."""
    parser = commands.add_parser(
        "sweep", help="score every checkpoint of a run folder into RUN_DIR/tatblimp.jsonl, or a Hub repository's revisions"
    )
    parser.add_argument(
        "run_dir",
        help="folder with checkpoint-<step> (or step_<step>, ckpt<step>, ...) sub-folders; with --revisions, a Hub model id",
    )
    add_model_arguments(parser)
    parser.add_argument("--include-pairs", action="store_true", help="keep the per-pair list in each JSONL line")
    add_suite_arguments(parser, suites_only=False)
    parser.add_argument("--watch", action="store_true", help="keep polling for new checkpoints (stop: Ctrl-C or --max-wait)")
    parser.add_argument("--interval", type=non_negative_float, help="seconds between polls (default: 30 with --watch, else 5)")
    parser.add_argument(
        "--max-wait", type=non_negative_float, help="with --watch: stop after this many seconds without a new checkpoint"
    )
    add_acquisition_arguments(parser)
    parser.add_argument("--wandb-project", help="log the curves to this wandb project")
    parser.add_argument("--wandb-run-id", help="resume this wandb run (e.g. the training run)")
    parser.add_argument("--wandb-entity", help="wandb entity of the project")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    add_revision_arguments(parser)
    parser.set_defaults(run=run_sweep)


def run_sweep(args: argparse.Namespace) -> None:
    placement = placement_options(args)
    options = SweepOptions(**{f.name: getattr(args, f.name) for f in fields(SweepOptions) if hasattr(args, f.name)})
    options.max_memory = placement["max_memory"]
    options.vllm_options = backend_options(args).get("vllm_options")
    if options.revisions:  # the results file is written after the first model loads: checked before it
        check_output_file(options.results or default_results_path(args.run_dir), "--results", appends=True)
    elif Path(args.run_dir).is_dir():
        check_output_file(Path(args.run_dir) / RESULTS_FILE, "the results file", appends=True)
    report = sweep(args.run_dir, options)
    if int(os.environ.get("RANK", 0)) != 0:
        return  # process 0 reports for all
    if not options.revisions and (
        not report.records and not report.incomplete and not report.vanished and not report.failed
    ):  # --watch ended and none ever came
        raise SweepError(no_checkpoints_message(args.run_dir))
    kind = "revision(s)" if options.revisions else "checkpoint(s)"
    say(
        f"{len(report.scored)} {kind} scored, {len(report.skipped)} already in {report.results_path}"
        + (f", {len(report.incomplete)} not complete" if report.incomplete else "")
        + (f", {len(report.vanished)} deleted before scoring" if report.vanished else "")
        + (
            f" ({len(report.rewritten)} saved again since, scored again: {', '.join(report.rewritten)})"
            if report.rewritten
            else ""
        )
        + (f", {len(report.failed)} failed" if report.failed else "")
        + (" (interrupted)" if report.interrupted else "")
    )
    for line in revision_summary(report):
        say(line)
    if report.acquisition:
        width = max(len(name) for name in report.acquisition)
        what = "acc_norm" if options.acquisition == "estimate" else "acc_norm's 95% lower bound"
        axis = report.records[-1].get("x", "step") if report.records else "step"
        say(f"acquisition {axis} ({what} >= {options.threshold} through the last {kind[:-3]}):")
        for name, step in report.acquisition.items():
            say(f"  {name:<{width}}  {readable(step, axis) if step is not None else 'never'}")
    if report.failed:
        for error in report.failed.values():
            print(f"  failed: {error}", file=sys.stderr)
        raise SweepError(
            f"{len(report.failed)} {kind} could not be scored: {', '.join(report.failed)} "
            f"(see {report.failures_path}; a rerun tries them again)"
        )
