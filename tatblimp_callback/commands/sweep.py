"""Score the checkpoints a training run saved to disk: ``tatblimp sweep RUN_DIR``.

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
import logging
import os
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..reading.suites import add_suite_arguments, parse_suite_option
from ..results.curves import DEFAULT_THRESHOLD, acquisition_steps, add_acquisition_arguments, flat_record, history_from_records
from .backends import backend_options
from .checkpoint_scoring import CheckpointScorer, score_or_failure
from .checkpoints import CheckpointWatcher, SweepError, find_checkpoints, has_weights, no_checkpoints_message
from .loading import add_model_arguments
from .outputs import say
from .placement import placement_options
from .sweep_records import append_sweep_record, check_same_files, read_records

if TYPE_CHECKING:  # torch.distributed comes with it: imported when a sweep runs, not for `tatblimp sweep --help`
    from .sweep_processes import SweepProcesses

logger = logging.getLogger(__name__)

RESULTS_FILE = "tatblimp.jsonl"
FAILURES_FILE = "tatblimp-failures.jsonl"
WATCH_INTERVAL = 30.0
SETTLE_INTERVAL = 5.0


@dataclass
class SweepOptions:
    """How ``sweep`` finds, loads and scores checkpoints (the ``tatblimp sweep`` options)."""

    data: str | None = None
    """Benchmark JSONL; None: ``$TATBLIMP_DATA``, else the Hub dataset."""

    allow_modified: bool = False
    """Accept a benchmark file that is not the official release."""

    tokenizer: str | None = None
    """Tokenizer folder or raw SentencePiece ``.model`` for every checkpoint; None: each checkpoint's
    own tokenizer files, else those in the run folder."""

    prefix_token_id: int | None = None
    """Token put before each sentence; None: BOS, else EOS."""

    device: str | None = None
    """Device to score on; None: cuda if available (under torchrun ``LOCAL_RANK``'s GPU), else cpu."""

    device_map: str | None = None
    """accelerate's big-model dispatch ("auto", "balanced", "sequential") instead of ``device``; one process only."""

    max_memory: dict | None = None
    """With ``device_map``: the most weights per device, e.g. ``{0: "70GiB", "cpu": "200GiB"}``."""

    offload_folder: str | None = None
    """With ``device_map``: where the weights that fit on no device go."""

    trust_remote_code: bool = False
    """Run the Python files of a checkpoint with a custom architecture (code from the model's author)."""

    attn_implementation: str | None = None
    """The attention kernel ("eager", "sdpa", ...); None: the model's."""

    dtype: str = "float32"
    """Weights dtype: auto, float32, bfloat16 or float16."""

    memory_budget_mb: int | None = None
    """Extra memory (MiB) one evaluation may use; None: from free device memory."""

    truncate: bool = False
    """Cut sentences longer than the model's context instead of failing."""

    suite: list[str] = field(default_factory=list)
    """More suites scored in the same pass, ``NAME=PATH`` each (as ``score --suite``); each record gets
    ``"suites": {name: results}``. A results file holds one set of suites: a rerun with others is refused."""

    columns: list[str] = field(default_factory=list)
    """``[NAME:]good=COL,bad=COL,...``: where a suite's fields are, for layouts not detected (as ``score --columns``)."""

    include_pairs: bool = False
    """Keep the per-pair list (as in ``score --output``) in each JSONL line; off to keep lines small."""

    watch: bool = False
    """Keep polling for new checkpoints while a training job writes them."""

    interval: float | None = None
    """Seconds between polls; a checkpoint without ``trainer_state.json`` must stay unchanged this long.
    None: 30 with ``watch``, 5 otherwise."""

    max_wait: float | None = None
    """With ``watch``: stop after this many seconds without a new complete checkpoint; None: until Ctrl-C."""

    threshold: float = DEFAULT_THRESHOLD
    """acc_norm a phenomenon must reach and keep to count as acquired."""

    acquisition: str = "estimate"
    """What must stay at or above ``threshold``: "estimate" (acc_norm) or "lower-bound" (its 95% interval's low end)."""

    wandb_project: str | None = None
    """Log the curves to this wandb project (over ``train/global_step``)."""

    wandb_run_id: str | None = None
    """Resume this existing wandb run (e.g. the training run) instead of starting a new one."""

    wandb_entity: str | None = None
    """wandb entity (user or team) of the project."""

    progress: bool = True
    """Show a progress bar with an ETA on stderr."""

    backend: str = "transformers"
    """What scores each checkpoint: "transformers" (loaded in this process) or "vllm" (one engine per checkpoint,
    shut down before the next starts)."""

    vllm_options: Any = None
    """With ``backend="vllm"``: the engines' ``vllm_scoring.VllmOptions``; None: its defaults."""

    @property
    def poll_interval(self) -> float:
        if self.interval is not None:
            return self.interval
        return WATCH_INTERVAL if self.watch else SETTLE_INTERVAL


@dataclass
class SweepReport:
    """What one ``sweep`` call did."""

    results_path: Path
    records: list[dict[str, Any]]  # every line of the results file, old and new, in step order
    scored: list[str] = field(default_factory=list)  # checkpoints scored by this call
    skipped: list[str] = field(default_factory=list)  # already in the results file
    incomplete: list[str] = field(default_factory=list)  # not complete when the sweep ended
    vanished: list[str] = field(default_factory=list)  # deleted (checkpoint rotation) before being read
    failed: dict[str, str] = field(default_factory=dict)  # checkpoint -> why it could not be loaded or scored
    acquisition: dict[str, int | None] = field(default_factory=dict)
    interrupted: bool = False


class _WandbLogger:
    def __init__(self, options: SweepOptions, run_dir: Path):
        import wandb

        self.run = wandb.init(
            project=options.wandb_project,
            entity=options.wandb_entity,
            id=options.wandb_run_id,
            resume="allow" if options.wandb_run_id else None,
            job_type="tatblimp-sweep",
            config={"tatblimp_sweep_dir": str(run_dir)},
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


def sweep(run_dir: str | os.PathLike, options: SweepOptions | None = None) -> SweepReport:
    """Score every complete, not yet scored checkpoint of ``run_dir`` and append to its ``tatblimp.jsonl``.

    Under torchrun every process calls this; the checkpoints are shared out (``sweep_processes``) and
    every process returns the same report.

    Args:
        run_dir: the training run's folder, with ``checkpoint-<step>`` (or other ``*<step>``) sub-folders.
        options: how to find, load and score them (default ``SweepOptions()``).

    Returns:
        What was scored, skipped, failed, and every record of the results file in step order.

    Raises:
        SweepError: no such folder, two checkpoints with one step, or a bad line in the results file.
        ValueError: options that do not go together.
    """
    options = options or SweepOptions()
    if options.acquisition not in ("estimate", "lower-bound"):
        raise ValueError(f"acquisition must be 'estimate' or 'lower-bound', got {options.acquisition!r}")
    if options.max_wait is not None and not options.watch:
        raise ValueError(
            "max_wait (--max-wait) needs watch (--watch): without it the sweep ends once the checkpoints there are scored"
        )
    run_dir = Path(run_dir)
    # Fails early on a missing folder or a step claimed twice; and on a folder without checkpoints, unless watching for them.
    if not find_checkpoints(run_dir) and not options.watch:
        raise SweepError(no_checkpoints_message(run_dir))
    records = read_records(run_dir / RESULTS_FILE)
    if options.device_map and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise ValueError("device_map spreads one model over every device: sweep on one process, or drop device_map")
    from .sweep_processes import SweepProcesses

    processes = SweepProcesses()
    try:
        report = _sweep(run_dir, options, records, processes)
    finally:
        processes.close()
    report.acquisition = acquisition_steps(
        history_from_records(report.records), options.threshold, use_lower_bound=options.acquisition == "lower-bound"
    )
    return report


def _sweep(run_dir: Path, options: SweepOptions, records: list[dict[str, Any]], processes: SweepProcesses) -> SweepReport:
    from tqdm.auto import tqdm

    first = processes.is_first
    results_path = run_dir / RESULTS_FILE
    done = {record["checkpoint"] for record in records}
    report = SweepReport(results_path=results_path, records=records)
    watcher = CheckpointWatcher(run_dir, options.poll_interval)
    scorer = CheckpointScorer(run_dir, options, processes.device(options.device))
    check_same_files(records, scorer.benchmark, scorer.suites, results_path)
    wandb_logger = _WandbLogger(options, run_dir) if first and (options.wandb_project or options.wandb_run_id) else None
    bar = None
    last_new = time.monotonic()
    settled = False
    try:
        while True:
            poll = None
            if first:
                ready, pending = watcher.poll()
                # One-shot: a checkpoint with weights but no trainer_state.json gets one interval to prove it is finished.
                settle = not options.watch and not settled and any(has_weights(c.path) for c in pending)
                poll = ([c for c in ready if c.name not in done], [c.name for c in pending], settle)
                # In the results file before this call: not scored now, nor failed now (``done`` holds those too).
                report.skipped = sorted({c.name for c in ready if c.name in done} - {*report.scored, *report.failed})
            todo, report.incomplete, settle = processes.from_first(poll)
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
            for mine in processes.rounds(todo):
                outcome = score_or_failure(scorer, mine) if mine is not None else None
                outcomes = processes.gather((mine, outcome))
                stop = None
                for checkpoint, (kind, value) in sorted((o for o in outcomes or () if o[0] is not None), key=lambda o: o[0].step):
                    if kind == "stop":  # written after the round's other checkpoints, then every process stops
                        stop = stop or value["error"]
                    elif kind == "scored":
                        append_sweep_record(results_path, value)
                        records.append(value)
                        done.add(checkpoint.name)
                        report.scored.append(checkpoint.name)
                        if wandb_logger:
                            wandb_logger.log(value)
                        bar.write(
                            f"step {value['step']:>8}  acc {value['acc']:.4f}  acc_norm {value['acc_norm']:.4f}  ({checkpoint.name})"
                        )
                    elif kind == "failed":
                        append_sweep_record(
                            run_dir / FAILURES_FILE, {"step": checkpoint.step, "checkpoint": checkpoint.name, **value}
                        )
                        done.add(checkpoint.name)  # not again in this run; the next run tries it again
                        report.failed[checkpoint.name] = value["error"]
                        bar.write(f"step {checkpoint.step:>8}  FAILED: {value['error']}  ({checkpoint.name})")
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
            time.sleep(options.poll_interval)
    except KeyboardInterrupt:
        if not options.watch:
            raise
        report.interrupted = True
    finally:
        if bar is not None:
            bar.close()
    report.records = sorted(records, key=lambda record: record["step"])
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
        logger.warning(
            "tatblimp: %d checkpoint(s) not complete yet, not scored: %s", len(report.incomplete), ", ".join(report.incomplete)
        )
    return report


# -- the command ----------------------------------------------------------------------------------


def add_sweep_parser(commands) -> None:
    """Add ``tatblimp sweep`` to the CLI's sub-commands."""
    parser = commands.add_parser("sweep", help="score every checkpoint of a run folder into RUN_DIR/tatblimp.jsonl")
    parser.add_argument("run_dir", help="folder with checkpoint-<step> (or step_<step>, ckpt<step>, ...) sub-folders")
    add_model_arguments(parser)
    parser.add_argument("--include-pairs", action="store_true", help="keep the per-pair list in each JSONL line")
    add_suite_arguments(parser, suites_only=False)
    parser.add_argument("--watch", action="store_true", help="keep polling for new checkpoints (stop: Ctrl-C or --max-wait)")
    parser.add_argument("--interval", type=float, help="seconds between polls (default: 30 with --watch, else 5)")
    parser.add_argument("--max-wait", type=float, help="with --watch: stop after this many seconds without a new checkpoint")
    add_acquisition_arguments(parser)
    parser.add_argument("--wandb-project", help="log the curves to this wandb project")
    parser.add_argument("--wandb-run-id", help="resume this wandb run (e.g. the training run)")
    parser.add_argument("--wandb-entity", help="wandb entity of the project")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.set_defaults(run=run_sweep)


def run_sweep(args: argparse.Namespace) -> None:
    placement = placement_options(args)
    options = SweepOptions(**{f.name: getattr(args, f.name) for f in fields(SweepOptions) if hasattr(args, f.name)})
    options.max_memory = placement["max_memory"]
    options.vllm_options = backend_options(args).get("vllm_options")
    report = sweep(args.run_dir, options)
    if int(os.environ.get("RANK", 0)) != 0:
        return  # process 0 reports for all
    if (
        not report.records and not report.incomplete and not report.vanished and not report.failed
    ):  # --watch ended and none ever came
        raise SweepError(no_checkpoints_message(args.run_dir))
    say(
        f"{len(report.scored)} checkpoint(s) scored, {len(report.skipped)} already in {report.results_path}"
        + (f", {len(report.incomplete)} not complete" if report.incomplete else "")
        + (f", {len(report.vanished)} deleted before scoring" if report.vanished else "")
        + (f", {len(report.failed)} failed" if report.failed else "")
        + (" (interrupted)" if report.interrupted else "")
    )
    if report.acquisition:
        width = max(len(name) for name in report.acquisition)
        what = "acc_norm" if options.acquisition == "estimate" else "acc_norm's 95% lower bound"
        say(f"acquisition step ({what} >= {options.threshold} through the last checkpoint):")
        for name, step in report.acquisition.items():
            say(f"  {name:<{width}}  {step if step is not None else 'never'}")
    if report.failed:
        for error in report.failed.values():
            print(f"  failed: {error}", file=sys.stderr)
        raise SweepError(
            f"{len(report.failed)} checkpoint(s) could not be scored: {', '.join(report.failed)} "
            f"(see {Path(args.run_dir) / FAILURES_FILE}; a rerun tries them again)"
        )
