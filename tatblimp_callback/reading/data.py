"""Loading TatBLiMP (and BLiMP-family) minimal-pair files.

A benchmark file is JSON Lines, one pair a line. TatBLiMP uses the fields ``good``, ``bad``,
``phenomenon`` and an optional ``subtype``; the other suites' fields are known too (``SENTENCE_FIELDS``:
BLiMP's ``sentence_good``/``sentence_bad``, TurBLiMP's, MultiBLiMP's), with the phenomenon in
``phenomenon`` or ``linguistics_term`` and the subtype in ``subtype`` or ``UID``. These field lists are
the one place the field names live: ``suites.py`` reads by them too, so one file gets the same labels
through ``load_benchmark`` and ``load_suite``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from . import identity

HUB_REPO_ID = "ilchats/TatBLiMP"
HUB_FILENAME = "test.jsonl"
DATA_ENV_VAR = "TATBLIMP_DATA"

OFFICIAL_MD5 = "7659770ffe671579746a445a173a294a"
OFFICIAL_RELEASE = "TatBLiMP v1.0 (2026-06-19)"

# Pair counts of the official release, by phenomenon.
OFFICIAL_PHENOMENA = {
    "anaphor_agreement": 79,
    "argument_structure_ditransitive": 78,
    "argument_structure_transitive": 78,
    "binding": 78,
    "ellipsis_gapping": 85,
    "irregular_forms": 80,
    "island_effects": 80,
    "nominalization": 70,
    "npi_licensing": 80,
    "numeral_noun_number": 85,
    "passives": 83,
    "quantifiers": 85,
    "relative_clauses": 88,
    "subject_verb_agreement": 77,
    "suspended_affixation": 47,
    "word_order": 75,
}

# The phenomena in the order of the official file (OFFICIAL_PHENOMENA is alphabetical); plots follow it.
OFFICIAL_ORDER = (
    "anaphor_agreement",
    "argument_structure_transitive",
    "argument_structure_ditransitive",
    "binding",
    "ellipsis_gapping",
    "irregular_forms",
    "island_effects",
    "nominalization",
    "npi_licensing",
    "passives",
    "quantifiers",
    "relative_clauses",
    "word_order",
    "subject_verb_agreement",
    "suspended_affixation",
    "numeral_noun_number",
)

# (good, bad) field names of TatBLiMP and the released suites, tried in this order.
SENTENCE_FIELDS = (
    ("good", "bad"),
    ("sentence_good", "sentence_bad"),
    ("good_sentence", "bad_sentence"),
    ("sen", "wrong_sen"),
)
PHENOMENON_FIELDS = ("phenomenon", "linguistics_term")
SUBTYPE_FIELDS = ("subtype", "UID")


class BenchmarkError(ValueError):
    """A benchmark file that cannot be used; the message names the file and, where known, the line.

    ``command_line`` is the message the ``tatblimp`` command prints: the same, naming its option (``--data``,
    ``--allow-modified``) where the message names a Python argument.
    """

    def __init__(self, message: str, command_line: str | None = None):
        super().__init__(message)
        self.command_line = command_line or message


@dataclass(frozen=True)
class Pair:
    """One minimal pair: a grammatical and an ungrammatical sentence."""

    good: str
    bad: str
    phenomenon: str
    subtype: str | None = None


@dataclass(frozen=True)
class Benchmark:
    """The pairs of one benchmark file, in file order, with where they came from.

    ``official`` is True only for the exact TatBLiMP v1.0 file (checked by md5); any other file
    is reported as ``modified`` with its own md5.
    """

    pairs: tuple[Pair, ...]
    source: str
    md5: str
    selection: str | None = None
    """Set when only some of the file's pairs are kept (``select``): which ones, e.g. "first 5 pairs of each
    phenomenon"; results of such a benchmark are partial."""
    kept: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    """Each pair's index among the file's pairs, where only some are kept (None: all of them, in order)."""

    @property
    def file_indices(self) -> Sequence[int]:
        """Each pair's index among its file's pairs (what ``explain --pair`` takes), also for a selection."""
        return self.kept if self.kept is not None else range(len(self.pairs))

    @cached_property
    def fingerprint(self) -> str:
        """What was scored: the file's bytes (md5) and every pair kept, in order (``identity.fingerprint``); it
        differs for a selection, a subset built by hand and another column mapping of the same bytes."""
        return identity.fingerprint(self.md5, self.pairs)

    @property
    def official(self) -> bool:
        """True for the exact TatBLiMP v1.0 file (by md5)."""
        return self.md5 == OFFICIAL_MD5

    @property
    def release(self) -> str:
        """The release name: "TatBLiMP v1.0 (2026-06-19)" for the official file, else "modified (md5 ...)";
        with ", partial: ..." when only some pairs were kept (``select``)."""
        release = OFFICIAL_RELEASE if self.official else f"modified (md5 {self.md5})"
        return f"{release}, partial: {self.selection}" if self.selection else release

    def select(self, limit: int | None = None, phenomena: Sequence[str] | str | None = None) -> Benchmark:
        """The first ``limit`` pairs of each phenomenon, of the ``phenomena`` named (None: all), for a quick run.

        Args:
            limit: pairs kept of each phenomenon, in file order; None: all.
            phenomena: names to keep, a sequence or one comma-separated string; None: all.

        Returns:
            A benchmark with ``selection`` saying what was kept (its results are partial); this one when both are None
            or when every pair is kept.

        Raises:
            BenchmarkError: a limit below 1 or an unknown phenomenon.
        """
        if isinstance(phenomena, str):
            given, phenomena = phenomena, [name.strip() for name in phenomena.split(",") if name.strip()]
            if not phenomena:  # "" or ",": a slip, not a wish for all of them
                raise BenchmarkError(f"phenomena {given!r} names none (phenomena: {', '.join(self.phenomena)})")
        if limit is None and not phenomena:
            return self
        if limit is not None and limit < 1:
            raise BenchmarkError(f"limit must be at least 1, got {limit}")
        unknown = [name for name in phenomena or () if name not in self.phenomena]
        if unknown:
            named = ", ".join(name + did_you_mean(name, self.phenomena) for name in unknown)
            raise BenchmarkError(f"{self.source}: no phenomenon {named} (phenomena: {', '.join(self.phenomena)})")
        kept, seen = [], dict.fromkeys(self.phenomena, 0)
        for k, pair in enumerate(self.pairs):
            if (not phenomena or pair.phenomenon in phenomena) and (limit is None or seen[pair.phenomenon] < limit):
                seen[pair.phenomenon] += 1
                kept.append(k)
        if len(kept) == len(self.pairs):  # a limit above every phenomenon's count keeps them all: not partial
            return self
        what = [f"first {limit} pair{'s' * (limit != 1)} of each phenomenon" if limit is not None else None]
        what.append(f"phenomena {','.join(name for name in self.phenomena if name in phenomena)}" if phenomena else None)
        selection = "; ".join(filter(None, [self.selection, *what]))
        return self._keeping(kept, f"{selection} ({len(kept)} of {len(self.pairs)} pairs)")

    def pick(self, indices: Sequence[int]) -> Benchmark:
        """The pairs at ``indices`` (in that order), with a ``selection`` that names them: a subset never claims
        to be the whole file (its ``fingerprint`` is its own too)."""
        indices = list(indices)
        shown = ", ".join(f"#{i}" for i in indices[:10]) + (", ..." if len(indices) > 10 else "")
        what = f"pairs {shown} ({len(indices)} of {len(self.pairs)} pairs)"
        return self._keeping(indices, f"{self.selection}; {what}" if self.selection else what)

    def _keeping(self, indices: Sequence[int], selection: str) -> Benchmark:
        """The pairs at ``indices`` of this benchmark's, as a selection named ``selection``."""
        return replace(
            self,
            pairs=tuple(self.pairs[i] for i in indices),
            selection=selection,
            kept=tuple(self.file_indices[i] for i in indices),
        )

    @property
    def phenomena(self) -> list[str]:
        """Phenomenon names in order of first appearance."""
        return list(dict.fromkeys(p.phenomenon for p in self.pairs))

    @property
    def sentences(self) -> list[str]:
        """All sentences, good then bad for each pair: sentence 2*i is pair i's good one."""
        return [s for p in self.pairs for s in (p.good, p.bad)]

    def __len__(self) -> int:
        return len(self.pairs)


def load_benchmark(source: str | os.PathLike | None = None, *, allow_modified: bool = False) -> Benchmark:
    """Load a minimal-pair benchmark.

    ``source`` is a local JSONL path; when None, the path in the ``TATBLIMP_DATA`` environment
    variable; when that is unset too, ``test.jsonl`` of the Hub dataset ``ilchats/TatBLiMP``
    (downloaded once and cached by huggingface_hub).

    A file whose md5 is not the official TatBLiMP v1.0 one raises ``BenchmarkError`` unless
    ``allow_modified`` is True; it is then reported as modified, with its own md5, in every result.

    Args:
        source: a JSONL file of pairs (TatBLiMP's fields, or BLiMP's ``sentence_good``/``sentence_bad``).
        allow_modified: accept a file that is not the official release.

    Returns:
        The pairs in file order, with the file's path and md5.

    Raises:
        BenchmarkError: the file cannot be read or downloaded, a line is malformed (named by file and
            line), the file is empty, or its md5 is not the official one without ``allow_modified``.

    Example:
        ```python
        benchmark = load_benchmark("test.jsonl")
        print(len(benchmark.pairs), benchmark.release)
        ```
    """
    if source is not None and not isinstance(source, (str, os.PathLike)):
        raise BenchmarkError(f"the benchmark is read from a JSONL file: give its path, not a {type(source).__name__}")
    path = Path(source) if source is not None else _default_path()
    try:
        raw = path.read_bytes()
    except OSError as err:
        named_by = f" named by ${DATA_ENV_VAR}" if source is None and os.environ.get(DATA_ENV_VAR) else ""
        raise BenchmarkError(f"{path}: cannot read the benchmark file{named_by} ({err.strerror or err})") from err
    pairs = tuple(parse_pairs(raw, str(path)))  # a broken line first: --allow-modified would not mend it
    md5 = hashlib.md5(raw).hexdigest()
    if md5 != OFFICIAL_MD5 and not allow_modified:
        head = f"{path}: md5 {md5} is not the official TatBLiMP v1.0 release ({OFFICIAL_MD5})"
        raise BenchmarkError(
            f"{head}; pass allow_modified=True to score it as a modified benchmark",
            f"{head}; pass --allow-modified to score it as a modified benchmark",
        )
    return Benchmark(pairs=pairs, source=str(path), md5=md5)


def parse_pairs(raw: bytes, name: str) -> list[Pair]:
    """Parse the bytes of a JSONL benchmark file; ``name`` is used in error messages."""
    text = decode_utf8(raw, name)  # a byte-order mark is refused (json_record says how to save without one)
    # JSON Lines ends a line at "\n" only: str.splitlines() would also split inside a string
    # holding U+2028 or a form feed, and shift every line number after it.
    lines = text.rstrip("\r\n").split("\n") if text.strip() else []
    pairs = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            raise BenchmarkError(f"{name}:{number}: empty line inside the file")
        pairs.append(_parse_line(line, f"{name}:{number}", Path(name).stem))
    if not pairs:
        raise BenchmarkError(f"{name}: the file holds no pairs")
    return pairs


def did_you_mean(name: str, known: Sequence[str]) -> str:
    """`` (did you mean X?)`` for the name of ``known`` closest to a mistyped ``name`` (``bindng``), else ``""``."""
    import difflib

    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def decode_utf8(raw: bytes, name: str) -> str:
    """``raw`` as UTF-8 text; ``BenchmarkError`` naming ``name`` and the line of the first invalid byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise BenchmarkError(f"{name}:{line}: bytes that are not UTF-8 ({err.reason} at byte {err.start})") from None


def _parse_line(line: str, where: str, stem: str) -> Pair:
    record = json_record(line, where)
    keys = next(((g, b) for g, b in SENTENCE_FIELDS if g in record or b in record), SENTENCE_FIELDS[0])
    good, bad = (required_string(record, key, where) for key in keys)
    if good == bad:
        raise BenchmarkError(f"{where}: the good and bad sentences are identical")
    phenomenon_field = next((f for f in PHENOMENON_FIELDS if f in record), None)
    if (
        phenomenon_field is None and keys != SENTENCE_FIELDS[0]
    ):  # another suite's line without one: the file's name, as suites.py does
        phenomenon = stem
    else:
        phenomenon = required_string(record, phenomenon_field or "phenomenon", where)
    subtype_field = next((f for f in SUBTYPE_FIELDS if f in record), "subtype")
    subtype = record.get(subtype_field)
    if subtype is not None and not isinstance(subtype, str):
        raise BenchmarkError(f"{where}: field '{subtype_field}' must be a string or null, got {type(subtype).__name__}")
    if subtype is not None:
        check_unicode(subtype, subtype_field, where)
    return Pair(good=good, bad=bad, phenomenon=phenomenon, subtype=subtype)


def json_record(line: str, where: str) -> dict:
    """One JSON Lines line as a dict; ``BenchmarkError`` naming ``where`` if it is not a JSON object."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        if err.msg.startswith("Unexpected UTF-8 BOM"):  # json's own hint, "decode using utf-8-sig", is for programmers
            fix = "save the file as UTF-8 without a byte-order mark"
            raise BenchmarkError(f"{where}: invalid JSON (a byte-order mark starts the line; {fix})") from None
        raise BenchmarkError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise BenchmarkError(f"{where}: invalid JSON (nested too deeply)") from None
    except ValueError as err:  # e.g. an integer past Python's digit limit
        raise BenchmarkError(f"{where}: invalid JSON ({err})") from None
    if not isinstance(record, dict):
        raise BenchmarkError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def required_string(record: dict, key: str, where: str) -> str:
    if key not in record:
        raise BenchmarkError(f"{where}: missing field '{key}'")
    value = record[key]
    if not isinstance(value, str):
        raise BenchmarkError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise BenchmarkError(f"{where}: field '{key}' is empty")
    check_unicode(value, key, where)
    return value


def check_unicode(value: str, key: str, where: str) -> None:
    # JSON's "\ud800" escapes decode to lone surrogates, which no tokenizer or UTF-8 byte count accepts.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BenchmarkError(f"{where}: field '{key}' is not valid Unicode (a lone surrogate escape)") from None


def _default_path() -> Path:
    env = os.environ.get(DATA_ENV_VAR)
    if env:
        return Path(env)
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as err:  # pragma: no cover - huggingface_hub is a dependency
        raise BenchmarkError("huggingface_hub is needed to download TatBLiMP; pass a local path instead") from err
    from .hub import hub_endpoint, hub_unreachable

    unreachable = hub_unreachable()  # without network: the cache only, at once, not a minute of retries
    try:
        return Path(hf_hub_download(HUB_REPO_ID, HUB_FILENAME, repo_type="dataset", local_files_only=unreachable is not None))
    except LocalEntryNotFoundError as err:
        why = f"the Hub, {hub_endpoint()}, could not be reached: {unreachable}" if unreachable else "HF_HUB_OFFLINE is set"
        start = f"no benchmark file given and {DATA_ENV_VAR} unset, and {HUB_REPO_ID}'s {HUB_FILENAME} is not in the Hub cache ({why})"
        raise BenchmarkError(
            f"{start}; pass a local path or set {DATA_ENV_VAR}", f"{start}; pass --data PATH or set {DATA_ENV_VAR}"
        ) from err
    except Exception as err:  # network, auth and HTTP errors all end the same way for the user
        raise BenchmarkError(f"cannot download {HUB_FILENAME} of the Hub dataset {HUB_REPO_ID}: {err}") from err
