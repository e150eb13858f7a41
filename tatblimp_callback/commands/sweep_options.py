"""What a sweep is asked (``SweepOptions``, the ``tatblimp sweep`` options) and what it did (``SweepReport``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..results.curves import DEFAULT_THRESHOLD

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

    head_method: str | None = None
    """How the LM head gives log-probs, "tiles" or "chunks:N"; None: timed at the first evaluation."""

    row_length: int | None = None
    """Positions per row of the forward calls; None: the engine's default (256)."""

    precision: str | None = None
    """What scoring computes in: "auto" (None: the same), "float32", "bfloat16" or "float16" (``engine/precision.py``)."""

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

    revisions: str | None = None
    """Sweep the revisions of a Hub repository (the sweep's argument is its id) that these comma-separated names or
    globs name, e.g. ``"step*"``, ``"stage1-*"``, ``"chck_*"`` (``commands/revisions.py``)."""

    x: str | None = None
    """With ``revisions``: the axis the revisions are placed on, "step", "tokens" or "words" as parsed from their
    names; None: the first of those every name gives."""

    keep_downloads: bool = True
    """With ``revisions``: keep each revision's files in the Hugging Face cache; False: delete them once scored."""

    results: str | None = None
    """With ``revisions``: the results file; None: ``<org>--<name>.tatblimp.jsonl`` in the current folder."""

    @property
    def poll_interval(self) -> float:
        if self.interval is not None:
            return self.interval
        return WATCH_INTERVAL if self.watch else SETTLE_INTERVAL


@dataclass
class SweepReport:
    """What one ``sweep`` call did."""

    results_path: Path
    failures_path: Path | None = None  # where the failures are written (a rerun tries them again)
    records: list[dict[str, Any]] = field(default_factory=list)  # every line of the results file, old and new, in step order
    scored: list[str] = field(default_factory=list)  # checkpoints scored by this call
    skipped: list[str] = field(default_factory=list)  # already in the results file
    incomplete: list[str] = field(default_factory=list)  # not complete when the sweep ended
    vanished: list[str] = field(default_factory=list)  # deleted (checkpoint rotation) before being read
    rewritten: list[str] = field(default_factory=list)  # saved again since their line was written: scored again
    failed: dict[str, str] = field(default_factory=dict)  # checkpoint -> why it could not be loaded or scored
    acquisition: dict[str, int | None] = field(default_factory=dict)
    interrupted: bool = False
    duplicates: dict[str, str] = field(default_factory=dict)  # revision -> the revision scored for its commit
    replaced: dict[str, str] = field(default_factory=dict)  # revision scored again -> the commit it had before
