"""The TatBLiMP harness task's data and metrics, read by lm-evaluation-harness from the task's YAML files.

The pairs come from the md5-pinned v1.0 file through the package's own reader (``load_benchmark``: a path
given as ``--metadata '{"data_path": ...}'``, else ``$TATBLIMP_DATA``, else the Hub dataset), so that the
harness scores exactly the pairs ``tatblimp score`` scores, in file order.
"""

from __future__ import annotations

from typing import Any

import datasets
from lm_eval.api.task import ConfigurableTask

from tatblimp_callback.reading.data import did_you_mean, load_benchmark


def load_pairs(phenomenon: str | None = None, data_path: str | None = None, **_metadata) -> datasets.DatasetDict:
    """The benchmark's pairs (those of ``phenomenon``, or all) as the task's ``test`` split, with their index in the file."""
    benchmark = load_benchmark(data_path)
    if phenomenon is not None and phenomenon not in benchmark.phenomena:
        hint = did_you_mean(phenomenon, benchmark.phenomena)
        raise ValueError(
            f"TatBLiMP task: no phenomenon {phenomenon!r}{hint} in {benchmark.source} (it has {benchmark.phenomena})"
        )
    rows = [
        {"pair": i, "good": p.good, "bad": p.bad, "phenomenon": p.phenomenon, "subtype": p.subtype or ""}
        for i, p in enumerate(benchmark.pairs)
        if phenomenon is None or p.phenomenon == phenomenon
    ]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


class TatBLiMPTask(ConfigurableTask):
    """A TatBLiMP subtask: the harness's configurable task, its pairs read by ``load_pairs``.

    The YAML names this class instead of giving ``custom_dataset: load_pairs``, with which the harness logs "Custom
    kwargs can be passed to `--metadata`" once per subtask (16 times a run) although there is nothing to pass.
    ``--metadata '{"data_path": ...}'`` still reaches ``load_pairs``.
    """

    def __init__(self, config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        config = {key: value for key, value in (config or {}).items() if key != "class"}  # the YAML's, not a field
        super().__init__(config=config, **kwargs)

    def download(self, dataset_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.dataset = load_pairs(**(self.config.metadata or {}), **(self.config.dataset_kwargs or {}))


def process_results(doc: dict, results: list[tuple[float, bool]]) -> dict[str, float]:
    """acc: logP(good) > logP(bad), strictly (a tie fails, as TatBLiMP defines it); acc_norm: the same per UTF-8 byte."""
    (good, _), (bad, _) = results
    good_bytes, bad_bytes = len(doc["good"].encode("utf-8")), len(doc["bad"].encode("utf-8"))
    return {"acc": float(good > bad), "acc_norm": float(good / good_bytes > bad / bad_bytes)}
