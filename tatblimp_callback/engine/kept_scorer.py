"""The one scorer an evaluator keeps for a model: the cache put on the model's device, and the scorer made once per
model, again only when the model moved to another device or dtype or the evaluator's options changed.

``Evaluator`` and ``ForcedChoiceEvaluator`` (``chat/forced_choice.py``) keep theirs through ``scorer_for``; a vLLM
engine's scorer is kept by ``vllm_scoring.vllm_scorer_for``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ..tokenized.cache import SentenceCache
from . import distributed
from .model_checks import input_device
from .precision import training_autocast_dtype
from .scoring import Scorer, unwrap_model
from .vllm_scoring import is_vllm_engine, vllm_scorer_for


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the cache goes: the model's device; with a ``device_map`` (``hf_device_map``), its input embeddings'."""
    lm = unwrap_model(model)
    if getattr(lm, "hf_device_map", None):
        return input_device(lm)
    return next(lm.parameters()).device


def scorer_for(evaluator, model: torch.nn.Module, build: Callable[[torch.device], SentenceCache], **options) -> Scorer:
    """``evaluator._scorer`` for ``model``, made once per model (``Scorer(model, cache, **options)``).

    The evaluator's ``cache`` is built on the model's device by ``build(device)`` when it has none,
    and moved there when it is elsewhere; the scorer is made again when the model moved to another
    device or dtype since it was made, or when ``options`` (the evaluator's ``memory_budget``, ``truncate``,
    ``method``) changed.
    """
    if getattr(evaluator, "backend", None) == "vllm" or is_vllm_engine(model):
        return vllm_scorer_for(evaluator, model, build, options.get("truncate", False))
    device = model_device(model)
    if device.type == "meta":  # no data there: keep the cache on the CPU, and let the scorer say what is wrong
        device = torch.device("cpu")
    given = _cache_inputs(evaluator)
    if evaluator.cache is not None and getattr(evaluator, "_cache_inputs", given) != given:
        evaluator.cache = evaluator._scorer = None  # its data, tokenizer or prefix token set anew since: built again
    if evaluator.cache is None:
        cache = build(device)
        evaluator._cache_inputs = given
        identity = f"{cache.benchmark_fingerprint} {cache.fingerprint} {cache.num_sentences}"
        what = f"benchmarks or tokenizers (this one's: {cache.num_sentences} sentences, {cache.tokenizer_name})"
        distributed.same_on_every_process(identity, what)
        evaluator.cache = cache
    elif evaluator.cache.device != device:
        evaluator.cache = evaluator.cache.to(device)
    # A model moved to another device or dtype since the last call needs a scorer (layouts, masks, method) of its
    # own; so do options changed since (``evaluator.memory_budget = ...``): the scorer would keep its own.
    # "auto" precision is the autocast dtype of the moment (a plain loop may score at step 0, then train under autocast)
    wanted = {**options, "autocast": training_autocast_dtype(model)} if options.get("precision") == "auto" else options
    scorer = evaluator._scorer
    if scorer is None or not scorer.serves(model) or getattr(evaluator, "_scorer_options", None) != wanted:
        evaluator._scorer, evaluator._scorer_options = Scorer(model, evaluator.cache, **options), wanted
    return evaluator._scorer


def _cache_inputs(evaluator) -> tuple:
    """What an evaluator's cache is built from: its data (a path, or a ``Benchmark`` by identity), tokenizer and prefix
    token; a cache given ready-made (``Evaluator(cache=...)``) has none."""
    data = getattr(evaluator, "data", None)
    return (
        data if data is None or isinstance(data, (str, os.PathLike)) else id(data),
        id(getattr(evaluator, "tokenizer", None)),
        getattr(evaluator, "prefix_token_id", None),
    )
