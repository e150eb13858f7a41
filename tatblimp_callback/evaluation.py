"""The Python entry points: ``evaluate`` for one score, ``Evaluator`` for repeated scoring in a loop."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from . import distributed
from .cache import SentenceCache, build_cache
from .data import Benchmark
from .metrics import Results, compute_results
from .scoring import ScorePath, Scorer, unwrap_model


def model_device(model: torch.nn.Module) -> torch.device:
    return next(unwrap_model(model).parameters()).device


class Evaluator:
    """Holds the tokenized benchmark and a scorer, so each evaluation is a forward pass and nothing more.

    Use it in a custom training loop::

        evaluator = Evaluator(tokenizer, data="test.jsonl")
        for step in ...:
            if step % 500 == 0:
                results = evaluator(model)
                print(step, results.acc_norm)

    Args:
        tokenizer: a Hugging Face tokenizer or a ``SentencePieceTokenizer``; not needed with ``cache``.
        data: a ``Benchmark``, a JSONL path, or None for ``TATBLIMP_DATA`` / the Hub dataset.
        cache: an already built ``SentenceCache``; it is moved to the model's device.
        prefix_token_id: the token put before every sentence (default: BOS, else EOS).
        allow_modified: accept a benchmark file that is not the official release.
        memory_budget: extra bytes one evaluation may use (default: from free device memory).
        truncate: cut sentences longer than the model's context instead of raising.
        path: force a scoring path ("tree", "packed", "padded" or a ``ScorePath``); default: checked once.
        cache_path: a safetensors file to load the cache from, or to save it to once built.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        data: Benchmark | str | os.PathLike | None = None,
        *,
        cache: SentenceCache | None = None,
        prefix_token_id: int | None = None,
        allow_modified: bool = False,
        memory_budget: int | None = None,
        truncate: bool = False,
        path: ScorePath | str | None = None,
        cache_path: str | os.PathLike | None = None,
    ):
        if tokenizer is None and cache is None:
            raise ValueError("Evaluator needs a tokenizer or a prebuilt cache")
        self.tokenizer = tokenizer
        self.data = data
        self.cache = cache
        self.prefix_token_id = prefix_token_id
        self.allow_modified = allow_modified
        self.memory_budget = memory_budget
        self.truncate = truncate
        self.path = path
        self.cache_path = cache_path
        self._scorer: Scorer | None = None

    def prepare(self, model: torch.nn.Module) -> Scorer:
        """Build (or move) the cache to the model's device and set up the scorer; done once per model."""
        device = model_device(model)
        if self.cache is None:
            self.cache = build_cache(
                self.tokenizer,
                self.data,
                device=device,
                prefix_token_id=self.prefix_token_id,
                allow_modified=self.allow_modified,
                cache_path=self.cache_path,
            )
        elif self.cache.device != device:
            self.cache = self.cache.to(device)
        if self._scorer is None or self._scorer.model is not model:
            self._scorer = Scorer(
                model, self.cache, memory_budget=self.memory_budget, truncate=self.truncate, path=self.path
            )
        return self._scorer

    def __call__(self, model: torch.nn.Module) -> Results:
        """Score every pair with ``model`` and return the results.

        Under ``torch.distributed`` every process calls this; each scores a share of the batches
        and all of them return the same results. A failure on one process raises on all of them.
        """
        with distributed.shared_failures():  # the other processes are about to check in
            scorer = self.prepare(model)
        start = time.perf_counter()
        logprobs = scorer.score()
        seconds = time.perf_counter() - start
        layout = scorer.layout()
        extra = {
            "path": str(scorer.path),
            "seconds": seconds,
            "padding_share": layout.padding_share,
            "shared_share": layout.shared_share,
            "oom_retries": scorer.oom_retries,
        }
        return compute_results(scorer.cache, logprobs, extra)


def evaluate(model: torch.nn.Module, tokenizer: Any = None, data: Benchmark | str | os.PathLike | None = None, **options) -> Results:
    """Score ``model`` on TatBLiMP (or another minimal-pair file) once.

    ``options`` are those of ``Evaluator``. For repeated scoring keep an ``Evaluator``, which
    tokenizes only once.
    """
    return Evaluator(tokenizer, data, **options)(model)
