"""Where a record lies on its series' curve, as the tables, charts and report show it.

A run folder's records are placed by training step; a sweep over a Hub repository's revisions
(``tatblimp sweep HUB_ID --revisions ... --x tokens``) by the tokens or words its revision names give, written in
each record as ``x`` with the value in ``step`` and the name in ``revision``. ``axis_of`` says which, ``readable``
writes a value as people write those counts (``4B``, ``10M``; steps as they are), ``point`` names one record
(``tokens 4B (step1000-tokens4B)``), ``parse_readable`` reads ``4B`` back and ``find_step`` a count or a revision
name given on the command line (``compare FILE@4B``, ``report --steps``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

_UNITS = (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3))
_READABLE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMBGT]?)\s*$", re.IGNORECASE)


def axis_of(records: Iterable[Mapping[str, Any]]) -> str:
    """What the records' ``step`` counts: "step", or the ``x`` of a revision series ("tokens", "words"); the
    axes joined by " / " when the records mix them."""
    axes = list(dict.fromkeys(record.get("x", "step") for record in records))
    return " / ".join(axes) if axes else "step"


def readable(value: float, axis: str = "step") -> str:
    """``value`` as a label on ``axis``: a step as a whole number (``1200``), a count of tokens or words with
    K, M, B or T and three significant digits (``4B``, ``2.5T``, ``10M``, ``1.23M``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if axis == "step":
        return f"{value:.0f}" if isinstance(value, float) else str(value)
    for unit, size in _UNITS:
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def point(record: Mapping[str, Any]) -> str:
    """One record's place, for headings: ``step 1200``, or ``tokens 4B (step1000-tokens4B)`` in a revision series."""
    axis = record.get("x", "step")
    where = f"{axis} {readable(record['step'], axis)}"
    name = record.get("revision")
    return f"{where} ({name})" if name else where


def parse_readable(text: str) -> int | None:
    """``"4B"`` -> 4000000000, ``"1200"`` -> 1200, ``"2.5T"`` -> 2500000000000; None for what is not such a number."""
    match = _READABLE.match(text)
    if match is None:
        return None
    number, unit = match.groups()
    if "." in number and not unit:  # a step is a whole number
        return None
    scale = dict(_UNITS, G=10**9).get(unit.upper(), 1)
    return round(float(number) * scale)


def find_step(records: Iterable[Mapping[str, Any]], text: str) -> int | None:
    """The step ``text`` names among ``records``: a number as it is (``1200``, ``4B``), a revision's name as the
    step of the first record that names it (``step1000-tokens4B``, or a second name of its commit); None: neither."""
    number = parse_readable(text)
    if number is not None:
        return number
    return next((r["step"] for r in records if text == r.get("revision") or text in r.get("revisions", ())), None)
