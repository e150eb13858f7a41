"""lm-evaluation-harness tasks scored inside a training run, on the training model itself (no second copy).

``HarnessTasks`` wraps the training model in ``--model tatblimp`` (``model.TatBLiMPLM``, given the model object:
nothing is loaded or copied) and runs the harness's own ``evaluate`` on the tasks named, so that every number is
the harness's: its requests, its ``process_results``, filters and aggregation, group scores included. Each
evaluation's metrics come back flat, as ``lm_eval/<task>/<metric>`` (a filter other than ``none`` is added to the
metric's name: ``exact_match_flexible-extract``); standard errors are left out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from . import task_path

PREFIX = "lm_eval"


class HarnessTasks:
    """Score harness tasks (``["blimp", "my_mc_task"]``, groups too) on a model: ``harness(model)`` -> flat metrics.

    Args:
        tasks: task or group names the harness knows (its own, the TatBLiMP tasks, or those under ``include_path``).
        tokenizer: the model's tokenizer (what the harness encodes the requests with).
        include_path: a folder (or folders) of the caller's task YAML files.
        limit: score only the first ``limit`` documents of each task (a quick, partial run).
        memory_budget: bytes of extra memory for the forward passes (None: the engine's default).
    """

    def __init__(
        self,
        tasks: Sequence[str],
        tokenizer: Any,
        *,
        include_path: str | Sequence[str] | None = None,
        limit: int | None = None,
        memory_budget: int | None = None,
    ):
        if isinstance(tasks, str) or not tasks:
            raise ValueError(f"lm_eval_tasks must be a non-empty list of task names, got {tasks!r}")
        from lm_eval.tasks import TaskManager

        extra = [include_path] if isinstance(include_path, str) else list(include_path or [])
        self.tasks, self.tokenizer, self.limit, self.memory_budget = list(tasks), tokenizer, limit, memory_budget
        self.manager = TaskManager(include_path=[str(task_path()), *map(str, extra)])
        unknown = [name for name in self.tasks if name not in self.manager.all_tasks]
        if unknown:
            raise ValueError(f"lm_eval_tasks: the harness knows no task {unknown} (include_path={include_path!r})")
        self._lm = None

    def _model_for(self, model: torch.nn.Module):
        from .model import TatBLiMPLM

        if self._lm is None or self._lm.model is not model:
            quiet = logging.getLogger("lm_eval.models.huggingface")
            level, quiet.level = quiet.level, logging.ERROR  # its warnings about a model passed as an object
            try:
                self._lm = TatBLiMPLM(pretrained=model, tokenizer=self.tokenizer, memory_budget=self.memory_budget)
            finally:
                quiet.setLevel(level)
        return self._lm

    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        """The harness's metrics of every task and group for ``model`` now, as ``lm_eval/<task>/<metric>``."""
        from lm_eval.evaluator import evaluate

        lm = self._model_for(model)
        tasks = self.manager.load(self.tasks)  # built again each time: the harness's evaluate fills them in
        out = evaluate(lm, tasks, limit=self.limit, bootstrap_iters=0, log_samples=False, verbosity="ERROR")
        return flat_metrics(out["results"])


def flat_metrics(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The harness's ``results`` (``{task: {"acc,none": 0.61, ...}}``) as ``{"lm_eval/<task>/acc": 0.61, ...}``."""
    flat = {}
    for task, values in results.items():
        for key, value in values.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filter_name = key.split(",", 1)
            name = metric if filter_name == "none" else f"{metric}_{filter_name}"
            flat[f"{PREFIX}/{task}/{name}"] = float(value)
    return flat
