"""Forced choice for instruction-tuned (chat) models: which of sentences A and B is grammatical?

Every pair is asked twice: item ``2*i`` shows pair ``i`` as A = good, B = bad (the right answer
is A), item ``2*i + 1`` as A = bad, B = good (the right answer is B), so 1,248 pairs give 2,496
items. Each prompt is the user message ``DEFAULT_PROMPT`` (or the caller's) rendered with the
tokenizer's own chat template and its generation prompt, so the next token is the assistant's
answer.

A local model answers with the letter whose token has the higher log-probability at that
position, read by the same scoring engine as the sentences (``scoring.Scorer``): the prompts are
a ``SentenceCache`` with ``answer_ids``, laid out in prefix-tree rows so that the chat template and
the question are computed once a row, and only each prompt's last position is read. An equal pair
of log-probs is a tie and counts as wrong. ``endpoint.py`` asks the same prompts of a
chat-completions server and parses its text answer. The metrics are in ``choice_results``.
"""

from __future__ import annotations

import hashlib
import os
import string
from collections.abc import Sequence
from typing import Any

import torch

from ..engine import distributed
from ..engine.kept_scorer import scorer_for
from ..engine.scoring import Scorer, ScoringMethod
from ..evaluation import timed_score
from ..reading.data import Benchmark, Pair, load_benchmark
from ..tokenized.cache import SentenceCache, cache_fingerprint, cache_from_token_lists
from ..tokenized.tokenization import TokenizationError, tokenizer_name
from .choice_results import (  # noqa: F401  (importable from here, as before)
    LETTERS,
    ORDERS,
    ChoiceGroup,
    ChoiceItem,
    ForcedChoiceResults,
    choice_results,
    compute_choice_results,
    items_from_logprobs,
)

DEFAULT_PROMPT = "Which of these two sentences is grammatical Tatar?\n\nA: {a}\nB: {b}\n\nAnswer with one letter: A or B."
"""The user message of every item; ``{a}`` and ``{b}`` are replaced by the two sentences."""

DEFAULT_ROW_LENGTH = 1024  # prompts are long: a row holds a few prefix trees of them


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


# -- the tokenized prompts ----------------------------------------------------------------------


def build_prompt_cache(
    tokenizer: Any,
    data: Benchmark | str | os.PathLike | None = None,
    *,
    prompt: str = DEFAULT_PROMPT,
    system_prompt: str | None = None,
    device: torch.device | str = "cpu",
    allow_modified: bool = False,
) -> SentenceCache:
    """Render every item with the tokenizer's chat template (generation prompt added) and tokenize once.

    The prompts' cache reads the answer tokens "A" and "B" (``answer_ids``) after each prompt.
    """
    benchmark = data if isinstance(data, Benchmark) else load_benchmark(data, allow_modified=allow_modified)
    name = tokenizer_name(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizationError(f"tokenizer {name} has no chat template; forced choice needs a chat model's tokenizer")
    conversations = all_item_messages(benchmark, prompt, system_prompt)
    texts = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
    # What apply_chat_template(tokenize=True) does, kept as two steps so the answer tokens can be checked on the text.
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    answer_ids = find_answer_ids(tokenizer, texts[0], encoded[0])
    pad = int(next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, encoded[0][-1]) if t is not None))
    key = f"{cache_fingerprint(benchmark, tokenizer, pad)}:{prompt}:{system_prompt}"
    cache = cache_from_token_lists(
        encoded,
        benchmark,
        texts,
        prefix_token_id=pad,
        tokenizer_name=name,
        fingerprint=hashlib.sha256(key.encode()).hexdigest()[:16],
        answer_ids=answer_ids,
        prompt=prompt,
        system_prompt=system_prompt,
    )
    return cache.to(device)


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


# -- the local evaluator -------------------------------------------------------------------------


class ForcedChoiceEvaluator:
    """Holds the tokenized prompts and a scorer, so each evaluation is one batched forward pass.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template; not needed with ``cache``.
        data: a ``Benchmark``, a JSONL path, or None for ``TATBLIMP_DATA`` / the Hub dataset.
        prompt: the user message, with ``{a}`` and ``{b}`` for the two sentences (default
            ``DEFAULT_PROMPT``).
        system_prompt: a system message put before it; None: no system message.
        cache: an already built prompt cache (``build_prompt_cache``); it is moved to the model's device.
        allow_modified: accept a benchmark file that is not the official release.
        memory_budget: extra bytes one evaluation may use (default: from free device memory).
        method: force a ``ScoringMethod`` or a layout ("tree", "packed", "padded"); default: chosen
            and checked by the scorer.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        data: Benchmark | str | os.PathLike | None = None,
        *,
        prompt: str = DEFAULT_PROMPT,
        system_prompt: str | None = None,
        cache: SentenceCache | None = None,
        allow_modified: bool = False,
        memory_budget: int | None = None,
        method: ScoringMethod | str | None = None,
    ):
        if tokenizer is None and cache is None:
            raise ValueError("ForcedChoiceEvaluator needs a tokenizer or a prebuilt cache")
        if cache is not None and not cache.answer_ids:
            raise ValueError("ForcedChoiceEvaluator needs a prompt cache (build_prompt_cache), not a sentence cache")
        self.tokenizer = tokenizer
        self.data = data
        self.prompt = check_prompt(prompt)
        self.system_prompt = system_prompt
        self.cache = cache
        self.allow_modified = allow_modified
        self.memory_budget = memory_budget
        self.method = method
        self._scorer: Scorer | None = None

    def prepare(self, model: torch.nn.Module) -> Scorer:
        """Build (or move) the prompt cache to the model's device and set up the scorer; once per model."""

        def build(device: torch.device) -> SentenceCache:
            return build_prompt_cache(
                self.tokenizer,
                self.data,
                prompt=self.prompt,
                system_prompt=self.system_prompt,
                device=device,
                allow_modified=self.allow_modified,
            )

        return scorer_for(self, model, build, memory_budget=self.memory_budget, method=self.method, row_length=DEFAULT_ROW_LENGTH)

    def __call__(self, model: torch.nn.Module, *, weights: str | None = None) -> ForcedChoiceResults:
        """Answer every item with ``model`` and return the results; ``weights``: as ``Evaluator``'s (the label of the
        model's weights, when the caller has just taken it).

        Under ``torch.distributed`` every process calls this; each scores a share of the batches
        and all of them return the same results. A failure on one process raises on all of them.
        """
        with distributed.shared_failures():  # the other processes are about to check in
            scorer = self.prepare(model)
        logprobs, run_info = timed_score(scorer, weights=weights)
        cache = scorer.cache
        run_info["answer_token_ids"] = list(cache.answer_ids)
        name = getattr(scorer.lm.config, "_name_or_path", "") or cache.tokenizer_name
        return choice_results(
            items_from_logprobs(logprobs),
            cache.phenomenon_index.cpu().numpy(),
            cache.phenomena,
            (cache.benchmark_md5, cache.benchmark_release, cache.benchmark_source),
            model=name,
            prompt=cache.prompt,
            system_prompt=cache.system_prompt,
            run_info=run_info,
        )


def evaluate_forced_choice(
    model: torch.nn.Module, tokenizer: Any = None, data: Benchmark | str | os.PathLike | None = None, **options
) -> ForcedChoiceResults:
    """Forced choice on TatBLiMP, once; ``options`` are those of ``ForcedChoiceEvaluator``."""
    return ForcedChoiceEvaluator(tokenizer, data, **options)(model)
