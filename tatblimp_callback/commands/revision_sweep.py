"""A sweep over a Hub repository's revisions: ``tatblimp sweep EleutherAI/pythia-160m --revisions 'step*'``.

The revisions are listed, chosen, grouped by commit and ordered by ``revisions.py``; ``RevisionSeries`` hands them
to the sweep as a run folder hands its checkpoints (``sweep._RunFolder``): each commit is fetched
(``revision_downloads.py``: the files a model needs, the next one while this one is scored), scored by the same
``CheckpointScorer`` and written as one line of the results file, ``<org>--<name>.tatblimp.jsonl`` by default, with
the revision's name, every name of its commit, the commit, the position its name gives and, for a name that moved
here (a branch moved on, or a re-upload), the commit it left (``replaces``). A revision that cannot be fetched or loaded is written to the failures file with why, and the
sweep goes on; a rerun tries it again. Under torchrun each process fetches only the revisions it scores.
"""

from __future__ import annotations

import argparse
import logging
import os
from itertools import pairwise
from pathlib import Path
from typing import Any

from ..results.runs import HUB_SWEEP_SUFFIX as RESULTS_SUFFIX
from .checkpoint_scoring import CheckpointScorer, score_or_failure
from .checkpoints import SweepError
from .revision_downloads import Prefetcher, RevisionFiles
from .revisions import AXES, Revision, list_revisions, plan_revisions, select_revisions
from .sweep_records import read_records

logger = logging.getLogger(__name__)

FAILURES_SUFFIX = ".tatblimp-failures.jsonl"


def check_repo_id(repo_id: str) -> None:
    """Refuse at once what cannot be a Hub model id (a local folder, a path), before anything loads."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if Path(repo_id).is_dir():
        raise SweepError(
            f"{repo_id}: a local folder; --revisions sweeps a Hub repository's revisions (drop it to sweep a run folder)"
        )
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise SweepError(f"{repo_id}: not a Hub model id ({err})") from None


def default_results_path(repo_id: str) -> Path:
    """``<org>--<name>.tatblimp.jsonl`` in the current folder."""
    return Path(repo_id.replace("/", "--") + RESULTS_SUFFIX)


class RevisionSeries:
    """A Hub repository's revisions as a sweep's checkpoints (``sweep.sweep`` with ``revisions``).

    Args:
        repo_id: the model repository.
        options: the sweep's ``SweepOptions`` (``revisions``, ``x``, ``keep_downloads``, ``results`` and the loader's).
        device: where this process scores.
    """

    def __init__(self, repo_id: str, options: Any, device: str | None):
        self.repo_id = repo_id
        self.options = options
        self.results_path = Path(options.results) if options.results else default_results_path(repo_id)
        name = self.results_path.name.removesuffix(RESULTS_SUFFIX).removesuffix(".jsonl")
        self.failures_path = self.results_path.with_name(name + FAILURES_SUFFIX)
        self.wandb_config = {"tatblimp_sweep_repo": repo_id, "tatblimp_sweep_revisions": options.revisions}
        downloads = self.results_path.parent / ".tatblimp-downloads" / repo_id.replace("/", "--")
        self.files = RevisionFiles(repo_id, downloads, keep=options.keep_downloads, trust_remote_code=options.trust_remote_code)
        self.scorer = CheckpointScorer(downloads, options, device)
        self.axis = "step"
        self._prefetcher: Prefetcher | None = None
        self._fetches: dict[str, Any] = {}
        self._next: dict[str, Revision] = {}

    def poll(self, done: set[str], settled: bool, report: Any) -> tuple[list[Revision], list[str], bool]:
        """The revisions to score, in order (process 0 lists them once); what is skipped goes into ``report``."""
        refs = list_revisions(self.repo_id)
        chosen = select_revisions(refs, self.options.revisions, self.repo_id)
        plan = plan_revisions(chosen, read_records(self.results_path), self.options.x, refs)
        todo = plan.todo  # a name in ``done`` may be a re-upload: the plan compares commits
        self.axis = plan.axis
        report.skipped = sorted(set(plan.skipped) - {*report.scored, *report.failed})
        report.duplicates.update(plan.duplicates)
        report.replaced.update({name: old for revision in todo for name, old in revision.reuploads.items()})
        for name, scored_as in plan.duplicates.items():
            logger.warning("tatblimp: %s is the same commit as %s: scored once, both named in its line", name, scored_as)
        for name, staying in plan.moved.items():
            logger.warning(
                "tatblimp: %s moved on from the commit of %s, whose line stays; its new commit is scored", name, staying
            )
        for name, old in report.replaced.items():
            logger.warning("tatblimp: %s points at another commit than when it was scored (%s): scored again", name, old[:12])
        return todo, [], False

    def begin(self, mine: list[Revision]) -> None:
        """Start fetching the first of the revisions this process scores; each ``score`` starts the next."""
        if not mine:
            return
        self._prefetcher = self._prefetcher or Prefetcher()
        self._next = {a.commit: b for a, b in pairwise(mine)}
        self._fetch(mine[0])

    def _fetch(self, revision: Revision) -> None:
        self._fetches[revision.commit] = self._prefetcher.submit(
            lambda: self.files.fetch(revision.name, revision.commit, revision.names[1:])
        )

    def score(self, revision: Revision) -> tuple[str, Any]:
        """("scored", record) or ("failed", why) as ``score_or_failure``; the record says which revision it is."""
        fetch = self._fetches.pop(revision.commit)
        following = self._next.get(revision.commit)
        if following is not None:
            self._fetch(following)  # downloads while this one is scored
        try:
            revision.path = fetch.get()
        except Exception as err:
            logger.info("tatblimp: %s could not be fetched", revision.name, exc_info=True)
            text = str(err).splitlines()[0] if str(err) else ""
            return "failed", self._failure(revision, f"{revision.name}: {type(err).__name__}: {text}")
        loaded = self.scorer.tokenizers_loaded
        kind, value = score_or_failure(self.scorer, revision)
        self._prefetcher.submit(lambda: self.files.release(revision.commit, revision.path))
        if loaded and self.scorer.tokenizers_loaded > loaded:
            logger.warning(
                "tatblimp: %s's tokenizer files differ from those of the revisions before it: its tokenizer is loaded "
                "and the benchmark tokenized again",
                revision.name,
            )
        if kind == "failed":
            return kind, self._failure(revision, value["error"])
        if kind != "scored":
            return kind, value
        return kind, self._record(revision, value)

    def _record(self, revision: Revision, scored: dict[str, Any]) -> dict[str, Any]:
        scored.pop("model")
        where = {
            "step": revision.step,
            "checkpoint": revision.name,
            "revision": revision.name,
            "revisions": list(revision.names),
            "commit": revision.commit,
            "position": revision.position,
            "x": revision.axis,
            **({"replaces": revision.replaces} if revision.replaces else {}),
        }
        return {**where, **scored, "model": self.repo_id}

    def _failure(self, revision: Revision, error: str) -> dict[str, Any]:
        rank = int(os.environ.get("RANK", 0))
        return {"error": error, "process": rank, "revision": revision.name, "commit": revision.commit, "x": revision.axis}

    def close(self, wait: bool) -> None:
        """Stop the background thread; with ``wait``, once the deletions asked for are done."""
        if self._prefetcher is None:
            return
        if self.scorer.tokenizers_loaded == 1:
            logger.info("tatblimp: one tokenizer for every revision scored (their tokenizer files are the same)")
        self._prefetcher.close(wait)


def add_revision_arguments(parser: argparse.ArgumentParser) -> None:
    """``--revisions``, ``--x``, ``--keep-downloads``, ``--results``: a sweep over a Hub repository's revisions."""
    group = parser.add_argument_group("a checkpoint series published on the Hub (RUN_DIR is then a Hub model id)")
    group.add_argument(
        "--revisions",
        metavar="PATTERN",
        help="the repository's branches and tags to score: comma-separated names or globs, e.g. 'step*', "
        "'stage1-*', 'chck_*', 'step1000,step2000'",
    )
    group.add_argument(
        "--x", choices=AXES, help="with --revisions: the axis, as parsed from the names (default: step, else tokens, else words)"
    )
    group.add_argument(
        "--keep-downloads",
        type=_yes_no,
        default=True,
        metavar="yes|no",
        help="with --revisions: keep each revision's files in the Hugging Face cache (default: yes); no: delete them once scored",
    )
    group.add_argument(
        "--results", metavar="FILE", help="with --revisions: the results file (default: ORG--NAME.tatblimp.jsonl here)"
    )


def _yes_no(text: str) -> bool:
    if text.lower() in ("yes", "no"):
        return text.lower() == "yes"
    raise argparse.ArgumentTypeError(f"{text!r}: yes or no")


def revision_summary(report: Any) -> list[str]:
    """The lines ``tatblimp sweep --revisions`` prints after its count: names of one commit, and re-uploads."""
    lines = [f"  {name}: the same commit as {scored_as}, scored once" for name, scored_as in sorted(report.duplicates.items())]
    lines += [f"  {name}: re-uploaded (was commit {old[:12]}), scored again" for name, old in sorted(report.replaced.items())]
    return lines
