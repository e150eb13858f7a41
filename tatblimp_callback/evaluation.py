"""The Python entry points: ``evaluate`` for one score, ``Evaluator`` for repeated scoring in a loop."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from . import distributed
from .cache import SentenceCache, build_cache
from .data import Benchmark
from .metrics import Results, compute_results
from .model_checks import input_device, weights_label
from .provenance import provenance
from .scoring import Scorer, ScoringMethod, unwrap_model
from .token_results import pair_tokens


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the cache goes: the model's device; with a ``device_map`` (``hf_device_map``), its input embeddings'."""
    lm = unwrap_model(model)
    if getattr(lm, "hf_device_map", None):
        return input_device(lm)
    return next(lm.parameters()).device


class Evaluator:
    """Holds the tokenized benchmark and a scorer, so each evaluation is a forward pass and nothing more.

    The benchmark is read and tokenized at the first call, on the model's device, and kept; each call
    scores every pair with the model it is given.

    Example:
        In a custom training loop:

        ```python
        evaluator = Evaluator(tokenizer, data="test.jsonl")
        for step in ...:
            if step % 500 == 0:
                results = evaluator(model)
                print(step, results.acc_norm)
        ```

    Args:
        tokenizer: a Hugging Face tokenizer or a ``SentencePieceTokenizer``; not needed with ``cache``.
        data: a ``Benchmark``, a JSONL path, or None for ``TATBLIMP_DATA`` / the Hub dataset.
        cache: an already built ``SentenceCache``; it is moved to the model's device.
        prefix_token_id: the token put before every sentence (default: BOS, else EOS).
        allow_modified: accept a benchmark file that is not the official release.
        memory_budget: extra bytes one evaluation may use (default: from free device memory).
        truncate: cut sentences longer than the model's context instead of raising.
        method: force a scoring method (a ``ScoringMethod``, or a layout: "tree", "packed", "padded");
            default: chosen and checked by the scorer.
        cache_path: a safetensors file to load the cache from, or to save it to once built.
        include_tokens: also give each pair's token log-probs, token texts and edit span
            (``Results.pair_tokens``, see ``token_results``); the texts need ``tokenizer``.

    Raises:
        ValueError: neither ``tokenizer`` nor ``cache`` is given.
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
        method: ScoringMethod | str | None = None,
        cache_path: str | os.PathLike | None = None,
        include_tokens: bool = False,
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
        self.method = method
        self.cache_path = cache_path
        self.include_tokens = include_tokens
        self._scorer: Scorer | None = None

    def prepare(self, model: torch.nn.Module) -> Scorer:
        """Build (or move) the cache to the model's device and set up the scorer; done once per model."""

        def build(device: torch.device) -> SentenceCache:
            return build_cache(
                self.tokenizer,
                self.data,
                device=device,
                prefix_token_id=self.prefix_token_id,
                allow_modified=self.allow_modified,
                cache_path=self.cache_path,
            )

        return scorer_for(self, model, build, memory_budget=self.memory_budget, truncate=self.truncate, method=self.method)

    def __call__(self, model: torch.nn.Module) -> Results:
        """Score every pair with ``model`` and return the results.

        Under ``torch.distributed`` every process calls this; each scores a share of the batches
        and all of them return the same results. A failure on one process raises on all of them.

        Args:
            model: a causal LM (``AutoModelForCausalLM``), bare or wrapped in DDP, FSDP, ``torch.compile``
                or PEFT; it is scored in eval mode without gradients and put back in the mode it was in.

        Returns:
            The metrics overall, per phenomenon and subtype, and per pair.

        Raises:
            BenchmarkError: the benchmark file cannot be read, is malformed, or is not the official release
                (without ``allow_modified``).
            TokenizationError: no prefix token can be found, or a sentence encodes to no tokens.
            ScoringError: the model cannot score the benchmark (weights on the meta device, a vocabulary
                smaller than the tokenizer's, a sentence longer than its context without ``truncate``).
            PeerFailure: under ``torch.distributed``, scoring failed on another process.
        """
        with distributed.shared_failures():  # the other processes are about to check in
            scorer = self.prepare(model)
        logprobs, run_info = timed_score(scorer)
        results = compute_results(scorer.cache, logprobs, run_info)
        if self.include_tokens:
            results.pair_tokens = pair_tokens(scorer.cache, scorer.token_logprobs(), self.tokenizer)
        return results


def scorer_for(evaluator, model: torch.nn.Module, build: Callable[[torch.device], SentenceCache], **options) -> Scorer:
    """``evaluator._scorer`` for ``model``, made once per model (``Scorer(model, cache, **options)``).

    The evaluator's ``cache`` is built on the model's device by ``build(device)`` when it has none,
    and moved there when it is elsewhere; the scorer is made again when the model moved to another
    device or dtype since it was made.
    """
    device = model_device(model)
    if device.type == "meta":  # no data there: keep the cache on the CPU, and let the scorer say what is wrong
        device = torch.device("cpu")
    if evaluator.cache is None:
        evaluator.cache = build(device)
    elif evaluator.cache.device != device:
        evaluator.cache = evaluator.cache.to(device)
    # A model moved to another device or dtype since the last call needs a scorer (layouts, masks, method) of its own.
    if evaluator._scorer is None or not evaluator._scorer.serves(model):
        evaluator._scorer = Scorer(model, evaluator.cache, **options)
    return evaluator._scorer


def timed_score(scorer: Scorer) -> tuple[torch.Tensor, dict[str, Any]]:
    """``scorer.score()``, and how it was computed: the method, seconds, padding and sharing, retries,
    ``weights``, the label (``model_checks.weights_label``) of the weights it measured, and what made it
    (``provenance``: versions, dtype, device, date)."""
    weights = weights_label(scorer.lm)  # before: the weights measured
    start = time.perf_counter()
    logprobs = scorer.score()
    seconds = time.perf_counter() - start
    layout = scorer.layout()
    return logprobs, {
        "scoring_method": str(scorer.method),
        "seconds": seconds,
        "padding_share": layout.padding_share,
        "saved_by_prefix_sharing": layout.saved_by_prefix_sharing,
        "oom_retries": scorer.oom_retries,
        "method_replacements": scorer.method_replacements,
        "weights": weights,
        **provenance(scorer.model),
    }


def evaluate(
    model: torch.nn.Module, tokenizer: Any = None, data: Benchmark | str | os.PathLike | None = None, **options
) -> Results:
    """Score ``model`` on TatBLiMP (or another minimal-pair file) once.

    ``options`` are those of ``Evaluator``. For repeated scoring keep an ``Evaluator``, which
    tokenizes only once.

    Args:
        model: a causal LM (``AutoModelForCausalLM``), on the device it should be scored on.
        tokenizer: its Hugging Face tokenizer, or a ``SentencePieceTokenizer`` for a model trained on raw
            sentencepiece ids; not needed with ``cache=``.
        data: a ``Benchmark``, a JSONL path, or None for ``$TATBLIMP_DATA``, else the Hub dataset
            ``ilchats/TatBLiMP``.
        **options: keyword arguments of ``Evaluator`` (``prefix_token_id``, ``allow_modified``,
            ``memory_budget``, ``truncate``, ``method``, ``cache``, ``cache_path``, ``include_tokens``).

    Returns:
        The metrics overall, per phenomenon and subtype, and per pair.

    Raises:
        BenchmarkError: the benchmark file cannot be read, is malformed, or is not the official release.
        TokenizationError: no prefix token can be found, or a sentence encodes to no tokens.
        ScoringError: the model cannot score the benchmark (see ``Evaluator.__call__``).

    Example:
        ```python
        results = evaluate(model, tokenizer, "test.jsonl")
        print(results.acc_norm, results.phenomena["binding"].acc_norm)
        ```
    """
    return Evaluator(tokenizer, data, **options)(model)
