"""A checkpoint series published as revisions (branches and tags) of one Hub repository: listed, chosen, placed.

Pythia publishes ``step0`` ... ``step143000``, OLMo ``step1000-tokens4B``, OLMo 2 ``stage1-step1000-tokens5B``,
BabyLM submissions ``chck_10M`` (words seen). ``list_revisions`` reads the repository's refs with their commit
shas (``huggingface_hub.list_repo_refs``; without network, the ``refs/`` files of the local cache),
``select_revisions`` keeps those a pattern names (a comma-separated list of names or globs, ``'step*'``),
``position`` reads each name's place on the curve (step, tokens, words), and ``plan_revisions`` groups them by
commit (two names on one commit are scored once), orders them on the chosen axis and compares them with a results
file's records. A revision is a (name, commit) pair whose name can move; a record belongs to a commit: a commit
scored before is skipped, a branch that moved on (``main``) leaves the record of its old commit while another name
(``step1``) still points there, and a name re-uploaded (no name left on its old commit) is scored again, its old
record leaving the curve.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..reading.hub import hub_offline, hub_unreachable
from ..results.runs import without_replaced
from .checkpoints import SweepError

logger = logging.getLogger(__name__)

AXES = ("step", "tokens", "words")
_SCALE = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_NUMBER = r"(\d+(?:\.\d+)?)([KMBGT]?)"
_STEP = re.compile(r"(?:^|[-_/])(?:global[-_]?)?step[-_]?(\d+)(?=$|[-_/])", re.IGNORECASE)
_TOKENS = re.compile(rf"(?:^|[-_/])tokens?[-_]?{_NUMBER}(?=$|[-_/])", re.IGNORECASE)
_WORDS = re.compile(rf"(?:^|[-_/])(?:words?[-_]?{_NUMBER}|(?:chck|chk|ckpt)[-_]?{_NUMBER})(?=$|[-_/])", re.IGNORECASE)


def position(name: str) -> dict[str, int]:
    """Where a revision lies on the curve, from its name: ``{"step": 1000, "tokens": 4_000_000_000}`` for
    ``step1000-tokens4B``, ``{"words": 10_000_000}`` for ``chck_10M``, ``{}`` for ``main``.

    A number with K, M, B (or G) or T is that many thousands, millions, billions, trillions; BabyLM's ``chck_`` names
    count words. Only the last of each kind counts (``stage1-step1000`` is step 1000, not 1).
    """
    found: dict[str, int] = {}
    for axis, pattern in (("step", _STEP), ("tokens", _TOKENS), ("words", _WORDS)):
        matches = list(pattern.finditer(name))
        if not matches:
            continue
        groups = [g for g in matches[-1].groups() if g is not None]
        if axis == "step":
            found[axis] = int(groups[0])
        else:
            number, unit = groups[0], groups[1].upper()
            found[axis] = round(float(number) * _SCALE[unit])
    return found


@dataclass
class Revision:
    """One commit of a series to score: the names that point at it (the first is the one it is shown by), its place
    on the curve (``step`` holds the value on the chosen axis, as a local checkpoint's step), and once downloaded,
    the folder of its files (``path``)."""

    name: str
    commit: str
    step: int
    position: dict[str, int]
    names: tuple[str, ...]
    axis: str = "step"  # what ``step`` counts: step, tokens or words
    # name -> the commit a record of it was scored at, that the name no longer points at (a name of this commit, or
    # another name of that record)
    replaces: dict[str, str] = field(default_factory=dict)
    reuploads: dict[str, str] = field(default_factory=dict)  # of its names, those re-uploaded: name -> the old commit
    path: Path | None = None


def list_revisions(repo_id: str) -> dict[str, str]:
    """Every branch and tag of the model repository ``repo_id`` with its commit sha, ``{name: sha}``.

    Asks the Hub (``list_repo_refs``) unless offline mode is on or the Hub cannot be reached (``reading/hub.py``); then
    reads the revisions the local cache knows (its ``refs/`` files, written by every download by name).

    Raises:
        SweepError: the repository is not on the Hub, or not in the cache when the Hub cannot be asked.
    """
    unreachable = hub_unreachable()
    if hub_offline() or unreachable:
        return _cached_revisions(repo_id, unreachable)
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        refs = HfApi().list_repo_refs(repo_id)
    except HfHubHTTPError as err:
        raise SweepError(f"{repo_id}: cannot list its revisions on the Hub ({str(err).splitlines()[0]})") from None
    return {ref.name: ref.target_commit for ref in (*refs.branches, *refs.tags)}


def _cached_revisions(repo_id: str, unreachable: str | None) -> dict[str, str]:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    refs = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "refs"
    found = {}
    for path in sorted(refs.rglob("*")) if refs.is_dir() else ():
        name = path.relative_to(refs).as_posix()
        if path.is_file() and not name.startswith("refs/pr/"):
            found[name] = path.read_text().strip()
    if not found:
        why = f"the Hub could not be reached ({unreachable})" if unreachable else "offline mode is on (HF_HUB_OFFLINE)"
        raise SweepError(f"{repo_id}: {why}, and the local cache ({refs.parent}) holds none of its revisions")
    logger.warning("tatblimp: %s: %s revisions read from the local cache, not from the Hub", repo_id, len(found))
    return found


def select_revisions(available: dict[str, str], pattern: str, repo_id: str) -> dict[str, str]:
    """The revisions ``pattern`` names: a comma-separated list of names and globs (``'step*'``, ``'stage1-*'``).

    Raises:
        SweepError: a name that is not a revision of the repository, or a glob that matches none.
    """
    chosen: dict[str, str] = {}
    for item in (part.strip() for part in pattern.split(",")):
        if not item:
            continue
        matches = [name for name in available if fnmatch.fnmatchcase(name, item)]
        if not matches:
            some = ", ".join(sorted(available)[:8]) + (" ..." if len(available) > 8 else "")
            raise SweepError(f"{repo_id}: no revision {'matches' if _is_glob(item) else 'named'} {item!r} (it has {some})")
        chosen.update((name, available[name]) for name in matches)
    if not chosen:
        raise SweepError(f"{repo_id}: --revisions {pattern!r} names no revision")
    return chosen


def _is_glob(item: str) -> bool:
    return any(char in item for char in "*?[")


def choose_axis(positions: dict[str, dict[str, int]], asked: str | None) -> str:
    """The axis a series is placed on: ``asked``, else the first of step, tokens, words that every name gives.

    Raises:
        SweepError: names that do not give it (named), or no axis every name gives.
    """
    if asked is not None:
        if asked not in AXES:
            raise SweepError(f"--x must be one of {', '.join(AXES)}, got {asked!r}")
        lacking = [name for name, where in positions.items() if asked not in where]
        if lacking:
            raise SweepError(f"no {asked} count in the name of {', '.join(lacking[:5])}: pick other revisions or another --x")
        return asked
    for axis in AXES:
        if all(axis in where for where in positions.values()):
            return axis
    lacking = [name for name, where in positions.items() if not where]
    if lacking:
        raise SweepError(
            f"no step, tokens or words count in the name of {', '.join(lacking[:5])} (as in step1000, "
            "step1000-tokens4B, chck_10M): leave it out of --revisions"
        )
    raise SweepError("the revisions' names give no one axis (step, tokens or words) that every one has: pass --x")


@dataclass
class RevisionPlan:
    """What a sweep over revisions does: the commits to score in order, and what it leaves and why."""

    axis: str
    todo: list[Revision]
    skipped: list[str] = field(default_factory=list)  # names whose commit is in the results file already
    duplicates: dict[str, str] = field(default_factory=dict)  # name -> the name its commit is scored under
    moved: dict[str, str] = field(default_factory=dict)  # name -> the name still on the commit it was scored at


def plan_revisions(
    chosen: dict[str, str], records: list[dict[str, Any]], asked_axis: str | None, refs: dict[str, str] | None = None
) -> RevisionPlan:
    """Group ``chosen`` (``{name: sha}``) by commit, place them on one axis, and leave out what ``records`` (the
    results file's lines, in the order written) already hold.

    A commit is scored once, shown by its first name on the axis; a name without a position is scored only as a
    second name of a commit that has one (``main`` beside ``step143000``). A record belongs to a commit: a commit on
    the curve already (``results.runs.without_replaced``) is skipped. A name scored before at another commit is
    either a branch that moved on (another name of that record, ``step1``, still points at the old commit: its line
    stays) or a re-upload (no name of it does: its line leaves the curve, and the commit's new files are scored). The
    new record's ``replaces`` names, with the old commit, each name of the old record that no longer points at it.

    ``refs``: every name of the repository with its commit (default: ``chosen``); a name of a record that is not
    among them no longer points at its commit.

    Raises:
        SweepError: no axis for the names, or two commits at one position.
    """
    refs = chosen if refs is None else refs
    by_commit: dict[str, list[str]] = {}
    for name, commit in chosen.items():
        by_commit.setdefault(commit, []).append(name)
    positions = {name: position(name) for name in chosen}
    placed = {commit: [n for n in names if positions[n]] or names for commit, names in by_commit.items()}
    # A commit gives an axis when one of its names does (main beside step143000).
    axis = choose_axis(
        {names[0]: {k: v for n in names for k, v in positions[n].items()} for names in placed.values()}, asked_axis
    )
    on_curve = [record for record in without_replaced(records) if record.get("commit")]
    scored = {record["commit"]: record for record in on_curve}
    commit_of_name = {name: record["commit"] for record in on_curve for name in record.get("revisions", ())}
    plan = RevisionPlan(axis, [])
    at: dict[int, str] = {}
    for commit, names in placed.items():
        names = sorted((n for n in names if axis in positions[n]), key=lambda n: (positions[n][axis], n))
        everyone = tuple(names + sorted(set(by_commit[commit]) - set(names)))
        first = everyone[0]
        step = positions[first][axis]
        if step in at and at[step] != commit:
            raise SweepError(
                f"{at[step]} and {first} are two commits at {axis} {step}: pick one with --revisions (or another --x)"
            )
        at[step] = first
        if commit in scored:
            plan.skipped += everyone
            for name in everyone:
                if name not in scored[commit].get("revisions", ()):
                    plan.duplicates[name] = scored[commit]["checkpoint"]
            continue
        for name in everyone[1:]:
            plan.duplicates[name] = first
        replaces, reuploads = {}, {}
        for name in everyone:
            old = commit_of_name.get(name)
            if old in (None, commit):
                continue
            old_names = scored[old].get("revisions", ())
            replaces.update({n: old for n in old_names if refs.get(n) != old})
            staying = [n for n in old_names if refs.get(n) == old]
            if staying:
                plan.moved[name] = staying[0]
            else:
                reuploads[name] = old
        plan.todo.append(Revision(first, commit, step, positions[first], everyone, axis, replaces, reuploads))
    plan.todo.sort(key=lambda revision: revision.step)
    return plan
