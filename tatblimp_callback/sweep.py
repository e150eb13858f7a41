"""Score the checkpoints a training run saved to disk: ``tatblimp sweep RUN_DIR``.

Checkpoints (``checkpoints.py``: what counts as one, and when one is complete) are
scored in step order and each result is appended, as one JSON line, to ``RUN_DIR/tatblimp.jsonl``;
checkpoints already in that file are skipped, so a sweep can be stopped and run again.

With ``watch`` the folder is polled until ``max_wait`` seconds pass without a new checkpoint, or Ctrl-C.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .checkpoints import Checkpoint, CheckpointWatcher, SweepError, find_checkpoints, has_weights
from .curves import DEFAULT_THRESHOLD, acquisition_steps, add_acquisition_arguments, flat_record, history_from_records
from .loading import TOKENIZER_FILES, add_model_arguments, load_model, load_tokenizer
from .suites import Suite, add_suite_arguments, load_suite, suites_from_args

logger = logging.getLogger(__name__)

RESULTS_FILE = "tatblimp.jsonl"
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
    """Device to score on; None: cuda if available, else cpu."""

    dtype: str = "float32"
    """Weights dtype: auto, float32, bfloat16 or float16."""

    memory_budget_mb: int | None = None
    """Extra memory (MiB) one evaluation may use; None: from free device memory."""

    truncate: bool = False
    """Cut sentences longer than the model's context instead of failing."""

    suites: dict[str, Any] | None = None
    """More suites scored in the same pass, ``{name: path or suites.Suite}``; each line gets ``"suites": {name: ...}``."""

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
    acquisition: dict[str, int | None] = field(default_factory=dict)
    interrupted: bool = False


def read_records(path: Path) -> list[dict[str, Any]]:
    """The lines of a sweep results file (empty if it does not exist)."""
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise SweepError(f"{path}:{number}: not a JSON line ({err.msg}); fix or remove the line") from None
        if not isinstance(record, dict) or "checkpoint" not in record or "step" not in record:
            raise SweepError(f"{path}:{number}: not a sweep record (needs 'checkpoint' and 'step')")
        records.append(record)
    return records


def _append_record(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


class _CheckpointScorer:
    """Loads and scores checkpoints; tokenizes the benchmark once per distinct tokenizer."""

    def __init__(self, run_dir: Path, options: SweepOptions):
        from .data import load_benchmark

        self.run_dir = run_dir
        self.options = options
        self.benchmark = load_benchmark(options.data, allow_modified=options.allow_modified)
        self._tokenizers: dict[str, tuple[Any, int | None]] = {}  # files key -> (tokenizer, mismatches)
        self._caches: dict[str, Any] = {}  # files key -> SentenceCache
        self._evaluators: dict[str, Any] = {}  # files key -> Evaluator, when suites share its cache
        self.suites = {name: s if isinstance(s, Suite) else load_suite(name, s) for name, s in (options.suites or {}).items()}

    def score(self, checkpoint: Checkpoint) -> dict[str, Any]:
        from .evaluation import Evaluator

        key, tokenizer, mismatches = self._tokenizer_for(checkpoint.path)
        with _quiet_transformers():  # its per-load progress bars would break the sweep's own
            model = load_model(str(checkpoint.path), self.options.device, self.options.dtype)
        budget = self.options.memory_budget_mb
        evaluator = self._evaluators.get(key) or Evaluator(
            tokenizer,
            self.benchmark,
            cache=None if self.suites else self._caches.get(key),
            prefix_token_id=self.options.prefix_token_id,
            allow_modified=self.options.allow_modified,
            memory_budget=budget * 2**20 if budget else None,
            truncate=self.options.truncate,
            suites=self.suites,
        )
        try:
            results = evaluator(model)
        finally:
            evaluator._scorer = None  # holds the model: freed before the next checkpoint loads
        if self.suites:
            self._evaluators[key] = evaluator
        else:
            self._caches[key] = evaluator.cache
        record = {"step": checkpoint.step, "checkpoint": checkpoint.name, **results.to_dict(), "model": str(checkpoint.path)}
        if mismatches is not None:
            record["sentencepiece_mismatches"] = mismatches
        if not self.options.include_pairs:
            record.pop("pairs")
            for suite in record.get("suites", {}).values():
                suite.pop("pairs")
        return record

    def _tokenizer_for(self, path: Path) -> tuple[str, Any, int | None]:
        from .tokenization import check_sentencepiece_mismatch

        source = self.options.tokenizer or _tokenizer_folder(path, self.run_dir)
        key = _files_key(Path(source))
        if key not in self._tokenizers:
            tokenizer = load_tokenizer(source)
            mismatches = None
            if Path(source).is_dir():
                mismatches = check_sentencepiece_mismatch(source, tokenizer, self.benchmark.sentences)
            self._tokenizers[key] = (tokenizer, mismatches)
        return (key, *self._tokenizers[key])


@contextmanager
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _tokenizer_folder(checkpoint: Path, run_dir: Path) -> str:
    for folder in (checkpoint, run_dir):
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            return str(folder)
    raise SweepError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {checkpoint} or {run_dir}; pass --tokenizer")


def _files_key(source: Path) -> str:
    """Identifies a tokenizer by the content of its files, so identical copies share one cache."""
    if not source.is_dir():
        return f"{source.resolve()}" if source.exists() else str(source)
    digest = hashlib.sha256()
    for name in sorted(os.listdir(source)):
        if name.startswith(("tokenizer", "special_tokens_map", "vocab", "merges", "added_tokens")):
            digest.update(name.encode() + b"\0" + (source / name).read_bytes())
    return digest.hexdigest()


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
        self.run.define_metric("tatblimp/*", step_metric="train/global_step", step_sync=True)

    def log(self, record: dict[str, Any]) -> None:
        flat = {k: v for k, v in flat_record(record, phenomenon_intervals=False).items() if k != "step"}
        self.run.log({**flat, "train/global_step": record["step"]})

    def finish(self, acquisition: dict[str, int | None]) -> None:
        for name, step in acquisition.items():
            self.run.summary[f"tatblimp/acquisition/{name}"] = "never" if step is None else step  # wandb drops None
        self.run.finish()


def sweep(run_dir: str | os.PathLike, options: SweepOptions | None = None) -> SweepReport:
    """Score every complete, not yet scored checkpoint of ``run_dir`` and append to its ``tatblimp.jsonl``."""
    from tqdm.auto import tqdm

    options = options or SweepOptions()
    if options.acquisition not in ("estimate", "lower-bound"):
        raise ValueError(f"acquisition must be 'estimate' or 'lower-bound', got {options.acquisition!r}")
    run_dir = Path(run_dir)
    find_checkpoints(run_dir)  # fails early on a missing folder or a step claimed twice
    results_path = run_dir / RESULTS_FILE
    records = read_records(results_path)
    done = {record["checkpoint"] for record in records}
    report = SweepReport(results_path=results_path, records=records)
    watcher = CheckpointWatcher(run_dir, options.poll_interval)
    scorer = _CheckpointScorer(run_dir, options)
    wandb_logger = _WandbLogger(options, run_dir) if options.wandb_project or options.wandb_run_id else None
    bar = None
    last_new = time.monotonic()
    settled = False
    try:
        while True:
            ready, pending = watcher.poll()
            todo = [c for c in ready if c.name not in done]
            report.skipped = sorted({c.name for c in ready if c.name in done} - set(report.scored))
            # One-shot: a checkpoint with weights but no trainer_state.json gets one interval to prove it is finished.
            if not options.watch and not settled and any(has_weights(c.path) for c in pending):
                settled = True
                time.sleep(options.poll_interval)
                continue
            if todo and bar is None:
                bar = tqdm(total=len(todo), desc="tatblimp sweep", unit="ckpt", disable=not options.progress, file=sys.stderr)
            elif todo:
                bar.total = len(report.scored) + len(todo)
                bar.refresh()
            for checkpoint in todo:
                record = _score_or_skip_vanished(scorer, checkpoint, report)
                if record is None:
                    continue
                _append_record(results_path, record)
                records.append(record)
                done.add(checkpoint.name)
                report.scored.append(checkpoint.name)
                if wandb_logger:
                    wandb_logger.log(record)
                bar.update(1)
                bar.write(
                    f"step {record['step']:>8}  acc {record['acc']:.4f}  acc_norm {record['acc_norm']:.4f}  ({checkpoint.name})"
                )
                last_new = time.monotonic()
            report.incomplete = [c.name for c in pending]
            if not options.watch or (options.max_wait is not None and time.monotonic() - last_new >= options.max_wait):
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
    report.acquisition = acquisition_steps(
        history_from_records(report.records), options.threshold, use_lower_bound=options.acquisition == "lower-bound"
    )
    if wandb_logger:
        wandb_logger.finish(report.acquisition)
    if report.incomplete:
        logger.warning(
            "tatblimp: %d checkpoint(s) not complete yet, not scored: %s", len(report.incomplete), ", ".join(report.incomplete)
        )
    return report


def _score_or_skip_vanished(scorer: _CheckpointScorer, checkpoint: Checkpoint, report: SweepReport):
    try:
        return scorer.score(checkpoint)
    except (OSError, ValueError):
        if checkpoint.path.exists():
            raise
        # The Trainer's save_total_limit deleted it while we waited or loaded: nothing to score.
        report.vanished.append(checkpoint.name)
        logger.warning("tatblimp: %s was deleted before it could be scored", checkpoint.name)
        return None


# -- the command ----------------------------------------------------------------------------------


def add_sweep_parser(commands) -> None:
    """Add ``tatblimp sweep`` to the CLI's sub-commands."""
    parser = commands.add_parser("sweep", help="score every checkpoint of a run folder into RUN_DIR/tatblimp.jsonl")
    parser.add_argument("run_dir", help="folder with checkpoint-<step> (or other *<step>) sub-folders")
    add_model_arguments(parser)
    add_suite_arguments(parser)
    parser.add_argument("--include-pairs", action="store_true", help="keep the per-pair list in each JSONL line")
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
    names = {f.name for f in fields(SweepOptions) if f.name != "suites"}
    options = SweepOptions(**{name: getattr(args, name) for name in names if hasattr(args, name)}, suites=suites_from_args(args))
    if args.suites_only:
        raise ValueError("sweep scores TatBLiMP with the suites; --suites-only is for score")
    report = sweep(args.run_dir, options)
    print(
        f"{len(report.scored)} checkpoint(s) scored, {len(report.skipped)} already in {report.results_path}"
        + (f", {len(report.incomplete)} not complete" if report.incomplete else "")
        + (f", {len(report.vanished)} deleted before scoring" if report.vanished else "")
        + (" (interrupted)" if report.interrupted else "")
    )
    if report.acquisition:
        width = max(len(name) for name in report.acquisition)
        what = "acc_norm" if options.acquisition == "estimate" else "acc_norm's 95% lower bound"
        print(f"acquisition step ({what} >= {options.threshold} through the last checkpoint):")
        for name, step in report.acquisition.items():
            print(f"  {name:<{width}}  {step if step is not None else '-'}")
