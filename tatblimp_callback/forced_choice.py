"""Forced choice for instruction-tuned (chat) models: which of sentences A and B is grammatical?

Every pair is asked twice: item ``2*i`` shows pair ``i`` as A = good, B = bad (the right answer
is A), item ``2*i + 1`` as A = bad, B = good (the right answer is B), so 1,248 pairs give 2,496
items. Each prompt is the user message ``DEFAULT_PROMPT`` (or the caller's) rendered with the
tokenizer's own chat template and its generation prompt, so the next token is the assistant's
answer.

A local model answers with the letter whose token has the higher log-probability at that
position: one batched forward over all prompts (prefix-tree rows, so the chat template and the
question are computed once a row; only each prompt's last position is read), no generation. An
equal pair of log-probs is a tie and counts as wrong. ``endpoint.py`` asks the same prompts of a
chat-completions server and parses its text answer.

Metrics: ``accuracy`` over items, ``both_orders`` over pairs (right in both orderings), and
``a_share``, the share of A among the A/B answers (0.5 for a model without position bias).
"""

from __future__ import annotations

import logging
import math
import os
import string
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from . import distributed
from .data import Benchmark, Pair, load_benchmark
from .packing import Batch, Layout, build_layout, token_lists
from .scoring import (
    ScorePath,
    ScoringError,
    activation_bytes_per_position,
    check_weights_and_vocabulary,
    default_memory_budget,
    first_matching_path,
    head_logprobs,
    head_tile,
    retry_out_of_memory,
    tree_mask_dtype,
    unwrap_model,
)
from .tokenization import TokenizationError, tokenizer_name

logger = logging.getLogger(__name__)

DEFAULT_PROMPT = (
    "Which of these two sentences is grammatical Tatar?\n"
    "\n"
    "A: {a}\n"
    "B: {b}\n"
    "\n"
    "Answer with one letter: A or B."
)
"""The user message of every item; ``{a}`` and ``{b}`` are replaced by the two sentences."""

LETTERS = ("A", "B")
ORDERS = ("good_first", "bad_first")  # item 2*i + o uses ORDERS[o]; the right answer is LETTERS[o]
DEFAULT_ROW_LENGTH = 1024


# -- prompts ------------------------------------------------------------------------------------


def check_prompt(prompt: str) -> str:
    """``prompt`` itself if it is a template with exactly the fields ``{a}`` and ``{b}``, else ValueError."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(prompt) if name is not None]
    except ValueError as err:
        raise ValueError(f"forced-choice prompt is not a valid template ({err}): {prompt!r}") from None
    if sorted(fields) != ["a", "b"]:
        raise ValueError(
            f"forced-choice prompt must contain {{a}} and {{b}} once each and no other {{field}} "
            f"(write literal braces as {{{{ }}}}); it has {fields}: {prompt!r}"
        )
    return prompt


def item_messages(pair: Pair, order: int, prompt: str = DEFAULT_PROMPT, system_prompt: str | None = None) -> list[dict]:
    """The chat messages of one item: ``order`` 0 shows the good sentence as A, 1 as B."""
    a, b = (pair.good, pair.bad) if order == 0 else (pair.bad, pair.good)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt.format(a=a, b=b)})
    return messages


def all_item_messages(benchmark: Benchmark, prompt: str = DEFAULT_PROMPT, system_prompt: str | None = None) -> list[list[dict]]:
    """Messages of all ``2 * len(benchmark)`` items, item ``2*i + o`` = pair ``i`` in order ``o``."""
    check_prompt(prompt)
    return [item_messages(pair, order, prompt, system_prompt) for pair in benchmark.pairs for order in (0, 1)]


# -- results ------------------------------------------------------------------------------------


@dataclass
class ChoiceGroup:
    """Forced-choice metrics of one group of pairs (a phenomenon, or all)."""

    items: int
    pairs: int
    accuracy: float  # right answers / items
    both_orders: float  # pairs answered right in both orderings / pairs
    a_share: float  # A answers / (A + B answers); NaN when there is none
    answers_a: int
    answers_b: int
    ties: int = 0  # local: logP(A) == logP(B); counted wrong
    non_finite: int = 0  # local: a NaN/inf log-prob; counted wrong
    unparsed: int = 0  # endpoint: a reply that is not exactly A or B; counted wrong


@dataclass
class ChoiceItem:
    """One item: the pair, the ordering, the right letter and the model's answer (None: no answer)."""

    pair: int
    order: str  # "good_first" (right answer A) or "bad_first" (right answer B)
    expected: str
    answer: str | None
    note: str | None = None  # why there is no answer: "tie", "non_finite" or "unparsed"
    logprob_a: float | None = None  # local models
    logprob_b: float | None = None
    text: str | None = None  # endpoint: the raw reply

    @property
    def correct(self) -> bool:
        return self.answer == self.expected


@dataclass
class ForcedChoiceResults:
    """One forced-choice evaluation: overall, per phenomenon, and per item (item order)."""

    overall: ChoiceGroup
    phenomena: dict[str, ChoiceGroup]
    items: list[ChoiceItem]
    benchmark_md5: str
    benchmark_release: str
    benchmark_source: str
    model: str
    prompt: str
    system_prompt: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # timings, layout, endpoint counters, ...

    @property
    def accuracy(self) -> float:
        return self.overall.accuracy

    @property
    def both_orders(self) -> float:
        return self.overall.both_orders

    @property
    def a_share(self) -> float:
        return self.overall.a_share

    def to_dict(self) -> dict[str, Any]:
        """The JSON written by ``tatblimp score --protocol forced-choice --output``."""
        return {
            "protocol": "forced-choice",
            **{k: v for k, v in asdict(self.overall).items()},
            "benchmark": {"release": self.benchmark_release, "md5": self.benchmark_md5, "source": self.benchmark_source},
            "model": self.model,
            "prompt": self.prompt,
            "system_prompt": self.system_prompt,
            "phenomena": {name: asdict(group) for name, group in self.phenomena.items()},
            "per_item": [asdict(item) for item in self.items],
            **self.extra,
        }

    def flat_metrics(self, prefix: str = "tatblimp_fc") -> dict[str, float]:
        """Scalars for a logger: ``{prefix}/accuracy``, ``{prefix}/both_orders``, ``{prefix}/a_share``, per phenomenon."""
        o = self.overall
        metrics = {f"{prefix}/accuracy": o.accuracy, f"{prefix}/both_orders": o.both_orders, f"{prefix}/a_share": o.a_share}
        for name, group in self.phenomena.items():
            metrics[f"{prefix}/{name}/accuracy"] = group.accuracy
            metrics[f"{prefix}/{name}/both_orders"] = group.both_orders
        for counter in ("ties", "non_finite", "unparsed"):
            if getattr(o, counter):
                metrics[f"{prefix}/{counter}"] = float(getattr(o, counter))
        return metrics

    def format_table(self) -> str:
        """A plain-text table like the benchmark card's forced-choice table, per phenomenon."""
        width = max(len(name) for name in [*self.phenomena, "overall"])
        rule = "-" * (width + 42)
        lines = [f"{self.benchmark_release}  forced choice, both orderings  model: {self.model}"]
        lines.append(f"{'phenomenon':<{width}}  {'pairs':>5}  {'accuracy':>8}  {'both-orders':>11}  {'A share':>7}")
        lines.append(rule)
        rows = [*self.phenomena.items(), ("overall", self.overall)]
        for name, g in rows:
            if name == "overall":
                lines.append(rule)
            lines.append(f"{name:<{width}}  {g.pairs:>5}  {g.accuracy:>8.4f}  {g.both_orders:>11.4f}  {g.a_share:>7.4f}")
        o = self.overall
        lines.append(f"{o.items} items ({o.pairs} pairs x 2 orderings); A share 0.5 = no position bias")
        for counter, what in (("ties", "log-prob ties"), ("non_finite", "non-finite log-probs"), ("unparsed", "replies that are not A or B")):
            if getattr(o, counter):
                lines.append(f"{getattr(o, counter)} items with {what}, counted as wrong")
        return "\n".join(lines)


def compute_choice_results(
    benchmark: Benchmark,
    items: Sequence[ChoiceItem],
    *,
    model: str,
    prompt: str,
    system_prompt: str | None = None,
    extra: dict[str, Any] | None = None,
) -> ForcedChoiceResults:
    """Metrics from the ``2 * len(benchmark)`` items, in item order."""
    if len(items) != 2 * len(benchmark):
        raise ValueError(f"expected {2 * len(benchmark)} items (2 per pair), got {len(items)}")
    correct = np.array([item.correct for item in items], dtype=bool).reshape(-1, 2)
    answers = np.array([item.answer or "" for item in items]).reshape(-1, 2)
    notes = np.array([item.note or "" for item in items]).reshape(-1, 2)
    phenomenon = np.array([p.phenomenon for p in benchmark.pairs])

    def group(mask: np.ndarray) -> ChoiceGroup:
        a, b = int((answers[mask] == "A").sum()), int((answers[mask] == "B").sum())
        pairs = int(mask.sum())
        return ChoiceGroup(
            items=2 * pairs,
            pairs=pairs,
            accuracy=float(correct[mask].mean()) if pairs else math.nan,
            both_orders=float(correct[mask].all(axis=1).mean()) if pairs else math.nan,
            a_share=a / (a + b) if a + b else math.nan,
            answers_a=a,
            answers_b=b,
            ties=int((notes[mask] == "tie").sum()),
            non_finite=int((notes[mask] == "non_finite").sum()),
            unparsed=int((notes[mask] == "unparsed").sum()),
        )

    return ForcedChoiceResults(
        overall=group(np.ones(len(benchmark), dtype=bool)),
        phenomena={name: group(phenomenon == name) for name in benchmark.phenomena},
        items=list(items),
        benchmark_md5=benchmark.md5,
        benchmark_release=benchmark.release,
        benchmark_source=benchmark.source,
        model=model,
        prompt=prompt,
        system_prompt=system_prompt,
        extra=dict(extra or {}),
    )


def items_from_logprobs(logprobs: torch.Tensor | np.ndarray) -> list[ChoiceItem]:
    """Items decided by log-probs ``[items, 2]`` (columns: A, B): the higher letter, else a tie."""
    values = np.asarray(logprobs.cpu() if hasattr(logprobs, "cpu") else logprobs, dtype=np.float64)
    items = []
    for k, (a, b) in enumerate(values):
        if not (math.isfinite(a) and math.isfinite(b)):
            answer, note = None, "non_finite"
        elif a == b:
            answer, note = None, "tie"
        else:
            answer, note = ("A" if a > b else "B"), None
        items.append(ChoiceItem(pair=k // 2, order=ORDERS[k % 2], expected=LETTERS[k % 2], answer=answer,
                                note=note, logprob_a=float(a), logprob_b=float(b)))
    return items


# -- the tokenized prompts ----------------------------------------------------------------------


@dataclass
class PromptCache:
    """All forced-choice prompts, chat-templated and tokenized, flat with offsets, on one device.

    ``token_ids[offsets[k]:offsets[k + 1]]`` is item ``k``; its last token is the end of the
    generation prompt, where the answer token comes next.
    """

    token_ids: torch.Tensor  # [total tokens] int64
    offsets: torch.Tensor  # [items + 1] int64
    answer_ids: tuple[int, int]  # token ids of "A" and "B" right after the generation prompt
    pad_id: int
    benchmark: Benchmark
    prompt: str
    system_prompt: str | None
    tokenizer_name: str
    _host_lengths: list[int] | None = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    @property
    def num_items(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> list[int]:
        if self._host_lengths is None:
            self._host_lengths = (self.offsets[1:] - self.offsets[:-1]).tolist()
        return self._host_lengths

    def item(self, k: int) -> list[int]:
        return self.token_ids[self.offsets[k] : self.offsets[k + 1]].tolist()

    def to(self, device: torch.device | str) -> "PromptCache":
        return PromptCache(**{**vars(self), "token_ids": self.token_ids.to(device), "offsets": self.offsets.to(device)})


def build_prompt_cache(
    tokenizer: Any,
    data: Benchmark | str | os.PathLike | None = None,
    *,
    prompt: str = DEFAULT_PROMPT,
    system_prompt: str | None = None,
    device: torch.device | str = "cpu",
    allow_modified: bool = False,
) -> PromptCache:
    """Render every item with the tokenizer's chat template (generation prompt added) and tokenize once."""
    benchmark = data if isinstance(data, Benchmark) else load_benchmark(data, allow_modified=allow_modified)
    name = tokenizer_name(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizationError(f"tokenizer {name} has no chat template; forced choice needs a chat model's tokenizer")
    conversations = all_item_messages(benchmark, prompt, system_prompt)
    texts = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
    # What apply_chat_template(tokenize=True) does, kept as two steps so the answer tokens can be checked on the text.
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    answer_ids = find_answer_ids(tokenizer, texts[0], encoded[0])
    lengths = torch.tensor([len(ids) for ids in encoded], dtype=torch.long)
    pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, encoded[0][-1]) if t is not None))
    return PromptCache(
        token_ids=torch.tensor([t for ids in encoded for t in ids], dtype=torch.long, device=device),
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device),
        answer_ids=answer_ids,
        pad_id=int(pad),
        benchmark=benchmark,
        prompt=prompt,
        system_prompt=system_prompt,
        tokenizer_name=name,
    )


def find_answer_ids(tokenizer: Any, text: str, ids: Sequence[int]) -> tuple[int, int]:
    """The token ids that "A" and "B" get when they continue the rendered prompt ``text``.

    Each letter must add exactly one token and leave the prompt's tokens unchanged; otherwise
    comparing one position's log-probs would not compare the two answers, and this raises.
    """
    found = []
    for letter in LETTERS:
        continued = tokenizer(text + letter, add_special_tokens=False)["input_ids"]
        if len(continued) != len(ids) + 1 or list(continued[: len(ids)]) != list(ids):
            tail = tokenizer.convert_ids_to_tokens(list(continued[max(0, len(ids) - 2) :]))
            raise TokenizationError(
                f"tokenizer {tokenizer_name(tokenizer)}: the answer {letter!r} is not a single token after the chat "
                f"template's generation prompt (prompt ends {text[-30:]!r}; with the answer its last tokens are "
                f"{tail}); forced choice needs one token per answer letter"
            )
        found.append(int(continued[-1]))
    if found[0] == found[1]:
        raise TokenizationError(f"tokenizer {tokenizer_name(tokenizer)} gives 'A' and 'B' the same token id {found[0]}")
    return found[0], found[1]


# -- the local scorer ---------------------------------------------------------------------------


class ForcedChoiceScorer:
    """log P("A") and log P("B") at the answer position of every prompt, for one model.

    Args:
        model: a causal LM, bare or wrapped (DDP, ``torch.compile``, PEFT).
        cache: the tokenized prompts, on the model's device.
        memory_budget: bytes one evaluation may use for activations and logits (default: a
            quarter of free GPU memory, 512 MiB on a CPU); halved and retried on out-of-memory.
        row_length: positions per row.
        path: force a ``ScorePath`` (or "tree"/"packed"/"padded"); None checks the fastest layout
            once against a plain one-prompt forward and falls back where they disagree.
    """

    def __init__(self, model: torch.nn.Module, cache: PromptCache, *, memory_budget: int | None = None,
                 row_length: int = DEFAULT_ROW_LENGTH, path: ScorePath | str | None = None):
        self.model = model
        self.lm = unwrap_model(model)
        # Accelerate wraps a mixed-precision model's forward in autocast; scoring runs in the weights' own dtype.
        self._forward = getattr(self.lm, "_original_forward", self.lm)
        self.cache = cache
        self.memory_budget = memory_budget or default_memory_budget(cache.device)
        self._check_model()
        context = getattr(self.lm.config, "max_position_embeddings", None) or row_length
        self.row_length = max(min(row_length, context), max(cache.lengths))
        if isinstance(path, str):
            path = ScorePath(path, "chunked" if self._has_head() else "logits")
        self.path = path
        self.oom_retries = 0
        self._layouts: dict[tuple, Layout] = {}
        # Each prompt continued by the answer "A": the position before it is the one read.
        self._sequences = [ids + [cache.answer_ids[0]] for ids in token_lists(cache)]

    @torch.no_grad()
    def logprobs(self) -> torch.Tensor:
        """``[items, 2]`` float32 log-probs of "A" and "B" (CPU), item order; the model's mode is restored.

        Under ``torch.distributed`` every process must call this: each scores a share of the
        batches and all get every item's log-probs; a failure on one process raises on all.
        """
        was_training = self.model.training
        self.model.eval()
        try:
            with distributed.shared_failures():
                return retry_out_of_memory(self, self._attempt)
        finally:
            self.model.train(was_training)

    def _attempt(self) -> torch.Tensor:
        if self.path is None:
            self.path = self._choose_path()
        return self._all_logprobs(self.path).cpu()

    @property
    def tokens_per_batch(self) -> int:
        """Positions per forward call that fit the memory budget (the estimate ``Scorer`` uses)."""
        per_position = activation_bytes_per_position(self.lm.config, next(self.lm.parameters()).dtype, self.row_length)
        return max(self.row_length, self.memory_budget // per_position)

    def layout(self, kind: str, items: Sequence[int] | None = None) -> Layout:
        """The prompts' rows of this kind (all prompts: built once per budget)."""
        key = (kind, self.row_length, self.tokens_per_batch)
        if items is None and key in self._layouts:
            return self._layouts[key]
        layout = build_layout(self._sequences, kind, self.row_length, self.tokens_per_batch, pad_id=self.cache.pad_id,
                              device=self.cache.device, chosen=None if items is None else list(items), last_only=True,
                              tree_mask_dtype=tree_mask_dtype(self.lm) or torch.bool)
        if items is None:
            self._layouts[key] = layout
        return layout

    def _all_logprobs(self, path: ScorePath, items: Sequence[int] | None = None) -> torch.Tensor:
        """Every item's log-probs (those of ``items`` only, where given: on every process alike)."""
        out = torch.zeros((self.cache.num_items, 2), dtype=torch.float32, device=self.cache.device)
        split = items is None  # the path check's sample runs everywhere
        for batch, keep in distributed.shard(self.layout(path.layout, items).batches, split=split):
            if keep:
                out[batch.score_sentences] = self._batch_logprobs(batch, path.head)[batch.score_contexts]
        # Each item is scored on one process, zeros elsewhere: the sum is its log-probs, bit for bit.
        return distributed.sum_over_processes(out) if split else out

    def _batch_logprobs(self, batch: Batch, head: str) -> torch.Tensor:
        """[read positions, 2]: log P("A") and log P("B") at each position the batch reads."""
        inputs = dict(input_ids=batch.input_ids, position_ids=batch.position_ids,
                      attention_mask=batch.attention_mask, use_cache=False)
        answers = torch.tensor(self.cache.answer_ids, device=self.cache.device)
        if head == "logits":
            logits = self._forward(**inputs).logits
            logits = logits.reshape(-1, logits.shape[-1]).index_select(0, batch.score_positions)
            return logits.float().log_softmax(-1)[:, answers]
        hidden = self.lm.base_model(**inputs).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.score_positions)
        # Both answers at every read position: contexts 0, 0, 1, 1, ... with targets A, B, A, B, ...
        contexts = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(2)
        weight = self.lm.get_output_embeddings().weight
        tile = head_tile(hidden.device, weight.shape[0], weight.dtype, self.memory_budget)
        return head_logprobs(self.lm, hidden, contexts, answers.repeat(hidden.shape[0]), tile).view(-1, 2)

    def _choose_path(self) -> ScorePath:
        """The fastest path whose answer log-probs match a plain one-prompt forward on a sample."""
        lengths = self.cache.lengths
        by_length = sorted(range(len(lengths)), key=lambda k: lengths[k])
        sample = sorted({by_length[round(i * (len(by_length) - 1) / 7)] for i in range(8)})
        reference = self.reference_logprobs(sample)
        tolerance = 1e-4 if next(self.lm.parameters()).dtype in (torch.float32, torch.float64) else 5e-2
        finite = torch.isfinite(reference)  # a diverged model's NaNs leave nothing to compare

        def matches(path: ScorePath) -> bool:
            return bool(((self._all_logprobs(path, sample)[sample] - reference).abs() <= tolerance)[finite].all())

        heads = ["chunked", "logits"] if self._has_head() else ["logits"]
        path = first_matching_path(self.lm, heads, matches, consensus=distributed.all_agree)
        if path is not None:
            return path
        raise ScoringError("no forced-choice path matches a plain forward of this model; its logits may be non-deterministic")

    @torch.no_grad()
    def reference_logprobs(self, items: Sequence[int]) -> torch.Tensor:
        """The definition, computed plainly: one prompt at a time, the whole model, full log-softmax."""
        answers = list(self.cache.answer_ids)
        rows = []
        for k in items:
            ids = self.cache.token_ids[self.cache.offsets[k] : self.cache.offsets[k + 1]].unsqueeze(0)
            logits = self._forward(input_ids=ids, use_cache=False).logits[0, -1].float()
            rows.append(logits.log_softmax(-1)[answers])
        return torch.stack(rows)

    def _has_head(self) -> bool:
        head = self.lm.get_output_embeddings() if hasattr(self.lm, "get_output_embeddings") else None
        return head is not None and hasattr(head, "weight") and self.lm.base_model is not self.lm

    def _check_model(self) -> None:
        check_weights_and_vocabulary(self.lm, self.cache.token_ids, self.cache.tokenizer_name, tuple(self.cache.answer_ids))
        context = getattr(self.lm.config, "max_position_embeddings", None)
        longest = max(self.cache.lengths)
        if context is not None and longest > context:
            k = self.cache.lengths.index(longest)
            raise ScoringError(
                f"forced-choice item {k} (pair {k // 2}, {ORDERS[k % 2]}) has {longest} prompt tokens, more than the "
                f"model's context of {context}; a prompt cannot be cut without losing the question"
            )


class ForcedChoiceEvaluator:
    """Holds the tokenized prompts and a scorer, so each evaluation is one batched forward pass.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template; not needed with ``cache``.
        data: a ``Benchmark``, a JSONL path, or None for ``TATBLIMP_DATA`` / the Hub dataset.
        prompt: the user message, with ``{a}`` and ``{b}`` for the two sentences (default
            ``DEFAULT_PROMPT``).
        system_prompt: a system message put before it; None: no system message.
        cache: an already built ``PromptCache``; it is moved to the model's device.
        allow_modified: accept a benchmark file that is not the official release.
        memory_budget: extra bytes one evaluation may use (default: from free device memory).
        path: force a ``ScorePath`` or "tree"/"packed"/"padded"; default: checked once.
    """

    def __init__(self, tokenizer: Any = None, data: Benchmark | str | os.PathLike | None = None, *,
                 prompt: str = DEFAULT_PROMPT, system_prompt: str | None = None, cache: PromptCache | None = None,
                 allow_modified: bool = False, memory_budget: int | None = None, path: ScorePath | str | None = None):
        if tokenizer is None and cache is None:
            raise ValueError("ForcedChoiceEvaluator needs a tokenizer or a prebuilt cache")
        self.tokenizer = tokenizer
        self.data = data
        self.prompt = check_prompt(prompt)
        self.system_prompt = system_prompt
        self.cache = cache
        self.allow_modified = allow_modified
        self.memory_budget = memory_budget
        self.path = path
        self._scorer: ForcedChoiceScorer | None = None

    def prepare(self, model: torch.nn.Module) -> ForcedChoiceScorer:
        """Build (or move) the prompt cache to the model's device and set up the scorer; once per model."""
        device = next(unwrap_model(model).parameters()).device
        if self.cache is None:
            self.cache = build_prompt_cache(self.tokenizer, self.data, prompt=self.prompt, system_prompt=self.system_prompt,
                                            device=device, allow_modified=self.allow_modified)
        elif self.cache.device != device:
            self.cache = self.cache.to(device)
        if self._scorer is None or self._scorer.model is not model:
            self._scorer = ForcedChoiceScorer(model, self.cache, memory_budget=self.memory_budget, path=self.path)
        return self._scorer

    def __call__(self, model: torch.nn.Module) -> ForcedChoiceResults:
        """Answer every item with ``model`` and return the results."""
        scorer = self.prepare(model)
        start = time.perf_counter()
        logprobs = scorer.logprobs()
        seconds = time.perf_counter() - start
        extra = {"path": str(scorer.path), "seconds": seconds, "oom_retries": scorer.oom_retries,
                 "answer_token_ids": list(self.cache.answer_ids)}
        name = getattr(scorer.lm.config, "_name_or_path", "") or self.cache.tokenizer_name
        return compute_choice_results(self.cache.benchmark, items_from_logprobs(logprobs), model=name,
                                      prompt=self.cache.prompt, system_prompt=self.cache.system_prompt, extra=extra)


def evaluate_forced_choice(model: torch.nn.Module, tokenizer: Any = None, data: Benchmark | str | os.PathLike | None = None,
                           **options) -> ForcedChoiceResults:
    """Forced choice on TatBLiMP, once; ``options`` are those of ``ForcedChoiceEvaluator``."""
    return ForcedChoiceEvaluator(tokenizer, data, **options)(model)
