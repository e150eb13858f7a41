"""Reading minimal-pair suites other than TatBLiMP: BLiMP, TurBLiMP, MultiBLiMP, or your own.

A suite is a file or a folder of files. A folder's ``*.jsonl``, ``*.csv`` and ``*.tsv`` files are read in
sorted file-name order and each file's rows in order: that is the order of the suite's pairs (and of
``outcomes`` and ``pairs`` in its results). Other files in the folder are not data and are not read.

- JSON Lines: the sentence fields of TatBLiMP (``good``/``bad``), BLiMP (``sentence_good``/``sentence_bad``),
  MultiBLiMP (``sen``/``wrong_sen``) or TurBLiMP (``good_sentence``/``bad_sentence``);
- CSV or TSV with a header row (TurBLiMP as released): the delimiter is the one of comma, semicolon and
  tab that splits the header into the most columns; a UTF-8 byte-order mark is tolerated; quoted fields
  may hold delimiters and line breaks.

A pair's phenomenon is its ``phenomenon`` or ``linguistics_term`` field, else the file's name without its
extension; its subtype is ``subtype`` or ``UID``, else the file's name where that differs from the
phenomenon. Other layouts take a column mapping, ``{"good": "SENT_OK", "bad": "SENT_BAD", "phenomenon":
"CAT"}`` (CLI: ``--columns good=SENT_OK,bad=SENT_BAD,phenomenon=CAT``).

Suites as released hold pairs that cannot be scored: two identical sentences (7 of BLiMP's 67,000).
Such a pair is left out of the metrics, counted, and named by file and line in ``Suite.left_out`` (and
the results' ``left_out``) and in one warning. The official TatBLiMP file is read as strictly as
``load_benchmark`` reads it. A malformed row (a missing or empty field, invalid UTF-8 or JSON, a CSV row
with the wrong number of fields) raises ``BenchmarkError`` naming the file and line.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .data import (
    OFFICIAL_MD5,
    PHENOMENON_FIELDS,
    SENTENCE_FIELDS,
    SUBTYPE_FIELDS,
    Benchmark,
    BenchmarkError,
    Pair,
    check_unicode,
    decode_utf8,
    json_record,
    load_benchmark,
    parse_pairs,
)

logger = logging.getLogger(__name__)

SUITE_SUFFIXES = (".jsonl", ".csv", ".tsv")
# The field names (SENTENCE_FIELDS, PHENOMENON_FIELDS, SUBTYPE_FIELDS) are data.py's: one list for both readers.
COLUMN_ROLES = ("good", "bad", "phenomenon", "subtype")
IDENTICAL = "the good and bad sentences are identical"


@dataclass(frozen=True)
class Suite(Benchmark):
    """A named minimal-pair suite: its scorable pairs in order, and the pairs left out of them.

    ``left_out`` holds one ``{"file", "line", "reason"}`` per pair that cannot be scored.
    """

    name: str = ""
    left_out: tuple[dict, ...] = ()
    columns: dict[str, str] | None = None
    """The column mapping the pairs were read with (None: the known fields); part of what was scored."""

    @property
    def release(self) -> str:
        """The suite's name and md5, with ", partial: ..." when only some pairs were kept (``select``)."""
        return f"{self.name} (md5 {self.md5})" + (f", partial: {self.selection}" if self.selection else "")


def parse_columns(text: str | None) -> dict[str, str] | None:
    """``"good=SENT_OK,bad=SENT_BAD,phenomenon=CAT"`` as a dict; roles: good, bad, phenomenon, subtype.

    Raises:
        ValueError: an item without ``=``, an unknown role, or a mapping without good and bad.
    """
    if not text:
        return None
    mapping = {}
    for item in text.split(","):
        role, sep, column = (part.strip() for part in item.partition("="))
        if not sep or not column:
            raise ValueError(f"--columns: {item!r} is not ROLE=COLUMN")
        if role not in COLUMN_ROLES:
            raise ValueError(f"--columns: unknown role {role!r}; expected one of {', '.join(COLUMN_ROLES)}")
        mapping[role] = column
    return check_columns(mapping)


def check_columns(columns: dict[str, str] | None) -> dict[str, str] | None:
    if columns is not None and not {"good", "bad"} <= set(columns):
        raise ValueError(f"a column mapping needs good= and bad=, got {columns}")
    if columns is not None and set(columns) - set(COLUMN_ROLES):
        raise ValueError(f"unknown column roles {sorted(set(columns) - set(COLUMN_ROLES))}; expected {COLUMN_ROLES}")
    return columns


def parse_suite_option(text: str) -> tuple[str, str]:
    """``"blimp=PATH"`` (the CLI's ``--suite``) as (name, path)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--suite {text!r}: expected NAME=PATH, e.g. blimp=../blimp/data")
    if not usable_name(name):
        raise ValueError(f"--suite {text!r}: the name {name!r} cannot be a suite name (no '/', not 'tatblimp')")
    return name, path


def usable_name(name: str) -> bool:
    """Whether ``name`` can name a suite: it prefixes the suite's logged keys (``name/acc``), so it holds no '/', which
    would read as a phenomenon's key of another suite, and is not TatBLiMP's default prefix."""
    return "/" not in name and name != "tatblimp"


def check_suites(suites) -> None:
    """``suites=`` as the Python API takes it: None, or ``{name: a path or a Suite}`` with names that are non-empty
    strings (a list of names or a folder's path is the usual slip).

    Raises:
        ValueError: naming what was given.
    """
    if suites is None:
        return
    if not isinstance(suites, Mapping):
        raise ValueError(f"suites= must be {{name: path or Suite}}, e.g. {{'blimp': 'blimp/data'}}; got {suites!r}")
    for name, source in suites.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"suite names must be non-empty strings, got {name!r}")
        if not usable_name(name):
            raise ValueError(f"suite name {name!r}: it prefixes the suite's logged keys, so no '/' and not 'tatblimp'")
        if not isinstance(source, (Suite, str, os.PathLike)):
            raise ValueError(f"suite {name!r}: expected a path or a Suite, got {source!r}")


def load_suite(name: str, source: str | os.PathLike, columns: dict[str, str] | None = None) -> Suite:
    """Read the suite at ``source`` (a file or a folder) as ``name``.

    Args:
        name: the suite's name: the prefix of its logged keys and its key in ``Results.suites``.
        source: a JSONL, CSV or TSV file (a `.json` file: JSON lines or one array of records), or a folder of them.
        columns: where the fields are, for layouts not detected: ``{"good": ..., "bad": ..., "phenomenon": ...,
            "subtype": ...}`` (good and bad required).

    Returns:
        The ``Suite``: scorable pairs in folder and file order, and the pairs left out, one warning naming them.

    Raises:
        BenchmarkError: an unreadable or empty source, a folder with no suite file, a malformed row (file and line).
    """
    check_columns(columns)
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SUITE_SUFFIXES)
        if not files:
            raise BenchmarkError(f"{path}: no suite file ({', '.join('*' + s for s in SUITE_SUFFIXES)}) in the folder")
    elif path.is_file():
        files = [path]
    else:
        raise BenchmarkError(f"{path}: no such file or folder")
    digest = hashlib.md5()
    pairs: list[Pair] = []
    left_out: list[dict] = []
    for file in files:
        try:
            raw = file.read_bytes()
        except OSError as err:
            raise BenchmarkError(f"{file}: cannot read the suite file ({err.strerror or err})") from err
        digest.update(f"{file.name}\n{len(raw)}\n".encode())
        digest.update(raw)
        if hashlib.md5(raw).hexdigest() == OFFICIAL_MD5:  # TatBLiMP itself: as strictly as ever
            pairs += parse_pairs(raw, str(file))
            continue
        for line, record in _records(raw, file):
            pair = _pair(record, file, f"{file}:{line}", columns)
            if pair.good == pair.bad:
                left_out.append({"file": str(file), "line": line, "reason": IDENTICAL})
            else:
                pairs.append(pair)
    if not pairs:
        raise BenchmarkError(f"{path}: the suite holds no pair that can be scored")
    if left_out:
        logger.warning(
            "tatblimp: suite %r: %d pairs left out of the metrics (%s): %s",
            name,
            len(left_out),
            IDENTICAL,
            ", ".join(f"{entry['file']}:{entry['line']}" for entry in left_out),
        )
    return Suite(
        pairs=tuple(pairs), source=str(path), md5=digest.hexdigest(), name=name, left_out=tuple(left_out), columns=columns
    )


def _records(raw: bytes, file: Path):
    """(line number, dict) for each row of a JSONL, CSV or TSV file; a ``.json`` file is JSON lines, or one array of
    records (then numbered by their place in it); a file of another suffix is JSON lines if it starts with ``{``."""
    text = decode_utf8(raw, str(file)).removeprefix("\ufeff")
    if not text.strip():
        raise BenchmarkError(f"{file}: the file holds no pairs")
    text = text.rstrip("\r\n")
    if file.suffix.lower() == ".json" and text.lstrip().startswith("["):  # one JSON array of records
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise BenchmarkError(f"{file}:{err.lineno}: invalid JSON ({err.msg})") from None
        for number, record in enumerate(records, start=1):
            if not isinstance(record, dict):
                raise BenchmarkError(f"{file}: record {number} of the array is not a JSON object")
            yield number, record
        return
    suffix = file.suffix.lower()
    # Another suffix (.txt): JSON lines where the file starts with an object, else a table
    if suffix in (".jsonl", ".json") or (suffix not in (".csv", ".tsv") and text.lstrip().startswith("{")):
        # JSON Lines ends a line at "\n" only (see data.parse_pairs).
        for number, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                raise BenchmarkError(f"{file}:{number}: empty line inside the file")
            yield number, json_record(line, f"{file}:{number}")
        return
    yield from _table_records(text, file)


def _table_records(text: str, file: Path):
    header_line = text.split("\n", 1)[0].rstrip("\r")
    delimiter = max(
        ",;\t", key=lambda d: (len(next(csv.reader([header_line], delimiter=d))), d == "\t" and file.suffix == ".tsv")
    )
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    try:
        header = next(reader)
        start = reader.line_num + 1
        for row in reader:
            if not row or all(not cell.strip() for cell in row):
                raise BenchmarkError(f"{file}:{start}: empty line inside the file")
            if len(row) != len(header):
                raise BenchmarkError(
                    f"{file}:{start}: {len(row)} fields, but the header has {len(header)} "
                    f"(delimiter {delimiter!r}; quote fields that hold it)"
                )
            yield start, dict(zip(header, row))
            start = reader.line_num + 1
    except csv.Error as err:
        raise BenchmarkError(f"{file}:{reader.line_num}: malformed CSV ({err})") from None


def _pair(record: dict, file: Path, where: str, columns: dict[str, str] | None) -> Pair:
    # A role the mapping leaves out is read from its known field names, as without a mapping
    phenomenon_key = next((f for f in PHENOMENON_FIELDS if f in record), None)
    subtype_key = next((f for f in SUBTYPE_FIELDS if f in record), None)
    if columns is not None:
        good_key, bad_key = columns["good"], columns["bad"]
        phenomenon_key, subtype_key = columns.get("phenomenon", phenomenon_key), columns.get("subtype", subtype_key)
    else:
        good_key, bad_key = next(((g, b) for g, b in SENTENCE_FIELDS if g in record or b in record), (None, None))
        if good_key is None:
            expected = "; ".join(f"{g}/{b}" for g, b in SENTENCE_FIELDS)
            raise BenchmarkError(f"{where}: no sentence fields (expected one of {expected}, or a column mapping)")
    good, bad = (_text(record, key, where, required=True) for key in (good_key, bad_key))
    phenomenon = _text(record, phenomenon_key, where, required=phenomenon_key is not None)
    subtype = _text(record, subtype_key, where, required=False)
    phenomenon = phenomenon or file.stem
    if subtype is None and file.stem != phenomenon:
        subtype = file.stem
    return Pair(good=good, bad=bad, phenomenon=phenomenon, subtype=subtype)


def _text(record: dict, key: str | None, where: str, *, required: bool) -> str | None:
    """The string in ``record[key]``; None where an optional field is absent, null or empty."""
    if key is None or key not in record:
        if required:
            raise BenchmarkError(f"{where}: missing field '{key}'")
        return None
    value = record[key]
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise BenchmarkError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
    if not value.strip():
        if required:
            raise BenchmarkError(f"{where}: field '{key}' is empty")
        return None
    check_unicode(value, key, where)
    return value


def add_suite_arguments(parser, suites_only: bool = True) -> None:
    """``--suite NAME=PATH`` (repeatable), ``--columns [NAME:]ROLE=COLUMN,...`` and (with ``suites_only``) ``--suites-only``."""
    group = parser.add_argument_group("more minimal-pair suites in the same pass")
    group.add_argument(
        "--suite",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also score this suite (a BLiMP/TurBLiMP/MultiBLiMP folder or file, JSONL/CSV/TSV); repeatable",
    )
    group.add_argument(
        "--columns",
        action="append",
        default=[],
        metavar="[NAME:]good=COL,bad=COL[,phenomenon=COL][,subtype=COL]",
        help="where a suite's fields are, for layouts not detected (NAME: only that suite); repeatable",
    )
    if not suites_only:
        return
    group.add_argument(
        "--suites-only",
        action="store_true",
        help="score the suites without TatBLiMP: the first --suite takes TatBLiMP's place at the top of the results",
    )


def suites_from_args(args) -> dict[str, Suite]:
    """The suites named by ``--suite`` and ``--columns``, read, in the order given.

    Raises:
        ValueError: a malformed option, a name given twice, ``--columns`` for an unknown suite or with no suite,
            ``--suites-only`` alone.
    """
    named = [parse_suite_option(text) for text in getattr(args, "suite", None) or []]
    names = [name for name, _ in named]
    if len(set(names)) < len(names):
        raise ValueError(f"--suite: a name given twice ({', '.join(sorted({n for n in names if names.count(n) > 1}))})")
    if getattr(args, "suites_only", False) and not named:
        raise ValueError("--suites-only needs at least one --suite NAME=PATH")
    columns: dict[str | None, dict[str, str]] = {}
    if getattr(args, "columns", None) and not named:
        raise ValueError(f"--columns {args.columns[0]!r}: where a --suite file's fields are; no --suite NAME=PATH is given")
    for text in getattr(args, "columns", None) or []:
        name, sep, mapping = text.partition(":")
        if not sep:
            name, mapping = None, text
        elif name not in names:
            raise ValueError(f"--columns {text!r}: no --suite named {name!r}")
        columns[name] = parse_columns(mapping)
    return {name: load_suite(name, path, columns.get(name, columns.get(None))) for name, path in named}


def benchmark_and_suites(args) -> tuple[Benchmark, dict[str, Suite]]:
    """What ``tatblimp score`` reads: TatBLiMP (``--data``), or with ``--suites-only`` the first suite in its place,
    kept as ``--limit`` and ``--phenomena`` say; and the other suites, each the first ``--limit`` pairs of each of its
    phenomena too (``--phenomena`` names TatBLiMP's). A limited suite is marked partial, as TatBLiMP is.

    Raises:
        ValueError: ``--data`` with ``--suites-only``, which reads no TatBLiMP file; and as ``suites_from_args``.
    """
    suites = suites_from_args(args)
    limit, phenomena = getattr(args, "limit", None), getattr(args, "phenomena", None)
    if getattr(args, "suites_only", False):
        if getattr(args, "data", None):
            raise ValueError(f"--data {args.data}: TatBLiMP's file, which --suites-only does not score; drop one of them")
        benchmark = suites.pop(next(iter(suites))).select(limit, phenomena)
    else:
        benchmark = load_benchmark(args.data, allow_modified=args.allow_modified).select(limit, phenomena)
    return benchmark, {name: suite.select(limit) for name, suite in suites.items()}
