"""lm-evaluation-harness tasks scored inside a training run, on the training model itself, in TatBLiMP's fused pass.

``HarnessTasks.prepare`` loads the tasks, builds their requests (the harness's own ``build_all_requests``, on one
process: every process holds them all) and encodes each distinct request once, the harness's way
(``model.TatBLiMPLM``, ``--model tatblimp`` wrapping the model object: nothing is loaded or copied; its
``_encode_pair`` rule, its prefix token, its rolling windows), into ``Spans``: token sequences of which the
continuation's tokens are scored. The evaluator puts them in TatBLiMP's cache, so that one layout and one sweep
of forward calls (sharded over processes as TatBLiMP's are) give TatBLiMP's log-probs and each request's
``(log-prob, is_greedy)`` (``engine/scored_spans.py``). ``metrics`` then runs the harness's own ``evaluate``
with a model that answers every request from that table, so that every number is the harness's: its
``process_results``, filters and aggregation, group scores included. The metrics come back flat, as
``lm_eval/<task>/<metric>`` (a filter other than ``none`` is added to the metric's name:
``exact_match_flexible-extract``); standard errors are left out. ``generate_until`` requests are the harness's
``HFLM``'s, generated at each evaluation.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import torch

from ..engine.model_state import scoring_mode
from ..engine.scored_spans import Spans
from . import task_path
from .fused import request_sequences

PREFIX = "lm_eval"
SCORED = ("loglikelihood", "loglikelihood_rolling")  # the request types the fused pass answers


class HarnessTasks:
    """Harness tasks (``["blimp", "my_mc_task"]``, groups too) on a model: ``prepare(model)`` -> ``Spans`` once, then
    ``metrics(span_scores)`` (or ``harness(model)``, a pass of its own) -> flat metrics at each evaluation.

    Args:
        tasks: task or group names the harness knows (its own, the TatBLiMP tasks, or those under ``include_path``).
        tokenizer: the model's tokenizer (what the harness encodes the requests with).
        include_path: a folder (or folders) of the caller's task YAML files.
        limit: score only the first ``limit`` documents of each task (a quick, partial run).
        memory_budget: bytes of extra memory for the forward passes of ``harness(model)`` (None: the engine's default).
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
        paths = [str(task_path()), *map(str, extra)]
        # The harness's own tasks are indexed (tens of thousands of YAML files, a minute on a loaded CPU) only when needed.
        self.manager = TaskManager(include_path=paths, include_defaults=False)
        if any(name not in self.manager.all_tasks for name in self.tasks):
            self.manager = TaskManager(include_path=paths)
        unknown = [name for name in self.tasks if name not in self.manager.all_tasks]
        if unknown:
            raise ValueError(f"lm_eval_tasks: the harness knows no task {unknown} (include_path={include_path!r})")
        self._lm = None
        self.task_dict = None  # the loaded tasks, kept: the harness's evaluate fills their instances in each time
        self.spans: Spans | None = None
        self._requests: list[tuple[list[int], list[int]]] = []  # every encoded (context, continuation), span order
        self._owners: dict[tuple[str, tuple], list[int]] = {}  # (request type, args) -> its spans (rolling: windows)

    def _model_for(self, model: torch.nn.Module):
        from .model import TatBLiMPLM

        if self._lm is None or self._lm.model is not model:
            quiet = logging.getLogger("lm_eval.models.huggingface")
            level, quiet.level = quiet.level, logging.ERROR  # its warnings about a model passed as an object
            try:
                # HFLM puts the model in eval mode (back as it was on leaving) and sets a pad token on the tokenizer,
                # or adds one: on a copy, so that the training tokenizer stays as the user made it.
                tokenizer = copy.deepcopy(self.tokenizer)
                with scoring_mode(model):
                    self._lm = TatBLiMPLM(
                        pretrained=model, tokenizer=tokenizer, memory_budget=self.memory_budget, release_memory=True
                    )
            finally:
                quiet.setLevel(level)
        return self._lm

    def prepare(self, model: torch.nn.Module) -> Spans:
        """The tasks loaded, their requests built and each distinct one encoded, once: the sequences to score (none
        when the tasks only generate)."""
        if self.spans is not None:
            return self.spans
        from lm_eval.evaluator_utils import get_sample_size

        lm = self._model_for(model)
        self.task_dict = self.manager.load(self.tasks)
        seed_fewshot(self.task_dict)
        for task in self.task_dict["tasks"].values():  # as the harness's evaluate builds them, on one process
            task.build_all_requests(limit=get_sample_size(task, self.limit), rank=0, world_size=1)
            for instance in task.instances:
                key = (instance.request_type, tuple(instance.args))
                if instance.request_type not in SCORED or key in self._owners:
                    continue
                if instance.request_type == "loglikelihood":
                    encoded = lm.encode([instance])
                else:
                    encoded = lm.rolling_windows(instance.args[0])
                self._owners[key] = list(range(len(self._requests), len(self._requests) + len(encoded)))
                self._requests += encoded
        sequences, continuation_lengths = request_sequences(self._requests, lm.max_length)
        self.spans = Spans(sequences, continuation_lengths)
        return self.spans

    def metrics(self, span_scores: Sequence[tuple[float, bool]]) -> dict[str, float]:
        """The harness's metrics of every task and group from each span's ``(log-prob, is_greedy)``, flat."""
        from lm_eval.evaluator import evaluate

        from .answers import TableLM

        if len(span_scores) != len(self._requests):
            raise ValueError(f"{len(span_scores)} span scores for {len(self._requests)} harness requests")
        answers = {}
        for (kind, args), spans in self._owners.items():
            if kind == "loglikelihood":
                answers[kind, args] = span_scores[spans[0]]
            else:  # a string's rolling windows, added in window order
                answers[kind, args] = sum(span_scores[k][0] for k in spans)
        lm = TableLM(answers, generator=self._lm)
        seed_fewshot(self.task_dict)  # its evaluate builds the requests again: with the few-shot examples of prepare
        out = evaluate(lm, self.task_dict, limit=self.limit, bootstrap_iters=0, log_samples=False, verbosity="ERROR")
        return flat_metrics(out["results"])

    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        """The harness's metrics for ``model`` now, its requests scored in a pass of their own (no TatBLiMP pass)."""
        self.prepare(model)
        lm = self._model_for(model)
        return self.metrics(lm.request_scorer.score(self._requests, lm.prefix_token_id, lm.max_length))


def seed_fewshot(task_dict: dict[str, Any]) -> None:
    """Seed each task's few-shot sampler as ``simple_evaluate`` does by default (``lm_eval --model hf`` draws the same
    examples), anew before each build of the requests: a build draws from the sampler, so that a second one unseeded
    would draw other examples, and requests not built at ``prepare``."""
    from lm_eval.defaults import DEFAULT_OTHER_SEED

    for task in task_dict["tasks"].values():
        task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)


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
