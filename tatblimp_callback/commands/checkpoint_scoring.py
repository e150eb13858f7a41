"""Loading and scoring one checkpoint of a sweep, and what becomes of one that cannot be scored.

A checkpoint that fails to load or score (a damaged ``model.safetensors``, a missing tokenizer, ...)
becomes a "failed" outcome that names it, so that the sweep goes on with the others; one that the
Trainer's checkpoint rotation deleted meanwhile is "vanished".
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from .adapters import adapter_base_model, is_adapter_folder
from .checkpoints import Checkpoint, SweepError, weights_identity
from .loading import TOKENIZER_FILES, load_model, load_tokenizer

logger = logging.getLogger(__name__)


class CheckpointScorer:
    """Loads and scores checkpoints; tokenizes the benchmark once per distinct tokenizer."""

    def __init__(self, run_dir: Path, options: Any, device: str | None):
        """``options``: the sweep's ``SweepOptions``; ``device``: where this process scores (None: the loader's default)."""
        from ..reading.data import load_benchmark
        from ..reading.suites import suites_from_args

        self.run_dir = run_dir
        self.options = options
        self.device = device
        self.benchmark = load_benchmark(options.data, allow_modified=options.allow_modified)
        self.suites = suites_from_args(options)  # --suite/--columns, read once for every checkpoint
        self._tokenizers: dict[str, tuple[Any, int | None]] = {}  # files key -> (tokenizer, mismatches)
        self._evaluators: dict[str, Any] = {}  # files key -> Evaluator (its cache holds TatBLiMP and the suites)
        if options.tokenizer:
            self._tokenizer_for(run_dir)  # a wrong --tokenizer is the sweep's error, not each checkpoint's

    @property
    def tokenizers_loaded(self) -> int:
        """How many distinct tokenizers (by the content of their files) were loaded so far."""
        return len(self._tokenizers)

    def score(self, checkpoint: Checkpoint) -> dict[str, Any]:
        from ..evaluation import Evaluator

        options = self.options
        placement = {
            "device_map": options.device_map,
            "max_memory": options.max_memory,
            "offload_folder": options.offload_folder,
            "trust_remote_code": options.trust_remote_code,
            "attn_implementation": options.attn_implementation,
        }
        files = weights_identity(checkpoint.path)  # before loading: what was read, should a new save follow
        source, key, tokenizer, mismatches = self._tokenizer_for(checkpoint.path)
        if options.backend == "vllm":  # an engine is started for the folder
            model = str(checkpoint.path)
        else:
            model = load_model(str(checkpoint.path), self.device, options.dtype, **placement)  # no progress bars of its own
        if key not in self._evaluators:
            budget = self.options.memory_budget_mb
            self._evaluators[key] = Evaluator(
                tokenizer,
                self.benchmark,
                prefix_token_id=self.options.prefix_token_id,
                allow_modified=self.options.allow_modified,
                memory_budget=budget * 2**20 if budget else None,
                truncate=self.options.truncate,
                head_method=self.options.head_method,
                row_length=self.options.row_length,
                precision=self.options.precision or "auto",
                suites=self.suites,
                backend=options.backend,
                vllm_options=options.vllm_options,
            )
        try:
            results = self._evaluators[key](model)
        finally:
            self._evaluators[key].close()  # it holds this model (or its vLLM engine): gone before the next loads
        record = {"step": checkpoint.step, "checkpoint": checkpoint.name, **results.to_dict(), "model": str(checkpoint.path)}
        # This checkpoint's tokenizer, not the first one of the same files, whose cache and Evaluator it shares
        record["tokenizer"] = source
        record["weights_files"] = files
        if mismatches is not None:
            record["sentencepiece_mismatches"] = mismatches
        if not self.options.include_pairs:
            for part in (record, *record.get("suites", {}).values()):
                part.pop("pairs")
        return record

    def _tokenizer_for(self, path: Path) -> tuple[str, str, Any, int | None]:
        """(where the tokenizer of the checkpoint at ``path`` is read from, its files' key, the tokenizer, the
        SentencePiece mismatches): loaded once for each distinct content of its files."""
        from ..tokenized.tokenization import check_sentencepiece_mismatch

        source = self.options.tokenizer or _tokenizer_folder(path, self.run_dir)
        key = _files_key(Path(source))
        if key not in self._tokenizers:
            tokenizer = load_tokenizer(source, trust_remote_code=self.options.trust_remote_code)
            mismatches = None
            if Path(source).is_dir():
                mismatches = check_sentencepiece_mismatch(source, tokenizer, self.benchmark.sentences)
            self._tokenizers[key] = (tokenizer, mismatches)
        return (source, key, *self._tokenizers[key])


def _tokenizer_folder(checkpoint: Path, run_dir: Path) -> str:
    base = adapter_base_model(checkpoint) if is_adapter_folder(checkpoint) else None  # a PEFT adapter's base model
    for folder in (checkpoint, run_dir, *([Path(base)] if base and Path(base).is_dir() else [])):
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


def score_or_failure(scorer: CheckpointScorer, checkpoint: Checkpoint) -> tuple[str, dict[str, Any] | None]:
    """("scored", record), ("failed", {"error", "process"}), ("vanished", None) or ("stop", {"error"}): scored on this
    process alone. "stop" is the run's error, not the checkpoint's (a ``SweepError``: no tokenizer anywhere; or
    ``--tokenizer`` or ``--prefix-token-id`` giving ids the model cannot embed, which every checkpoint would fail
    alike), handed to process 0 like the other outcomes, so that the round's other checkpoints are written before the
    sweep stops and no process waits for this one."""
    from ..engine import distributed
    from ..engine.model_checks import VocabularyMismatch

    try:
        with distributed.this_process_only():
            return "scored", scorer.score(checkpoint)
    except Exception as error:  # one bad checkpoint must not end the sweep, nor leave the other processes waiting
        if not checkpoint.path.exists():
            # The Trainer's save_total_limit deleted it while we waited or loaded (its tokenizer files too): nothing
            # to score.
            return "vanished", None
        if isinstance(error, SweepError):
            return "stop", {"error": str(error)}
        if isinstance(error, VocabularyMismatch) and (error.cause == "prefix token" or scorer.options.tokenizer):
            option = "--prefix-token-id" if error.cause == "prefix token" else f"--tokenizer {scorer.options.tokenizer}"
            return "stop", {"error": f"{checkpoint.name}: {error} (every checkpoint would fail alike: check {option})"}
        message = str(error).splitlines()[0] if str(error) else ""
        logger.info("tatblimp: %s could not be scored", checkpoint.name, exc_info=True)  # process 0 names it
        rank = int(os.environ.get("RANK", 0))
        return "failed", {"error": f"{checkpoint.name}: {type(error).__name__}: {message}", "process": rank}
