"""One identity for what was scored: a fingerprint of a benchmark's or a suite's pairs and of the bytes they came from.

The md5 of a file says which bytes were read; it does not say which pairs were scored: a column mapping
read the other way round (``good=B,bad=A``), a selection (``Benchmark.select``, ``--limit``) or a subset
built by hand all come from the same bytes. ``fingerprint`` hashes the bytes' md5 together with every
scored pair (its sentences, phenomenon and subtype, in order), so it changes whenever what was scored
changes, whichever way it changed. TatBLiMP and the suites get it from this one function; the tokenized
cache, ``sweep``'s refusal to mix files and ``flips.pair_sentences`` all compare it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

FINGERPRINT_LENGTH = 16


def fingerprint(md5: str, pairs: Iterable[Any]) -> str:
    """16 hex digits naming the ``pairs`` (``Pair``-like: good, bad, phenomenon, subtype) read from bytes of ``md5``."""
    digest = hashlib.sha256(f"tatblimp-pairs:1\n{md5}\n".encode())
    for pair in pairs:
        # Separators that no field can hold unescaped: json.dumps would be slower for 67,000 pairs.
        fields = (pair.good, pair.bad, pair.phenomenon, "\x00" if pair.subtype is None else pair.subtype)
        digest.update(("\x1f".join(fields) + "\x1e").encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:FINGERPRINT_LENGTH]


def record_fingerprint(record: dict[str, Any]) -> str | None:
    """The fingerprint a results record (``Results.to_dict()``, a history or sweep line) names; None in records
    written before fingerprints were (they are compared by md5 and selection instead)."""
    return (record.get("benchmark") or {}).get("fingerprint")
