"""Exact, memory-bounded sentence log-probabilities for a causal LM.

The scorer runs the model's body once per batch of packed rows, takes the hidden states at the
scored positions only, and turns them into log-probs in chunks of the LM head, so the full
[tokens x vocabulary] logits never exist at once. Log-softmax is always computed in float32.

Before the first evaluation it checks, on a few sentences, that this fast path gives the same
numbers as a plain one-sentence-at-a-time forward of the whole model, and falls back (padded rows
instead of packed ones; the model's own logits instead of the chunked head) where it does not.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .cache import SentenceCache
from .packing import Batch, Layout, build_layout

logger = logging.getLogger(__name__)

DEFAULT_ROW_LENGTH = 256
CPU_MEMORY_BUDGET = 512 * 2**20
# On a CPU the LM head runs fastest on chunks whose logits stay in cache (measured on 2 cores).
CPU_HEAD_CHUNK_BYTES = 96 * 2**20
MIN_MEMORY_BUDGET = 16 * 2**20


class ScoringError(RuntimeError):
    """The model cannot be scored with this cache (meta weights, vocabulary mismatch, too-long sentence, ...)."""


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face causal LM inside DDP, ``torch.compile`` and PEFT wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
            model = model.get_base_model()
        else:
            return model


@dataclass
class ScorePath:
    """How the scores are computed for a model: the row layout and the head."""

    layout: str  # "packed" or "padded"
    head: str  # "chunked" (hidden states x LM head in chunks) or "logits" (the model's own logits)

    def __str__(self) -> str:
        return f"{self.layout} rows, {self.head} head"


class Scorer:
    """Scores every sentence of a cache with one model; reusable across evaluations.

    Args:
        model: a causal LM (``AutoModelForCausalLM``), bare or wrapped in DDP, ``torch.compile``
            or PEFT.
        cache: the pre-tokenized sentences, on the model's device.
        memory_budget: bytes of extra memory one evaluation may use for activations and logits;
            None sets it from free device memory (a quarter of it on a GPU, 512 MiB on a CPU).
        row_length: tokens per packed row.
        path: force a ``ScorePath`` (or "packed"/"padded"); None checks the fast path once and
            falls back where it disagrees with a plain forward.
        truncate: cut sentences longer than the model's context instead of raising; the number
            cut is reported.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: SentenceCache,
        *,
        memory_budget: int | None = None,
        row_length: int = DEFAULT_ROW_LENGTH,
        path: ScorePath | str | None = None,
        truncate: bool = False,
    ):
        self.model = model
        self.lm = unwrap_model(model)
        self.cache = cache
        self.row_length = row_length
        self.memory_budget = memory_budget or default_memory_budget(cache.device)
        self._check_model(truncate)
        self._layouts: dict[tuple, Layout] = {}
        if isinstance(path, str):
            path = ScorePath(layout=path, head="chunked" if self._head_weight() is not None else "logits")
        self.path = path
        self.oom_retries = 0

    # -- public ---------------------------------------------------------------------------------

    @torch.no_grad()
    def score(self) -> torch.Tensor:
        """Log-probability of every cached sentence (float64, on the CPU), in cache order.

        The model is put in eval mode and back in the mode it was in. On out-of-memory the
        memory budget is halved and the evaluation retried, down to a floor, then re-raised.
        """
        was_training = self.model.training
        self.model.eval()
        try:
            if self.path is None:
                self.path = self._choose_path()
            while True:
                try:
                    return self._score_all(self.path).cpu()
                except torch.OutOfMemoryError:
                    if self.memory_budget // 2 < MIN_MEMORY_BUDGET:
                        raise
                    self.memory_budget //= 2
                    self.oom_retries += 1
                    self._layouts.clear()
                    _empty_device_cache(self.cache.device)
                    logger.warning("tatblimp: out of memory while scoring; retrying with %d MiB", self.memory_budget >> 20)
        finally:
            self.model.train(was_training)

    def layout(self, kind: str | None = None) -> Layout:
        """The row layout used for ``kind`` (default: the chosen path's), built once per budget."""
        kind = kind or (self.path.layout if self.path else "packed")
        key = (kind, self.row_length, self.tokens_per_batch)
        if key not in self._layouts:
            self._layouts[key] = build_layout(self.cache, kind, self.row_length, self.tokens_per_batch)
        return self._layouts[key]

    @property
    def tokens_per_batch(self) -> int:
        """Positions per forward call that fit the memory budget."""
        config = self.lm.config
        hidden = getattr(config, "hidden_size", 1024)
        intermediate = getattr(config, "intermediate_size", 4 * hidden)
        heads = getattr(config, "num_attention_heads", 16)
        element = torch.finfo(self._dtype()).bits // 8
        # Live activations of one layer, plus the attention scores of a row, per position.
        per_position = element * (6 * hidden + 3 * intermediate) + 4 * heads * self.row_length
        return max(self.row_length, self.memory_budget // per_position)

    @property
    def head_chunk(self) -> int:
        """Scored tokens per chunk of the LM head: logits and log-softmax in float32 fit the budget."""
        vocab = self._vocab_size()
        budget = self.memory_budget if self.cache.device.type != "cpu" else min(self.memory_budget, CPU_HEAD_CHUNK_BYTES * 3)
        return max(1, budget // (vocab * 4 * 3))

    # -- the computation ------------------------------------------------------------------------

    def _score_all(self, path: ScorePath, sentences: list[int] | None = None) -> torch.Tensor:
        device = self.cache.device
        sums_dtype = torch.float32 if device.type == "mps" else torch.float64
        totals = torch.zeros(self.cache.num_sentences, dtype=sums_dtype, device=device)
        if sentences is None:
            layout = self.layout(path.layout)
        else:
            layout = build_layout(self.cache, path.layout, self.row_length, self.tokens_per_batch, sentences)
        for batch in layout.batches:
            token_logprobs = self._batch_logprobs(batch, path.head)
            totals.index_add_(0, batch.score_sentences, token_logprobs.to(sums_dtype))
        return totals

    def _batch_logprobs(self, batch: Batch, head: str) -> torch.Tensor:
        inputs = dict(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=batch.attention_mask,
            use_cache=False,
        )
        if head == "logits":
            logits = self.model(**inputs).logits
            flat = logits.reshape(-1, logits.shape[-1]).index_select(0, batch.score_positions)
            return -F.cross_entropy(flat.float(), batch.score_targets, reduction="none")
        hidden = self.lm.base_model(**inputs).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.score_positions)
        del inputs
        return torch.cat(
            [
                self._head_logprobs(hidden[start : start + self.head_chunk], batch.score_targets[start : start + self.head_chunk])
                for start in range(0, hidden.shape[0], self.head_chunk)
            ]
        )

    def _head_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        head = self.lm.get_output_embeddings()
        logits = F.linear(hidden, head.weight, getattr(head, "bias", None)).float()
        cap = getattr(self.lm.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return -F.cross_entropy(logits, targets, reduction="none")

    # -- choosing the path ----------------------------------------------------------------------

    def _choose_path(self) -> ScorePath:
        """The fastest path whose scores match a plain forward on a sample of sentences."""
        sample = _sample_sentences(self.cache)
        reference = self._reference_logprobs(sample)
        heads = ["chunked", "logits"] if self._head_weight() is not None else ["logits"]
        for layout in ("packed", "padded"):
            for head in heads:
                path = ScorePath(layout, head)
                scores = self._score_all(path, sample)[sample]
                if _agree(scores, reference, [self.cache.lengths[s] for s in sample], self._dtype()):
                    logger.info("tatblimp: scoring with %s", path)
                    return path
                logger.warning("tatblimp: %s disagrees with a plain forward for this model", path)
        raise ScoringError("no scoring path matches a plain forward of this model; its logits may be non-deterministic")

    def _reference_logprobs(self, sentences: list[int]) -> torch.Tensor:
        """One sentence at a time, the whole model, full log-softmax: the definition, computed plainly."""
        results = []
        for s in sentences:
            ids = self.cache.token_ids[self.cache.offsets[s] : self.cache.offsets[s + 1]].unsqueeze(0)
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            results.append(logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).sum().double())
        return torch.stack(results).to(self.cache.device)

    # -- model facts and checks -----------------------------------------------------------------

    def _head_weight(self) -> torch.Tensor | None:
        head = self.lm.get_output_embeddings() if hasattr(self.lm, "get_output_embeddings") else None
        if head is None or not hasattr(head, "weight") or self.lm.base_model is self.lm:
            return None
        return head.weight

    def _vocab_size(self) -> int:
        weight = self._head_weight()
        return weight.shape[0] if weight is not None else self.lm.config.vocab_size

    def _dtype(self) -> torch.dtype:
        return next(self.lm.parameters()).dtype

    def _check_model(self, truncate: bool) -> None:
        if any(p.is_meta for p in self.lm.parameters()):
            raise ScoringError("the model has weights on the meta device; load or materialise them before scoring")
        embeddings = self.lm.get_input_embeddings().weight.shape[0]
        largest = int(self.cache.token_ids.max())
        if largest >= embeddings:
            raise ScoringError(
                f"tokenizer {self.cache.tokenizer_name} produces token id {largest}, but the model's embedding "
                f"has only {embeddings} rows: the tokenizer does not belong to this model"
            )
        context = getattr(self.lm.config, "max_position_embeddings", None)
        longest = max(self.cache.lengths)
        if context is not None and longest > context:
            if not truncate:
                sentence = self.cache.lengths.index(longest)
                raise ScoringError(
                    f"pair {sentence // 2} ({'good' if sentence % 2 == 0 else 'bad'} sentence) has {longest} tokens, "
                    f"more than the model's context of {context}; pass truncate=True to cut such sentences"
                )
            self.cache = self.cache.cut_to(context)
            logger.warning("tatblimp: %d sentences cut to the model's context of %d tokens", len(self.cache.truncated), context)
        self.row_length = max(min(self.row_length, context or self.row_length), max(self.cache.lengths))


def default_memory_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(MIN_MEMORY_BUDGET, free // 4)
    return CPU_MEMORY_BUDGET


def _empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sample_sentences(cache: SentenceCache, count: int = 12) -> list[int]:
    """A few sentences spread over the length range, long ones included."""
    by_length = sorted(range(cache.num_sentences), key=lambda s: cache.lengths[s])
    picks = {by_length[round(i * (len(by_length) - 1) / (count - 1))] for i in range(count)}
    return sorted(picks)


def _agree(scores: torch.Tensor, reference: torch.Tensor, lengths: list[int], dtype: torch.dtype) -> bool:
    """Within rounding of the reference: 1e-4 nats a token in float32, 2e-2 in half precision."""
    finite = torch.isfinite(reference)
    if not finite.any():  # a diverged model: nothing to compare against
        return True
    per_token = 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2
    tokens = torch.tensor(lengths, dtype=torch.float64, device=reference.device)
    close = (scores - reference).abs() <= per_token * tokens + 1e-4
    return bool(close[finite].all())
