"""The harness's log-likelihood requests scored in the engine's prefix-tree rows: each request's log-prob and ``is_greedy``.

A request is lm-evaluation-harness's ``(context tokens, continuation tokens)``, already encoded the harness's
way (``HFLM._encode_pair``, its prefix token for an empty context). Its sequence is the two joined, cut from
the left to the model's context plus one as ``HFLM`` cuts it. The sequences are the spans of a cache of their own
(``scored_spans``: scored on their continuation only, with greedy flags), scored by the engine's ``Scorer`` as the
in-loop harness tasks are: prefix-tree rows (the choices of one question share the question's positions, each
computed once), the head applied only where a continuation token is predicted (``greedy_head``), the scorer's
out-of-memory retry and re-scoring of non-finite sequences. The scoring method is chosen once and checked again
when the weights have moved, against a plain forward of the model on the first call's requests cut short.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

from ..engine import distributed
from ..engine.model_checks import input_device
from ..engine.packing import TokenSequences
from ..engine.scored_spans import flat_sequence_cache
from ..engine.scoring import Scorer
from ..tokenized.cache import SentenceCache

CHECK_TOKENS = 64  # tokens of each sequence the scoring method is checked on

Request = tuple[Sequence[int], Sequence[int]]  # (context token ids, continuation token ids)


def request_sequences(requests: Sequence[Request], max_length: int) -> tuple[list[list[int]], list[int]]:
    """Each request's scored sequence (context + continuation, its last ``max_length + 1`` tokens) and continuation length.

    Raises:
        ValueError: a request with an empty context or continuation, or a continuation longer than ``max_length``.
    """
    sequences, continuation_lengths = [], []
    for k, (context, continuation) in enumerate(requests):
        _check_request(k, len(context), len(continuation), max_length)
        sequences.append([*context, *continuation][-(max_length + 1) :])
        continuation_lengths.append(len(continuation))
    return sequences, continuation_lengths


def _check_request(k: int, context: int, continuation: int, max_length: int) -> None:
    if not context or not continuation:
        raise ValueError(f"harness request {k}: empty {'context' if not context else 'continuation'} tokens")
    if continuation > max_length:
        raise ValueError(f"harness request {k}: a continuation of {continuation} tokens, over max_length {max_length}")


class RequestTokens(NamedTuple):
    """A call's requests as arrays (``request_tokens``)."""

    tokens: np.ndarray  # every sequence's token ids, one sequence after another
    lengths: np.ndarray  # each sequence's length
    continuation_lengths: np.ndarray
    # (holder, context length) of each request, the holder being the first request that holds the same context list
    # (the harness hands a question's choices one list); None where a sequence was cut from the left.
    shared_prefixes: tuple[np.ndarray, np.ndarray] | None


def request_tokens(requests: Sequence[Request], max_length: int) -> RequestTokens:
    """``request_sequences`` as arrays: every sequence's token ids one after another, each one's length, and each
    one's continuation length, with no Python step per request (the tokens read in one pass in C); and which
    requests share a context list (``RequestTokens.shared_prefixes``).

    Raises:
        ValueError: as ``request_sequences``, naming the first such request.
    """
    count = len(requests)
    contexts, continuations = zip(*requests) if count else ((), ())
    context_lengths = np.fromiter(map(len, contexts), dtype=np.int64, count=count)
    continuation_lengths = np.fromiter(map(len, continuations), dtype=np.int64, count=count)
    bad = np.flatnonzero((context_lengths == 0) | (continuation_lengths == 0) | (continuation_lengths > max_length))
    if len(bad):
        k = int(bad[0])
        _check_request(k, context_lengths[k], continuation_lengths[k], max_length)
    lengths = context_lengths + continuation_lengths
    tokens, holder = _joined_tokens(contexts, continuations, context_lengths, continuation_lengths)
    cut = lengths - np.minimum(lengths, max_length + 1)  # tokens cut from the left, as HFLM cuts them
    if cut.any():
        tokens, lengths = tokens[~_leading(cut, lengths)], lengths - cut
        return RequestTokens(tokens, lengths, continuation_lengths, None)
    return RequestTokens(tokens, lengths, continuation_lengths, (holder, context_lengths))


def _joined_tokens(
    contexts, continuations, context_lengths: np.ndarray, continuation_lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each request's context and continuation token ids, one request after another, read in C; and for each request
    the first one that holds its context list.

    A context list that several requests hold (the harness model hands out one list per distinct string: a question's
    choices share their context's) is read once and copied by numpy, not read again from Python's ints for each.
    """
    count = len(contexts)
    first_holder = {}  # a context list's id -> the first request holding it (the lists live as long as the requests)
    holder = np.fromiter(map(first_holder.setdefault, map(id, contexts), range(count)), dtype=np.int64, count=count)
    if len(first_holder) == count:  # no list held twice: the whole requests in one pass
        pairs = itertools.chain.from_iterable(zip(contexts, continuations))
        total = int(context_lengths.sum() + continuation_lengths.sum())
        return np.fromiter(itertools.chain.from_iterable(pairs), dtype=np.int32, count=total), holder
    firsts = np.fromiter(first_holder.values(), dtype=np.int64, count=len(first_holder))
    read = np.zeros(count, dtype=np.int64)  # where each request's context starts among the distinct ones read
    read[firsts] = np.cumsum(context_lengths[firsts]) - context_lengths[firsts]
    distinct = itertools.chain.from_iterable(map(contexts.__getitem__, firsts.tolist()))
    parts = [
        np.fromiter(distinct, dtype=np.int32, count=int(context_lengths[firsts].sum())),
        np.fromiter(itertools.chain.from_iterable(continuations), dtype=np.int32, count=int(continuation_lengths.sum())),
    ]
    # Request k's tokens are two runs, its context's among the distinct ones read, then its continuation's after them.
    runs = np.stack([context_lengths, continuation_lengths], axis=1).ravel()
    run_sources = np.stack([read[holder], len(parts[0]) + np.cumsum(continuation_lengths) - continuation_lengths], axis=1)
    shift = np.repeat(run_sources.ravel() - (np.cumsum(runs) - runs), runs)
    return np.concatenate(parts)[np.arange(len(shift)) + shift], holder


def _leading(counts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A mask over sequences laid one after another (``lengths``): the first ``counts[k]`` tokens of each."""
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return within < np.repeat(counts, lengths)


class RequestScorer:
    """Scores harness requests with one model: ``(log-prob, is_greedy)`` per request, in request order.

    Args:
        model: the causal LM (the harness's loaded model, or the training model).
        memory_budget: bytes of extra memory for activations and head tiles (None: the engine's default).
        row_length: positions per row (at least the longest sequence; raised to the largest question of those at most
            twice as long, ``Scorer``'s).
        each_process_its_own: under ``torch.distributed``, each process holds requests of its own (the harness's
            data-parallel ``HFLM`` deals them out by rank) and scores them alone; otherwise (the in-loop tasks)
            every process holds them all, and each scores a share of the batches.
        release_memory: on a CPU, hand the memory a call freed back to the system after it (``Scorer``'s).

    The scoring method (tree, packed or padded rows; the head) is chosen at the first call, as the engine chooses
    it for TatBLiMP, and checked again at a later call once the weights have moved (a training model's). The
    same requests again (an in-loop task at every evaluation) reuse the scorer and its plan.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        memory_budget: int | None = None,
        row_length: int = 256,
        each_process_its_own: bool = False,
        release_memory: bool = True,
    ):
        self.model = model
        self._options = {"memory_budget": memory_budget, "row_length": row_length, "release_memory": release_memory}
        self.each_process_its_own = each_process_its_own
        # Its method check serves every call (the first call's requests, cut); each call's scorer is bound from it.
        self._checker: Scorer | None = None
        self._scorer: Scorer | None = None  # the latest call's, with its plan
        self._sequences: tuple | None = None  # the latest call's (tokens, lengths, continuation lengths, pad id)

    @property
    def method(self):
        """The scoring method in use (None before the first call chose it)."""
        return self._checker.method if self._checker is not None else None

    def score(self, requests: Sequence[Request], pad_id: int, max_length: int) -> list[tuple[float, bool]]:
        """``(sum of the continuation's token log-probs, every continuation token greedy)`` of each request."""
        if not requests:
            return []
        read = request_tokens(requests, max_length)
        alone = distributed.this_process_only() if self.each_process_its_own else contextlib.nullcontext()
        with alone:  # no collectives over requests that differ from process to process
            scorer = self._scorer_for(read, pad_id)
            logprobs = scorer.score()
            return list(zip(logprobs.tolist(), scorer.spans.greedy(), strict=True))

    def _scorer_for(self, read: RequestTokens, pad_id: int) -> Scorer:
        """The scorer of these requests: the latest call's if they are the same, else one made for them (the cache
        on the device the model takes its input on, which a device map may set apart from its first weight's)."""
        tokens, lengths, continuation_lengths, shared_prefixes = read
        key = (tokens, lengths, continuation_lengths, pad_id)
        if self._scorer is not None and _same_requests(self._sequences, key) and self._scorer.serves(self.model):
            return self._scorer
        device = input_device(self.model)
        if self._checker is None or not self._checker.serves(self.model) or self._checker.cache.device != device:
            # The spans go through greedy_head, never through the timed head methods: nothing to time (and a head
            # never chosen reads by tiles, so the method check reads as it would unforced).
            check_cache = self._check_cache(tokens, lengths, pad_id, device)
            self._checker = Scorer(self.model, check_cache, head_method="tiles", **self._options)
        cache = flat_sequence_cache(tokens, lengths, pad_id, device, "lm-eval")
        cache = replace(cache, span_tokens=tuple(continuation_lengths.tolist()))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        host = TokenSequences(tokens, offsets, shared_prefixes)  # tree rows sort the distinct contexts only
        # The checker bound to these requests: its method check, the model's facts found once (``Scorer.for_cache``).
        scorer = self._checker.for_cache(cache, host)
        self._scorer, self._sequences = scorer, key
        return scorer

    @staticmethod
    def _check_cache(tokens: np.ndarray, lengths: np.ndarray, pad_id: int, device: torch.device) -> SentenceCache:
        """The sequences as the method check sees them: their first ``CHECK_TOKENS`` tokens, within the context.

        The check compares each layout with a plain forward of the whole model on a sample; whether a model honours
        the tree mask and the position ids shows on short sequences as well, at a fraction of the cost (a sample of
        long multiple-choice contexts took 40 of a call's 46 seconds). The rows themselves are laid out for the full
        sequences: a full rolling window is one token longer than the context, its last a target only.
        """
        short = np.minimum(lengths, CHECK_TOKENS)
        return flat_sequence_cache(tokens[_leading(short, lengths)], short, pad_id, device, "lm-eval")


def _same_requests(seen: tuple | None, key: tuple) -> bool:
    """Whether ``key`` (request tokens, lengths, continuation lengths, pad id) is the ``seen`` one, array by array."""
    return seen is not None and seen[-1] == key[-1] and all(np.array_equal(a, b) for a, b in zip(seen[:-1], key[:-1]))
