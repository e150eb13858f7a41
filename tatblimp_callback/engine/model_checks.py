"""What is checked about a model before and while it is scored.

Before any forward pass: weights that exist (not on the meta device), an embedding that covers
every token id, sequences that fit the model's context. For the choice of the scoring method: which
4D mask its attention takes, whether its forward reads ``position_ids`` at all (prefix-tree and
packed rows depend on them), and a cheap fingerprint of its weights that says when they have
moved enough to check the method again; and ``weights_label``, which names every bit of the weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from ..tokenized.cache import SentenceCache
from .model_state import parameters_of

logger = logging.getLogger(__name__)

FINGERPRINT_VALUES = 64  # sampled values per parameter tensor


class ScoringError(RuntimeError):
    """The model cannot be scored with this cache (meta weights, vocabulary mismatch, too-long sentence, ...)."""


class VocabularyMismatch(ScoringError):
    """A token id the model cannot embed: ``cause`` is ``"tokenizer"`` (its ids) or ``"prefix token"`` (the one
    chosen)."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face causal LM inside DDP, FSDP1, DeepSpeed, ``torch.compile``, Lightning Fabric and PEFT wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif hasattr(model, "_forward_module") and hasattr(model, "_original_module"):  # Fabric's _FabricModule
            model = model._original_module
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel) or type(model).__name__ in (
            "FullyShardedDataParallel",
            "DeepSpeedEngine",
        ):
            model = model.module
        elif hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
            model = model.get_base_model()
        else:
            return model


def check_causal_lm(lm: torch.nn.Module) -> None:
    """ScoringError up front for a model that does not predict each token from the earlier ones (BERT, T5, ...).

    A class of transformers' own counts as a causal LM when ``AutoModelForCausalLM`` can build it; a class
    from elsewhere (remote code, a user's subclass) is taken at its word unless its config says encoder-decoder.
    """
    cls = type(lm)
    from_transformers = cls.__module__.startswith("transformers.")
    encoder_decoder = getattr(getattr(lm, "config", None), "is_encoder_decoder", False)
    if encoder_decoder or (from_transformers and cls.__name__ not in _causal_lm_class_names()):
        raise ScoringError(
            f"{cls.__name__} is not a causal language model: TatBLiMP needs log p(token | earlier tokens), "
            "which only a model loadable with AutoModelForCausalLM gives"
        )


def check_causal_config(folder: str | os.PathLike) -> None:
    """ScoringError before loading when the ``config.json`` in ``folder`` describes no causal LM: an encoder-decoder
    (T5) or a model saved as a masked LM (``BertForMaskedLM``), which ``AutoModelForCausalLM`` would refuse
    with an error about configuration classes, or load as a decoder it never was."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # transformers says what is wrong with it
    architectures = config.get("architectures") or [] if isinstance(config, dict) else []
    not_causal = set(MODEL_FOR_MASKED_LM_MAPPING_NAMES.values()) | set(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.values())
    causal = _causal_lm_class_names()
    named = [a for a in architectures if isinstance(a, str)]
    if (isinstance(config, dict) and config.get("is_encoder_decoder")) or (
        named and all(a in not_causal and a not in causal for a in named)
    ):
        what = ", ".join(named) or f"a {config.get('model_type')} model"
        raise ScoringError(
            f"{folder} holds {what}, not a causal language model: TatBLiMP needs log p(token | earlier tokens), "
            "which only a model loadable with AutoModelForCausalLM gives"
        )


def _causal_lm_class_names() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def check_weights_and_vocabulary(lm: torch.nn.Module, cache: SentenceCache) -> None:
    """A clear error before any forward pass for meta-device weights or a tokenizer the model cannot embed."""
    if has_missing_weights(lm):
        raise ScoringError("the model has weights on the meta device; load or materialise them before scoring")
    check_vocabulary(cache, embedding_rows(lm))


def embedding_rows(lm: torch.nn.Module) -> int:
    """The token ids ``lm`` can embed: its input embedding's rows (``num_embeddings``: a sharded weight's local shape
    is a shard's, ZeRO-3's and FSDP1's)."""
    embedding = lm.get_input_embeddings()
    return getattr(embedding, "num_embeddings", None) or embedding.weight.shape[0]


def check_vocabulary(cache: SentenceCache, embeddings: int) -> None:
    """A clear error for a prefix token or a tokenizer's id that a model with ``embeddings`` rows cannot embed."""
    largest_token_id = max([int(cache.token_ids.max()), *cache.answer_ids])
    if not cache.answer_ids and not 0 <= cache.prefix_token_id < embeddings:  # the caller's choice, not the tokenizer's
        raise VocabularyMismatch(
            f"prefix token id {cache.prefix_token_id} is not a token of the model (its embedding has {embeddings} rows); "
            "pass a prefix_token_id below that (tatblimp: --prefix-token-id), or none for the tokenizer's BOS/EOS",
            "prefix token",
        )
    if largest_token_id >= embeddings:
        raise VocabularyMismatch(
            f"tokenizer {cache.tokenizer_name} produces token id {largest_token_id}, but the model's embedding "
            f"has only {embeddings} rows: the tokenizer does not belong to this model",
            "tokenizer",
        )


def _offloaded(module: torch.nn.Module) -> bool:
    """Whether accelerate's hook on ``module`` loads its own weights from CPU or disk offload at each forward."""
    hook = getattr(module, "_hf_hook", None)
    return any(getattr(h, "offload", False) for h in getattr(hook, "hooks", [hook]))  # SequentialHook holds several


def has_missing_weights(lm: torch.nn.Module) -> bool:
    """Whether a weight is on the meta device without an accelerate offload hook that brings it in (``device_map``)."""
    return any(not _offloaded(module) and any(p.is_meta for p in module.parameters(recurse=False)) for module in lm.modules())


def input_device(lm: torch.nn.Module) -> torch.device:
    """Where the model takes its input ids: the input embeddings' device, or the device accelerate's hook
    runs them on (a ``device_map`` with offload leaves the weight on the meta device); for input embeddings
    without a weight (a ``CallableLM``'s declared vocabulary), the model's first parameter's."""
    embedding = lm.get_input_embeddings()
    hook = getattr(embedding, "_hf_hook", None)
    execution = getattr(hook, "execution_device", None)
    if execution is not None:
        return torch.device("cpu" if execution == "disk" else execution)
    weight = getattr(embedding, "weight", None)
    return weight.device if isinstance(weight, torch.Tensor) else next(lm.parameters()).device


def fit_to_context(lm: torch.nn.Module, cache: SentenceCache, truncate: bool) -> SentenceCache:
    """``cache`` itself if every sequence fits the model's context; cut to it with ``truncate``; else ScoringError.

    Forced-choice prompts are never cut: the question would be lost.
    """
    return fit_cache_to_context(cache, getattr(lm.config, "max_position_embeddings", None), truncate)


def fit_cache_to_context(cache: SentenceCache, context: int | None, truncate: bool, room: int = 0) -> SentenceCache:
    """``fit_to_context`` for a model whose context is ``context`` tokens (None: unlimited), leaving ``room``
    positions after each sequence (vLLM generates one token after every prompt, within its context)."""
    spans = len(cache.span_tokens)  # harness requests, last: their last token is a target only
    if spans and context is not None and max(cache.lengths[-spans:]) - 1 > context - room:
        raise ScoringError(
            f"a harness request of {max(cache.lengths[-spans:])} tokens is over the model's context of {context} plus one"
        )
    lengths = cache.lengths[: cache.num_sentences - spans]
    longest = max(lengths, default=0)
    if context is None or longest <= context - room:
        return cache
    if room:
        what = f"the model's context of {context} less the {room} token generated after each"
        context -= room
    else:
        what = f"the model's context of {context}"
    k = lengths.index(longest)
    if cache.answer_ids:
        raise ScoringError(
            f"forced-choice item {k} (pair {k // 2}, {'good' if k % 2 == 0 else 'bad'}_first) has {longest} prompt "
            f"tokens, more than {what}; a prompt cannot be cut without losing the question"
        )
    if not truncate:
        too_long = sum(length > context for length in lengths)
        raise ScoringError(
            f"{too_long:,} of {cache.num_sentences:,} sentences have more tokens than {what} "
            f"(the longest, pair {k // 2}'s {'good' if k % 2 == 0 else 'bad'} sentence, has {longest}); "
            "pass truncate=True (tatblimp: --truncate) to cut them"
        )
    cut = cache.cut_to(context)
    logger.warning("tatblimp: %d sentences cut to %d tokens (%s)", len(cut.truncated), context, what)
    return cut


def tree_mask_dtype(lm: torch.nn.Module) -> torch.dtype | None:
    """The 4D mask the model's attention takes: boolean for sdpa, additive for eager; None for others."""
    implementation = getattr(lm.config, "_attn_implementation", None)
    return {"sdpa": torch.bool, "eager": next(lm.parameters()).dtype}.get(implementation)


def forward_reads_position_ids(
    run: Callable[[torch.Tensor], torch.Tensor], position_ids: torch.Tensor, context: int | None
) -> bool:
    """Whether ``run(position_ids)`` (a forward of one batch) changes when the position ids are doubled.

    Doubling changes every distance between positions, so a forward that reads the ids gives other
    outputs; one that drops them (and builds its own positions 0, 1, 2, ... along the row) gives
    bit-identical ones, whatever its weights. Ids that doubled would pass the context keep their value.
    """
    doubled = position_ids * 2
    if context is not None:
        doubled = torch.where(doubled < context, doubled, position_ids)
    return not torch.equal(run(position_ids), run(doubled))


def weight_fingerprint(lm: torch.nn.Module) -> torch.Tensor:
    """Up to ``FINGERPRINT_VALUES`` evenly spaced values of every floating-point weight tensor, float64 on the CPU.

    Of a sharded weight (FSDP2, tensor parallel) this process's shard; processes combine their verdicts. The values of
    each device are gathered in one ``cat`` of strided views and go to the CPU together (one copy, not one per weight:
    a device map leaves weights on several devices).
    """
    parts: dict[torch.device, list[torch.Tensor]] = {}
    for parameter in parameters_of(lm):
        if parameter.is_meta:  # offloaded to disk or CPU by a device map: read only while its layer runs
            continue
        local = (parameter.to_local() if hasattr(parameter, "to_local") else parameter).detach()
        count = local.numel()
        if count and local.is_floating_point():
            step = max(1, count // FINGERPRINT_VALUES)
            if local.is_contiguous():  # flat[::step][:FINGERPRINT_VALUES] as one view
                sampled = local.as_strided((min(FINGERPRINT_VALUES, -(-count // step)),), (step,))
            else:
                sampled = local.reshape(-1)[::step][:FINGERPRINT_VALUES]
            parts.setdefault(local.device, []).append(sampled)
    values = []
    for device, sampled in parts.items():
        # Outside autocast: bf16 weights under a float16 autocast make its cat fail ("Unexpected floating ScalarType").
        with torch.autocast(device.type, enabled=False):
            values.append(torch.cat(sampled).to(torch.float64).cpu())
    return torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)


def weights_label(lm: torch.nn.Module) -> str | None:
    """16 hex digits that name the model's weights as they are now: every bit of every parameter and buffer,
    with their names, dtypes and shapes, hashed with sha256 (``tensor_digest``).

    Two models whose weights differ in any bit get different labels (on an accelerator, several changed values
    that cancel out have a chance of 2**-64 of passing). Of a sharded weight, this process's shard (DeepSpeed
    ZeRO-3's partition); None when this process holds none.
    """
    digest = hashlib.sha256()
    held = False
    for name, tensor in [*lm.named_parameters(), *lm.named_buffers()]:
        if tensor.is_meta:  # offloaded by a device map: the label names the weights held in memory
            continue
        local = getattr(tensor, "ds_tensor", None)
        if local is None:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if not local.numel():
            continue
        held = held or local.is_floating_point()
        digest.update(f"{name}:{local.dtype}:{tuple(local.shape)}:".encode())
        digest.update(tensor_digest(local))
    return digest.hexdigest()[:16] if held else None


DIGEST_CHUNK = 1 << 22  # values per partial sum of ``device_digest``
_MULTIPLIERS: dict[torch.device, torch.Tensor] = {}


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """A digest of every bit of ``tensor``: on the CPU the sha256 of its bytes; elsewhere ``device_digest``,
    computed where the tensor is (copying a model's weights to the host would cost more than scoring it)."""
    words = _words(tensor)
    if words.device.type == "cpu":
        # Of a copy: a numpy view of the tensor's own storage would leave it unresizable (FSDP2 frees a gathered
        # parameter by resizing its storage to 0).
        return hashlib.sha256(words.clone().numpy()).digest()
    return device_digest(words).numpy().tobytes()


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes, flat, as 16-bit words (8-bit for an odd byte count or an odd address)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return raw.view(torch.int16) if raw.numel() % 2 == 0 and raw.data_ptr() % 2 == 0 else raw


def device_digest(words: torch.Tensor) -> torch.Tensor:
    """An int64 per ``DIGEST_CHUNK`` words (on the CPU): the sum, wrapping mod 2**64, of each word times a
    pseudo-random odd multiplier of its position. A change of any one word changes its chunk's sum (an odd
    number times a nonzero difference below 2**16 is never 0 mod 2**64); several cancel with a chance of 2**-64.
    """
    multipliers = _multipliers(words.device)
    sums = [
        (words[start : start + DIGEST_CHUNK].long() * multipliers[: min(DIGEST_CHUNK, words.numel() - start)]).sum()
        for start in range(0, words.numel(), DIGEST_CHUNK)
    ]
    return torch.stack(sums).cpu()


def _multipliers(device: torch.device) -> torch.Tensor:
    """``DIGEST_CHUNK`` odd int64 multipliers (splitmix64 of the position), made once per device."""
    if device not in _MULTIPLIERS:
        z = torch.arange(DIGEST_CHUNK, dtype=torch.int64, device=device) * -7046029254386353131  # 0x9E3779B97F4A7C15
        z = (z ^ _shift_right(z, 30)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
        z = (z ^ _shift_right(z, 27)) * -7723592293110705685  # 0x94D049BB133111EB
        _MULTIPLIERS[device] = (z ^ _shift_right(z, 31)) | 1
    return _MULTIPLIERS[device]


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """The logical (unsigned) right shift of int64 values; torch's ``>>`` is arithmetic."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def relative_change(now: torch.Tensor, then: torch.Tensor) -> float:
    """||now - then|| / ||then||, the relative distance between two weight fingerprints (inf if their shapes differ)."""
    if now.shape != then.shape:
        return float("inf")
    return float((now - then).norm() / then.norm().clamp_min(torch.finfo(torch.float64).tiny))
