"""Exact, memory-bounded sentence log-probabilities for a causal LM.

The scorer runs the model's body once per batch of rows (prefix trees, so that sentences which
start alike share those positions), takes the hidden states of the distinct contexts only, and
turns them into log-probs tile by tile of the LM head: each tile's logits give a float32
log-sum-exp over their part of the vocabulary, and the parts are merged; each target's logit is
one dot product. The [tokens x vocabulary] logits never exist at once.

Before the first evaluation it checks, on a few sentences, that this fast path gives the same
numbers as a plain one-sentence-at-a-time forward of the whole model, and falls back (packed,
then padded rows; the model's own logits instead of the tiled head) where it does not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from . import distributed
from .cache import SentenceCache
from .packing import Batch, Layout, build_layout, token_lists

logger = logging.getLogger(__name__)

DEFAULT_ROW_LENGTH = 256
CPU_MEMORY_BUDGET = 512 * 2**20
# On a CPU a head tile of 2048 positions x 2048 vocabulary columns (16 MiB of float32 logits)
# stays in the last-level cache while the log-sum-exp runs over it: 33,512 positions x 48K
# vocabulary took 6.8 s this way against 11.0 s as whole-vocabulary chunks of 1024 positions with
# cross-entropy (2 cores). On a GPU a tile spans the whole vocabulary.
CPU_HEAD_TILE = (2048, 2048)
MIN_MEMORY_BUDGET = 16 * 2**20
# The default budget is at most this fraction of the workload's full float32 logits: a tenth, so
# that the real peak, estimates' error included, stays within an eighth of them.
FULL_LOGITS_DIVISOR = 10


class ScoringError(RuntimeError):
    """The model cannot be scored with this cache (meta weights, vocabulary mismatch, too-long sentence, ...)."""


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face causal LM inside DDP, FSDP1, DeepSpeed, ``torch.compile`` and PEFT wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel) or type(model).__name__ in (
            "FullyShardedDataParallel",
            "DeepSpeedEngine",
        ):
            model = model.module
        elif hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
            model = model.get_base_model()
        else:
            return model


@dataclass
class ScorePath:
    """How the scores are computed for a model: the row layout and the head."""

    layout: str  # "tree", "packed" or "padded" (see ``packing``)
    head: str  # "chunked" (hidden states x LM head, tile by tile) or "logits" (the model's own logits)

    def __str__(self) -> str:
        return f"{self.layout} rows, {self.head} head"


class Scorer:
    """Scores every sentence of a cache with one model; reusable across evaluations.

    Under ``torch.distributed`` every process must call ``score``: each scores a token-balanced
    share of the batches and all get every sentence's score (see ``distributed``). A model
    sharded by FSDP or DeepSpeed ZeRO-3 is scored through its own forward, in lockstep.

    Args:
        model: a causal LM (``AutoModelForCausalLM``), bare or wrapped in DDP, ``torch.compile``
            or PEFT.
        cache: the pre-tokenized sentences, on the model's device.
        memory_budget: bytes of extra memory one evaluation may use for activations and logits;
            None sets it from free device memory (a quarter of it on a GPU, 512 MiB on a CPU),
            and never above a tenth of the float32 logits of all the cached tokens.
        row_length: positions per row.
        path: force a ``ScorePath`` (or "tree"/"packed"/"padded"); None checks the fast path
            once and falls back where it disagrees with a plain forward.
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
        # A sharded model (FSDP, ZeRO-3) must run its own forward, on every process alike; any
        # other runs unwrapped, since a DDP wrapper's forward may broadcast buffers (a collective).
        self.sharded = distributed.is_sharded(model)
        # Accelerate wraps a mixed-precision model's forward in autocast; scoring runs the weights'
        # own dtype (fp32 master weights stay exact), and the body and head below do too.
        self._forward = model if self.sharded else getattr(self.lm, "_original_forward", self.lm)
        self.cache = cache
        self.row_length = row_length
        self._check_model(truncate)  # first: a meta model's cache cannot even be measured
        self.memory_budget = memory_budget or default_memory_budget(cache.device, sum(self.cache.lengths) * self._vocab_size() * 4)
        self._layouts: dict[tuple, Layout] = {}
        self._sequences: list[list[int]] | None = None  # the cache's token ids as host lists
        if isinstance(path, str):
            path = ScorePath(layout=path, head="chunked" if self._head_weight() is not None else "logits")
        self.path = path
        self._path_checked = path is not None
        self.oom_retries = 0

    # -- public ---------------------------------------------------------------------------------

    @torch.no_grad()
    def score(self) -> torch.Tensor:
        """Log-probability of every cached sentence (float64, on the CPU), in cache order.

        The model is put in eval mode and back in the mode it was in, also on Ctrl-C. On
        out-of-memory the memory budget is halved and the evaluation retried, down to a floor
        (``MIN_MEMORY_BUDGET``), then re-raised; later evaluations keep the smaller budget.
        Sentences that come out NaN or inf are scored again on rows of their own, so that one
        diverged sentence does not spread to the others of its row.
        """
        was_training = self.model.training
        self.model.eval()
        try:
            with distributed.shared_failures():
                return self._score_with_retries()
        finally:
            self.model.train(was_training)

    def _score_with_retries(self) -> torch.Tensor:
        def attempt() -> torch.Tensor:
            if not self._path_checked:  # its sample is laid out within the budget too
                self.path = self._choose_path()
            return self._score_all(self.path).cpu()

        return retry_out_of_memory(self, attempt)

    def layout(self, kind: str | None = None) -> Layout:
        """The row layout used for ``kind`` (default: the chosen path's), built once per budget."""
        kind = kind or (self.path.layout if self.path else layouts_to_try(self.lm)[0])
        key = (kind, self.row_length, self.tokens_per_batch)
        if key not in self._layouts:
            self._layouts[key] = self._build_layout(kind)
        return self._layouts[key]

    def _build_layout(self, kind: str, sentences: list[int] | None = None) -> Layout:
        if self._sequences is None:
            self._sequences = token_lists(self.cache)
        return build_layout(
            self._sequences, kind, self.row_length, self.tokens_per_batch, pad_id=self.cache.prefix_token_id,
            device=self.cache.device, chosen=sentences, tree_mask_dtype=tree_mask_dtype(self.lm) or torch.bool,
        )

    @property
    def tokens_per_batch(self) -> int:
        """Positions per forward call that fit the memory budget."""
        per_position = activation_bytes_per_position(self.lm.config, self._dtype(), self.row_length)
        element = torch.finfo(self._dtype()).bits // 8
        if self.sharded or (self.path is not None and self.path.head == "logits"):
            # The model's own logits for every position, then the scored ones in float32.
            per_position += self._vocab_size() * (2 * element + 8)
        return max(self.row_length, self.memory_budget // per_position)

    @property
    def head_tile(self) -> tuple[int, int]:
        """(contexts, vocabulary columns) per tile of the LM head: its logits and their float32 work fit the budget."""
        return head_tile(self.cache.device, self._vocab_size(), self._dtype(), self.memory_budget)

    # -- the computation ------------------------------------------------------------------------

    def _score_all(self, path: ScorePath, sentences: list[int] | None = None) -> torch.Tensor:
        device = self.cache.device
        sums_dtype = torch.float32 if device.type == "mps" else torch.float64
        totals = torch.zeros(self.cache.num_sentences, dtype=sums_dtype, device=device)
        if sentences is None:
            layout = self.layout(path.layout)
        else:
            layout = self._build_layout(path.layout, sentences)
        # Across processes the batches are dealt out (the path check's sample runs everywhere);
        # a repeated batch (keep=False) only keeps a sharded model's forward calls in step.
        split = sentences is None
        for batch, keep in distributed.shard(layout.batches, split=split, lockstep=self.sharded):
            token_logprobs = self._batch_logprobs(batch, path.head)
            if keep:
                totals.index_add_(0, batch.score_sentences, token_logprobs.to(sums_dtype))
        totals = distributed.sum_over_processes(totals) if split else totals
        if path.layout != "padded":
            totals = self._rescore_non_finite(totals, path.head)
        return totals

    def _rescore_non_finite(self, totals: torch.Tensor, head: str) -> torch.Tensor:
        """Score again, one sentence a row, the sentences that came out NaN or inf.

        A NaN in one sentence of a packed or tree row spreads to the row's other sentences (masked
        attention weights are zero, but zero times NaN is NaN), so only a row of its own tells
        which sentences are really non-finite.
        """
        bad = (~torch.isfinite(totals)).nonzero().flatten().tolist()
        if bad:
            totals[bad] = self._score_all(ScorePath("padded", head), bad)[bad].to(totals.dtype)
        return totals

    def _batch_logprobs(self, batch: Batch, head: str) -> torch.Tensor:
        inputs = dict(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=batch.attention_mask,
            use_cache=False,
        )
        if head == "logits":
            logits = self._forward(**inputs).logits
            rows = logits.reshape(-1, logits.shape[-1]).index_select(0, batch.score_positions)
            return rows.float().log_softmax(-1)[batch.score_contexts, batch.score_targets]
        hidden = self.lm.base_model(**inputs).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.score_positions)
        del inputs
        return self._head_logprobs(hidden, batch.score_contexts, batch.score_targets)

    def _head_logprobs(self, hidden: torch.Tensor, contexts: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return head_logprobs(self.lm, hidden, contexts, targets, self.head_tile)

    # -- choosing the path ----------------------------------------------------------------------

    def _choose_path(self) -> ScorePath:
        """The fastest path whose scores match a plain forward on a sample of sentences."""
        sample = _sample_sentences(self.cache)
        reference = self._reference_logprobs(sample)
        heads = ["chunked", "logits"] if self._head_weight() is not None else ["logits"]
        if not torch.isfinite(reference).any():
            # A diverged model leaves nothing to compare: use the fastest path for now and check
            # again at the next evaluation, rather than keep a choice that was never tested.
            logger.warning("tatblimp: the model's log-probs are not finite; scoring path unchecked until they are")
            return ScorePath(layouts_to_try(self.lm)[0], heads[0])
        sample_lengths = [self.cache.lengths[s] for s in sample]
        path = first_matching_path(
            self.lm,
            heads,
            lambda path: _agree(self._score_all(path, sample)[sample], reference, sample_lengths, self._dtype()),
            consensus=distributed.all_agree,  # every process takes the same path
        )
        if path is not None:
            self._path_checked = True
            return path
        raise ScoringError("no scoring path matches a plain forward of this model; its logits may be non-deterministic")

    def _reference_logprobs(self, sentences: list[int]) -> torch.Tensor:
        """One sentence at a time, the whole model, full log-softmax: the definition, computed plainly."""
        results = []
        for s in sentences:
            ids = self.cache.token_ids[self.cache.offsets[s] : self.cache.offsets[s + 1]].unsqueeze(0)
            logits = self._forward(input_ids=ids, use_cache=False).logits[0, :-1].float()
            results.append(logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).sum().double())
        return torch.stack(results).to(self.cache.device)

    # -- model facts and checks -----------------------------------------------------------------

    def _head_weight(self) -> torch.Tensor | None:
        head = self.lm.get_output_embeddings() if hasattr(self.lm, "get_output_embeddings") else None
        if head is None or not hasattr(head, "weight") or self.lm.base_model is self.lm or self.sharded:
            return None  # a sharded head's weight is a shard: only the model's own forward can use it
        return head.weight

    def _vocab_size(self) -> int:
        weight = self._head_weight()
        return weight.shape[0] if weight is not None else self.lm.config.vocab_size

    def _dtype(self) -> torch.dtype:
        return next(self.lm.parameters()).dtype

    def _check_model(self, truncate: bool) -> None:
        check_weights_and_vocabulary(self.lm, self.cache.token_ids, self.cache.tokenizer_name)
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


def tree_mask_dtype(lm: torch.nn.Module) -> torch.dtype | None:
    """The 4D mask the model's attention takes: boolean for sdpa, additive for eager; None for others."""
    implementation = getattr(lm.config, "_attn_implementation", None)
    return {"sdpa": torch.bool, "eager": next(lm.parameters()).dtype}.get(implementation)


def layouts_to_try(lm: torch.nn.Module) -> list[str]:
    """Row layouts, fastest first; prefix trees need an attention that takes a 4D mask."""
    return ["tree", "packed", "padded"] if tree_mask_dtype(lm) else ["packed", "padded"]


def retry_out_of_memory(scorer, attempt: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``attempt()``, its memory budget halved and retried on out-of-memory down to ``MIN_MEMORY_BUDGET``.

    ``scorer`` holds ``memory_budget``, ``oom_retries``, its cached ``_layouts`` and ``cache``.
    Every process must build the same layout, so all use the smallest budget, and all retry
    together (``distributed.retry_together``).
    """
    scorer.memory_budget = distributed.smallest(scorer.memory_budget)
    while True:
        try:
            return attempt()
        except torch.OutOfMemoryError as error:
            distributed.retry_together(error)
            if scorer.memory_budget // 2 < MIN_MEMORY_BUDGET:
                raise
        # Past the except block, the failed attempt's traceback and the tensors its frames
        # held are gone, so emptying the device cache below really frees them.
        scorer.memory_budget //= 2
        scorer.oom_retries += 1
        scorer._layouts.clear()
        _empty_device_cache(scorer.cache.device)
        logger.warning("tatblimp: out of memory while scoring; retrying with %d MiB", scorer.memory_budget >> 20)


def first_matching_path(
    lm: torch.nn.Module, heads: list[str], matches: Callable[[ScorePath], bool], consensus: Callable[[bool], bool] = bool
) -> ScorePath | None:
    """The fastest path for which ``matches(path)`` holds (layouts fastest first, then ``heads``), or None.

    A path that raises (an attention that rejects a 4D mask, say) does not match, unless it is
    the last resort, padded rows, whose error is the model's own.
    """
    for layout in layouts_to_try(lm):
        for head in heads:
            path = ScorePath(layout, head)
            try:
                matched = matches(path)
            except (RuntimeError, ValueError, TypeError) as error:
                if isinstance(error, torch.OutOfMemoryError) or layout == "padded":
                    raise
                logger.warning("tatblimp: %s failed for this model (%s)", path, error)
                matched = False
            if consensus(matched):
                logger.info("tatblimp: scoring with %s", path)
                return path
            logger.warning("tatblimp: %s disagrees with a plain forward for this model", path)
    return None


def activation_bytes_per_position(config, dtype: torch.dtype, row_length: int) -> int:
    """Estimated live bytes per position in a forward call: one layer's activations plus a row's attention scores."""
    hidden = getattr(config, "hidden_size", 1024)
    intermediate = getattr(config, "intermediate_size", 4 * hidden)
    heads = getattr(config, "num_attention_heads", 16)
    element = torch.finfo(dtype).bits // 8
    # A row's attention scores, and its mask (4 bytes at most per key).
    return element * (6 * hidden + 3 * intermediate) + 4 * (heads + 1) * row_length


def head_tile(device: torch.device, vocab: int, dtype: torch.dtype, memory_budget: int) -> tuple[int, int]:
    """(contexts, vocabulary columns) per tile of the LM head, so that its logits and their float32 work fit the budget."""
    element = torch.finfo(dtype).bits // 8
    # F.linear's logits, a float32 copy unless they are float32 already, logsumexp's temporary.
    per_logit = element + (4 if element != 4 else 0) + 4
    if device.type == "cpu":
        rows, columns = CPU_HEAD_TILE
        columns = min(columns, vocab)
        return max(1, min(rows, memory_budget // (columns * per_logit))), columns
    return max(1, memory_budget // (vocab * per_logit)), vocab


def head_logprobs(
    lm: torch.nn.Module, hidden: torch.Tensor, contexts: torch.Tensor, targets: torch.Tensor, tile: tuple[int, int]
) -> torch.Tensor:
    """log p(target | context) = target logit - log-sum-exp of the context's logits, in float32.

    ``hidden``: [k, hidden size] states of the contexts; ``contexts``/``targets``: [t] an index into
    them and a token id for each log-prob wanted; ``tile``: ``head_tile``'s (contexts, columns).
    """
    head = lm.get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)
    cap = getattr(lm.config, "final_logit_softcapping", None)
    rows, columns = tile
    log_normalizers = torch.cat(
        [_log_sum_exp(hidden[start : start + rows], weight, bias, cap, columns) for start in range(0, hidden.shape[0], rows)]
    )
    target_logits = torch.cat(
        [
            _target_logits(hidden[contexts[start : start + rows]], weight, bias, cap, targets[start : start + rows])
            for start in range(0, targets.shape[0], rows)
        ]
    )
    return target_logits - log_normalizers[contexts]


def _log_sum_exp(hidden, weight, bias, cap, columns: int) -> torch.Tensor:
    """log sum_v exp(logit_v) per row of ``hidden``, in float32, ``columns`` vocabulary entries at a time."""
    parts = []
    for start in range(0, weight.shape[0], columns):
        part = slice(start, start + columns)
        logits = F.linear(hidden, weight[part], None if bias is None else bias[part]).float()
        if cap:  # in place: ``logits`` is a fresh tensor
            logits.div_(cap).tanh_().mul_(cap)
        parts.append(torch.logsumexp(logits, -1))
    return parts[0] if len(parts) == 1 else torch.logsumexp(torch.stack(parts, -1), -1)


def _target_logits(hidden, weight, bias, cap, targets: torch.Tensor) -> torch.Tensor:
    """Each row's logit of its target token, rounded as the head's matmul rounds its output."""
    logits = (hidden.float() * weight[targets].float()).sum(-1)
    if bias is not None:
        logits += bias[targets].float()
    logits = logits.to(weight.dtype).float()
    return logits.div_(cap).tanh_().mul_(cap) if cap else logits


def check_weights_and_vocabulary(
    lm: torch.nn.Module, token_ids: torch.Tensor, tokenizer_name: str, extra_ids: tuple[int, ...] = ()
) -> None:
    """A clear error before any forward pass for meta-device weights or a tokenizer the model cannot embed."""
    if any(p.is_meta for p in lm.parameters()):
        raise ScoringError("the model has weights on the meta device; load or materialise them before scoring")
    largest_token_id = max([int(token_ids.max()), *extra_ids])
    embedding = lm.get_input_embeddings()
    # A sharded weight's local shape is a shard's (ZeRO-3, FSDP1); num_embeddings is the real count.
    embeddings = getattr(embedding, "num_embeddings", None) or embedding.weight.shape[0]
    if largest_token_id >= embeddings:
        raise ScoringError(
            f"tokenizer {tokenizer_name} produces token id {largest_token_id}, but the model's embedding "
            f"has only {embeddings} rows: the tokenizer does not belong to this model"
        )


def default_memory_budget(device: torch.device, full_logits_bytes: int | None = None) -> int:
    """Bytes one evaluation may use: a quarter of free GPU memory, else ``CPU_MEMORY_BUDGET``.

    Scoring runs beside training, so it never asks for more than a tenth of what the full float32
    logits of the workload (``full_logits_bytes``) would take, nor less than ``MIN_MEMORY_BUDGET``.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free // 4
    else:
        budget = CPU_MEMORY_BUDGET
    if full_logits_bytes:
        budget = min(budget, full_logits_bytes // FULL_LOGITS_DIVISOR)
    return max(MIN_MEMORY_BUDGET, budget)


def _empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sample_sentences(cache: SentenceCache, count: int = 12) -> list[int]:
    """A few pairs spread over the length range, long ones included: both sentences of each, so
    that prefix-tree rows share (and branch off) a prefix as they do in a full evaluation."""
    by_length = sorted(range(cache.num_sentences), key=lambda s: cache.lengths[s])
    picks = {by_length[round(i * (len(by_length) - 1) / (count - 1))] for i in range(count)}
    return sorted(picks | {s ^ 1 for s in picks if s ^ 1 < cache.num_sentences})


def _agree(scores: torch.Tensor, reference: torch.Tensor, lengths: list[int], dtype: torch.dtype) -> bool:
    """Within rounding of the reference: 1e-4 nats a token in float32, 2e-2 in half precision."""
    finite = torch.isfinite(reference)
    if not torch.equal(torch.isfinite(scores), finite):
        return False
    per_token = 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2
    tokens = torch.tensor(lengths, dtype=torch.float64, device=reference.device)
    close = (scores - reference).abs() <= per_token * tokens + 1e-4
    return bool(close[finite].all())
