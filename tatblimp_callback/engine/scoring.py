"""The scoring engine: exact, memory-bounded log-probabilities of every cached sequence, for both protocols.

The scorer runs the model's body once per batch of rows (prefix trees, so that sequences which start alike
share those positions), keeps the hidden states of the positions it reads, and turns them into log-probs through
the LM head tile by tile (``tiled_head``). Each log-prob lands in its own cell (one per scored token, or per
answer), which are then read out:

- sentences (the log-prob protocol): every next token is read, and a sentence's log-prob is the sum of its
  cells, added in a fixed order (so ties, and "the same numbers as one process", hold on any device);
- prompts (forced choice): only the last position is read, for each answer token's log-prob.

Before the first evaluation it chooses the fastest scoring method (``scoring_method``) whose numbers equal a
plain one-sequence-at-a-time forward of the whole model on a sample (below float32: or are as close to its
float32 truth, ``precision``), and checks it again once the weights have moved. One memory budget, one
out-of-memory retry, one re-scoring of non-finite sequences and one distributed lockstep (``scoring_pass``) serve
both protocols.
On a GPU the plan's forward calls are replayed as CUDA graphs (``cuda_graphs``).
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from ..tokenized.cache import SentenceCache
from . import distributed
from .batch_forward import BatchForward
from .cells import Cells
from .compiled_forward import CompiledForward
from .cuda_graphs import CudaGraphs
from .head_choice import HeadChoice, HeadMethod
from .memory_budget import (
    check_sizes,
    default_memory_budget,
    one_call_budget,
    positions_per_forward,
    release_freed_memory,
    retry_out_of_memory,
)
from .method_check import MethodCheck
from .model_checks import (
    ScoringError,
    check_causal_lm,
    check_vocabulary,
    check_weights_and_vocabulary,
    embedding_rows,
    fit_to_context,
    forward_reads_position_ids,
    input_device,
    tree_mask_dtype,
    unwrap_model,
)
from .model_state import scoring_mode
from .packing import Layout, TokenSequences, build_layout
from .precision import compute_dtype, computing_in, float32_truth, scoring_precision, weights_dtype
from .scored_spans import SpanReader, question_rows
from .scoring_method import ScoringMethod, forced_method, layouts_to_try, reference_readout, relative_tolerance, sample_sequences
from .scoring_pass import score_cells

__all__ = ["DEFAULT_ROW_LENGTH", "Scorer", "ScoringError", "ScoringMethod", "unwrap_model"]

logger = logging.getLogger(__name__)

DEFAULT_ROW_LENGTH = 256
SAMPLE_PAIRS = 12  # pairs in the sample the scoring method is checked on
PLAN_SHARE = 4  # a kept layout's prepared batches (its plan) may hold up to a quarter of the memory budget


class Scorer(BatchForward):
    """Scores every sequence of a cache with one model; reusable across evaluations.

    Under ``torch.distributed`` every process must call ``score``: each scores a token-balanced share of the
    batches and all get every sequence's score (see ``distributed``). A model sharded by FSDP or DeepSpeed
    ZeRO-3 is scored through its own forward, in lockstep.

    Args:
        model: a causal LM (``AutoModelForCausalLM``), bare or wrapped in DDP, ``torch.compile`` or PEFT.
        cache: the tokenized sentences (or forced-choice prompts), on the model's device.
        memory_budget: bytes of extra memory one evaluation may use for activations and logits; None sets it from free
            device memory (a quarter of it on a GPU, 512 MiB on a CPU), never above a tenth of the float32 logits of all
            the cached tokens, and lets one forward call hold every position where a quarter of free GPU memory does.
        row_length: positions per row; raised to the longest sequence, and to the largest prefix tree of the sequences
            in ``sequences.shared_prefixes`` (without them, of the cache's harness requests with the same context)
            of those at most ``scored_spans.WHOLE_TREE_ROWS`` times as long.
        head_method: force how the LM head gives log-probs (``"tiles"`` or ``"chunks:N"``, see ``head_choice``),
            never timed; None times the candidates at the first evaluation and keeps the fastest exact one.
        method: force a ``ScoringMethod`` (or a layout: "tree", "packed", "padded"), never checked;
            None chooses the fastest that matches a plain forward, and checks it again later.
        truncate: cut sentences longer than the model's context instead of raising; the number cut is reported.
        keep_token_logprobs: keep the latest evaluation's token log-probs for ``token_logprobs`` (one float64 a scored
            token, on the cache's device, until the next ``score()``); off, nothing is held between evaluations.
        cuda_graphs: replay the plan's forward calls as CUDA graphs on a GPU (``cuda_graphs``); False: never.
        compile: ``torch.compile`` the scoring forward for the plan's shapes (``compiled_forward``): a slow start.
        precision: "auto" (the training's autocast dtype, else the weights'), "float32", "bfloat16" or "float16" (``precision``).
        sequences: the cache's token ids on the host where the caller has them (``packing.TokenSequences``, with the
            prefixes its sequences share: the harness model's requests); None: read from the cache.
        release_memory: on a CPU, hand the memory each ``score()`` freed back to the system (``release_freed_memory``);
            False where calls follow each other and reuse it (the harness model in ``lm_eval``).

    Raises:
        ScoringError: the model has weights on the meta device, its embedding is smaller than the tokenizer's
            ids, or a sequence is longer than its context (without ``truncate``).
        ValueError: an unknown ``precision``, or one the device cannot compute in; a ``memory_budget`` or
            ``row_length`` that is not a positive whole number.

    Example:
        The engine under ``Evaluator``, for per-sentence log-probs:

        ```python
        cache = build_cache(tokenizer, "test.jsonl", device=model.device)
        logprobs = Scorer(model, cache).score()  # float64, one per sentence: 2*i good, 2*i+1 bad of pair i
        ```
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: SentenceCache,
        *,
        memory_budget: int | None = None,
        row_length: int = DEFAULT_ROW_LENGTH,
        method: ScoringMethod | str | None = None,
        truncate: bool = False,
        keep_token_logprobs: bool = False,
        head_method: str | HeadMethod | None = None,
        cuda_graphs: bool = True,
        compile: bool = False,
        precision: str | torch.dtype | None = "auto",
        sequences: TokenSequences | None = None,
        release_memory: bool = True,
    ):
        check_sizes(memory_budget, row_length)
        self.model = model
        self.release_memory = release_memory
        self.lm = unwrap_model(model)
        # A sharded model (FSDP, ZeRO-3) must run its own forward, on every process alike; any
        # other runs unwrapped, since a DDP wrapper's forward may broadcast buffers (a collective).
        self.sharded = distributed.is_sharded(model)
        # Tensor parallel: every process runs every row, each holding a slice of every layer.
        self.tensor_parallel = distributed.is_tensor_parallel(model)
        # Not accelerate's autocast wrapper: ``precision`` decides what scoring computes in (``computing_in``).
        self._forward = model if self.sharded else getattr(self.lm, "_original_forward", self.lm)
        check_causal_lm(self.lm)
        check_weights_and_vocabulary(self.lm, cache)  # before any forward: a meta model's cache cannot even be measured
        self.precision = scoring_precision(model, self.lm, precision, cache.device)
        self._built_dtype = weights_dtype(self.lm)
        # What the layers compute in without autocast (FSDP's mixed precision, else the weights'): one module walk.
        self.compute_dtype = compute_dtype(self.lm)
        self.context = getattr(self.lm.config, "max_position_embeddings", None)
        self.keep_token_logprobs = keep_token_logprobs
        self._options = {  # what ``_bind`` makes a cache's budgets, cells and plans with
            "memory_budget": memory_budget,
            "row_length": row_length,
            "truncate": truncate,
            "head_method": head_method,
            "cuda_graphs": cuda_graphs,
            "compile": compile,
        }
        self._bind(cache, sequences)
        method = forced_method(self.lm, method, "tiled" if self._head_weight() is not None else "full_logits")
        # Pairs of sentences only: spans (harness requests, last) are no pairs, and their cells are their continuations'.
        sample = sample_sequences(self.cache.lengths[: self.cache.num_sentences - len(self.cache.span_tokens)], SAMPLE_PAIRS)
        self.check = MethodCheck(
            self.lm,
            method,
            sample=sample,
            heads=self._heads,
            reference=lambda sequences: reference_readout(self._forward, self.cache, sequences),
            readout=lambda method, sequences: self.cells.reduce(score_cells(self, method, sequences))[sequences],
            reads_positions=self._forward_reads_positions,
            tokens=torch.tensor([self.cache.lengths[s] - 1 for s in sample]),
            rtol=lambda: relative_tolerance(self._dtype(), self.cache.device),
            truth=float32_truth(self.lm, self._forward, self.cache, self.precision, self.sharded),
        )

    def _bind(self, cache: SentenceCache, sequences: TokenSequences | None) -> None:
        """What this scorer keeps of ``cache``: the budgets, the cells, the plans and the head's choice, made anew."""
        given = self._options
        self.cache = fit_to_context(self.lm, cache, given["truncate"])
        # The cache's token ids on the host (made from the cache when first needed; not the caller's if it was cut).
        self._sequences = sequences if self.cache is cache else None
        self.row_length = max(min(given["row_length"], self.context or given["row_length"]), max(self.cache.lengths))
        self.row_length, self._sequences = question_rows(self.cache, self._sequences, self.row_length)
        full_logits = sum(self.cache.lengths) * self._vocab_size() * 4
        self.memory_budget = given["memory_budget"] or default_memory_budget(self.cache.device, full_logits)
        self.call_budget = (
            None if given["memory_budget"] else one_call_budget(self.memory_budget, self.cache, self.lm, self.row_length)
        )
        self._layouts: dict[tuple, Layout] = {}
        self.oom_retries = 0
        head_method = given["head_method"]
        self.head = HeadChoice(forced=None if head_method is None else HeadMethod.parse(head_method))
        # With keep_token_logprobs, the latest evaluation's cells (sentences only), on the scoring
        # device: every token's log-prob (``token_logprobs``).
        self._token_cells: torch.Tensor | None = None
        self.cells = Cells(self.cache)  # where each log-prob lands, and the reduction
        upcast = self.precision.itemsize > self._built_dtype.itemsize
        self.graphs = CudaGraphs(self.lm, given["cuda_graphs"], self.sharded, self.tensor_parallel, upcast)
        self.compiled = CompiledForward(given["compile"], self.sharded)
        self.layouts_built = 0  # row layouts (plans) made, the method check's samples included
        # The latest score()'s one-time costs, in seconds: laying out and preparing the plan (the
        # check's samples included) and the method check's forwards; 0 where they were reused.
        self.setup_seconds = {"plan": 0.0, "method_check": 0.0}
        # The cache's spans (``cache.span_tokens``: lm-evaluation-harness's requests), scored on their last tokens only.
        spans = self.cache.span_tokens
        self.spans = SpanReader(self.cells, self.cache.num_sentences - len(spans), spans) if spans else None

    def for_cache(self, cache: SentenceCache, sequences: TokenSequences | None = None) -> Scorer:
        """A scorer of ``cache`` with this one's model, options and method check (its sample stays this scorer's),
        on the same device, without computing the model's facts again (its wrapping, precision, weights' dtype and the
        float32 truth walk every module: a few ms a call on a 24-layer model). The harness model makes one per call.

        Raises:
            ScoringError: a token id of ``cache`` that the model cannot embed, or a sequence longer than its context.
            ValueError: ``cache`` on another device than this scorer's.
        """
        if cache.device != self.cache.device:
            raise ValueError(f"for_cache: the cache is on {cache.device}, this scorer's on {self.cache.device}")
        check_vocabulary(cache, embedding_rows(self.lm))
        other = copy.copy(self)
        other._bind(cache, sequences)
        return other

    @property
    def method(self) -> ScoringMethod | None:
        """The scoring method in use (None before the first evaluation chose it)."""
        return self.check.method

    @method.setter
    def method(self, method: ScoringMethod) -> None:
        self.check.method = method

    @property
    def method_replacements(self) -> int:
        """Methods that failed a later check and were replaced."""
        return self.check.replacements

    # -- public ---------------------------------------------------------------------------------

    def serves(self, model: torch.nn.Module) -> bool:
        """Whether this scorer fits ``model`` as it is now: the same model, still on its cache's device and in its dtype."""
        weight = next(self.lm.parameters())
        # input_device, not the first weight's: offloaded to disk (device_map) that weight is on the meta device.
        return model is self.model and input_device(self.lm) == self.cache.device and weight.dtype == self._built_dtype

    def score(self, sequences: range | list[int] | None = None) -> torch.Tensor:
        """The log-probs of every cached sequence (float64, on the CPU), in cache order.

        Sentences: ``[sentences]``, each the sum of its tokens' log-probs. Forced-choice prompts
        (``cache.answer_ids``): ``[prompts, answers]``, each answer token's log-prob after the prompt.
        ``sequences``: score only these (the others are 0), e.g. one suite of several in the cache.

        The model is put in eval mode without gradients and back as it was found (each module's own mode, the random
        generators, the grad-enabled state; ``model_state.scoring_mode``), also on Ctrl-C, and computes in
        ``precision``. On out-of-memory the memory budget is halved and the evaluation retried, down to a floor
        (``memory_budget.MIN_MEMORY_BUDGET``), then re-raised; later evaluations keep the smaller budget. Sequences that
        come out NaN or inf are scored again on rows of their own, so that one diverged sequence does not spread to the
        others of its row. On a CPU the memory the evaluation freed is handed back to the system at its end
        (``memory_budget.release_freed_memory``), unless the scorer was made with ``release_memory=False``.

        Returns:
            Float64 log-probs on the CPU: ``[sentences]``, or ``[prompts, answers]`` for forced-choice prompts.

        Raises:
            ScoringError: no scoring method agrees with a plain forward of the model.
            ValueError: a sequence index that is not one of the cache's.
            torch.OutOfMemoryError: still out of memory at the smallest budget.
            PeerFailure: under ``torch.distributed``, scoring failed on another process.
        """
        count = self.cache.num_sentences
        if sequences and not (min(sequences) >= 0 and max(sequences) < count):  # in C: a suite's list is 100K long
            outside = [s for s in sequences if not 0 <= s < count]
            raise ValueError(f"score(sequences=): {outside[:5]} not among the cache's {count} sequences")
        try:
            # Autocast, or the weights upcast; a new weights' dtype makes a new scorer (``serves``).
            in_precision = computing_in(self.lm, self.precision, self.cache.device, weights=self.compute_dtype)
            with scoring_mode(self.model), in_precision, distributed.shared_failures():
                return retry_out_of_memory(
                    lambda: self._attempt(sequences), self.memory_budget, self.cache.device, self._set_budget
                )
        finally:
            if self.release_memory:
                release_freed_memory(self.cache.device)

    def _set_budget(self, budget: int, retrying: bool) -> None:
        if budget != self.memory_budget:
            self._layouts.clear()  # plans made for another budget
        self.memory_budget = budget
        self.oom_retries += retrying
        self.call_budget = None if retrying else self.call_budget  # after out-of-memory: calls sized by the budget

    def _attempt(self, sequences: range | list[int] | None) -> torch.Tensor:
        if self.method is not None and self.method.head == "tiled" and self._head_weight() is None:
            # An adapter or hook put on the head since the method was chosen: what it computes is not its weight.
            logger.warning("tatblimp: the LM head is no longer a plain linear layer; scoring through the model's own forward")
            self.method = ScoringMethod(self.method.layout, "full_logits")
        self.setup_seconds = {"plan": 0.0, "method_check": 0.0}
        start = time.perf_counter()
        self.check.when_due()  # its sample is laid out within the budget too
        self.setup_seconds["method_check"] = time.perf_counter() - start - self.setup_seconds["plan"]
        self._token_cells = None  # freed before this evaluation's own cells are made
        if self.method.head == "tiled" and self.head.method is None:  # the first evaluation: time the head's candidates
            layout, setup = self._layout(self.method, sequences, True, self.spans), sum(self.setup_seconds.values())
            self.head.begin(layout, bool(self.cache.answer_ids), self._head_weight(), self._dtype(), self.memory_budget, setup)
        if self.spans is not None:
            self.spans.begin()
        cells = score_cells(self, self.method, sequences, split=True, keep_layout=True, spans=self.spans)
        self.head.finish()
        if self.keep_token_logprobs and not self.cache.answer_ids:
            self._token_cells = cells
        return self.cells.reduce(cells).cpu()

    @property
    def head_method(self) -> HeadMethod | None:
        """How the LM head gives log-probs (``head_choice``): None with the model's own logits, or before it is chosen."""
        return self.head.method if self.method is not None and self.method.head == "tiled" else None

    @property
    def head_choice(self) -> dict | None:
        """What the head method was chosen by, and the candidates' timings where they were timed (for the results)."""
        return self.head.record if self.head_method is not None else None

    def token_logprobs(self) -> list[list[float]]:
        """Every scored token's log-prob from the latest ``score()`` (with ``keep_token_logprobs``), per sentence in cache order.

        Sentence ``s`` has ``cache.lengths[s] - 1`` values (the prefix token is not scored), in token order; they are
        the cells the sentence's log-prob is summed from, so Python's ``sum()`` of a sentence's list equals ``score()[s]``.

        Raises:
            RuntimeError: nothing scored yet, the scorer was made without ``keep_token_logprobs``, or the
                cache holds forced-choice prompts.
        """
        if self._token_cells is None:
            raise RuntimeError(
                "no token log-probs: score() the sentences first with Scorer(..., keep_token_logprobs=True) "
                "(forced-choice prompts have none)"
            )
        return self.cells.per_sentence(self._token_cells)

    def layout(self, kind: str | None = None, sequences: range | list[int] | None = None) -> Layout:
        """The row layout used for ``kind`` (default: the chosen method's) and ``sequences`` (default: all), built once per budget."""
        head = self.method.head if self.method else self._heads()[0]
        kind = kind or (self.method.layout if self.method else layouts_to_try(self.lm)[0])
        return self._layout(ScoringMethod(kind, head), sequences, True, self.spans)

    @property
    def tokens_per_batch(self) -> int:
        """Positions per forward call that fit the memory budget with the chosen method's head."""
        return self._positions_per_forward(self.method.head if self.method else self._heads()[0])

    def _positions_per_forward(self, head: str) -> int:
        vocab = self._vocab_size() if head == "full_logits" else None  # the model's logits at every position
        budget = self.call_budget or self.memory_budget  # a forward call's, at least the evaluation's
        return positions_per_forward(budget, self.lm.config, self._dtype(), self.row_length, vocab)

    # -- the computation ------------------------------------------------------------------------

    def _layout(
        self, method: ScoringMethod, sequences: range | list[int] | None = None, keep: bool = False, spans=None
    ) -> Layout:
        """The rows of ``method.layout`` for all sequences or for ``sequences``; kept (once per budget) with ``keep``.

        A kept layout is the plan every evaluation reuses: its batches are prepared once, as compact
        tensors on the device, when they fit ``PLAN_SHARE`` of the budget, and built when read otherwise.
        A new budget (after out-of-memory) makes a new plan; a new cache, device or dtype a new scorer.
        With ``spans`` (the pass that reads them, ``scored_spans.SpanReader``) a span's context tokens are
        not read at all: only its continuation's (context, target) pairs are in the batches.
        """
        key = (method.layout, self.row_length, self._positions_per_forward(method.head))
        key += () if sequences is None else (tuple(sequences),)
        key += () if spans is None else ("spans' continuations only",)
        if key in self._layouts:
            return self._layouts[key]
        if self._sequences is None:
            self._sequences = TokenSequences(self.cache.token_ids, self.cache.offsets)
        self.layouts_built += 1
        start = time.perf_counter()
        layout = build_layout(
            self._sequences,
            method.layout,
            self.row_length,
            key[2],
            pad_id=self.cache.prefix_token_id,
            device=self.cache.device,
            chosen=sequences,
            answer_ids=self.cache.answer_ids,
            tree_mask_dtype=tree_mask_dtype(self.lm) or torch.bool,
            plan_budget=self.memory_budget // PLAN_SHARE if keep or sequences is None else 0,
            scored_from=None if spans is None else spans.scored_from,
        )
        self.setup_seconds["plan"] += time.perf_counter() - start
        if keep or sequences is None:
            self._layouts[key] = layout
        return layout

    def _forward_reads_positions(self, method: ScoringMethod, sample: list[int]) -> bool:
        batch = self._layout(method, sample).batches[0]
        return forward_reads_position_ids(
            lambda ids: self._model_output(batch, method.head, ids), batch.position_ids, self.context
        )
