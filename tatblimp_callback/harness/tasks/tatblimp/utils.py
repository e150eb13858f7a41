"""The TatBLiMP harness task's data and metrics, read by lm-evaluation-harness from the task's YAML files.

The pairs come from the md5-pinned v1.0 file through the package's own reader (``load_benchmark``: a path
given as ``--metadata '{"data_path": ...}'``, else ``$TATBLIMP_DATA``, else the Hub dataset), so that the
harness scores exactly the pairs ``tatblimp score`` scores, in file order.
"""

from __future__ import annotations

import datasets

from tatblimp_callback.reading.data import load_benchmark


def load_pairs(phenomenon: str | None = None, data_path: str | None = None, **_metadata) -> datasets.DatasetDict:
    """The benchmark's pairs (those of ``phenomenon``, or all) as the task's ``test`` split, with their index in the file."""
    benchmark = load_benchmark(data_path)
    if phenomenon is not None and phenomenon not in benchmark.phenomena:
        raise ValueError(f"TatBLiMP task: no phenomenon {phenomenon!r} in {benchmark.source} (it has {benchmark.phenomena})")
    rows = [
        {"pair": i, "good": p.good, "bad": p.bad, "phenomenon": p.phenomenon, "subtype": p.subtype or ""}
        for i, p in enumerate(benchmark.pairs)
        if phenomenon is None or p.phenomenon == phenomenon
    ]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def process_results(doc: dict, results: list[tuple[float, bool]]) -> dict[str, float]:
    """acc: logP(good) > logP(bad), strictly (a tie fails, as TatBLiMP defines it); acc_norm: the same per UTF-8 byte."""
    (good, _), (bad, _) = results
    good_bytes, bad_bytes = len(doc["good"].encode("utf-8")), len(doc["bad"].encode("utf-8"))
    return {"acc": float(good > bad), "acc_norm": float(good / good_bytes > bad / bad_bytes)}
