"""Sequences of which only the last tokens are scored, with greedy flags: lm-evaluation-harness's requests in the fused pass.

A harness request is a context and a continuation; its log-likelihood is the sum of the continuation tokens'
log-probs, and it is greedy when every continuation token is its position's argmax. ``Spans`` are such sequences
(token ids, and how many tokens at the end are scored); the evaluator puts them in the same cache as TatBLiMP's
sentences, so that one layout and one sweep of forward calls serve both, prefix-tree rows sharing positions across
them. Within a batch (``SpanReader.batch_logprobs``) the model's body runs once; the sentences' tokens go through the
scorer's own head, the spans' continuation tokens through ``greedy_head`` (log-prob and argmax from the same
tiles; the harness model, ``harness/fused.py``, scores its requests as spans of a cache of their own). A span's
context tokens are never read: its cells are its continuation tokens' alone (``cells``), so a span's log-prob is its
cells' sum as for a sentence. Each continuation token that is not the argmax puts 1 in its cell of ``misses``,
which are added over processes like the log-probs (each cell written by one process).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..tokenized.cache import SentenceCache
from .cells import Cells
from .greedy_head import greedy_logprobs
from .packing import Batch, TokenSequences

# Sequences that share a prefix (a harness question and its choices: ``TokenSequences.shared_prefixes``, or spans
# with one context, ``span_questions``) get rows as wide as the largest such tree of those at most this
# many times the row length otherwise used: split, a tree's next row holds its prefix again (400 multiple-choice
# requests: 180 rows of 332 positions for 100 questions, against 100 rows of 320 or 374). A larger group (BLiMP's
# requests, which share only the prefix token) is split whatever the rows.
WHOLE_TREE_ROWS = 2


@dataclass
class Spans:
    """Token sequences scored on their last tokens only: ``sequences[k]``'s last ``scored[k]`` tokens.

    Raises:
        ValueError: a sequence without a token to condition on, or scoring none or all of its tokens.
    """

    sequences: list[list[int]]
    scored: list[int]
    name: str = "lm-eval"

    def __post_init__(self):
        for k, (ids, n) in enumerate(zip(self.sequences, self.scored, strict=True)):
            if not 0 < n < len(ids):
                raise ValueError(f"{self.name} sequence {k}: {n} scored tokens of {len(ids)}; at least one must precede them")

    def __len__(self) -> int:
        return len(self.sequences)

    def cache(self, prefix_token_id: int, device: torch.device | str = "cpu") -> SentenceCache:
        """The sequences as a ``SentenceCache`` (no pairs, no text), padded with ``prefix_token_id``."""
        return sequence_cache(self.sequences, prefix_token_id, torch.device(device), self.name)


def sequence_cache(sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device, name: str) -> SentenceCache:
    """Token sequences as a ``SentenceCache`` on ``device`` (no pairs, no text): what the engine lays out and scores."""
    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    # One pass over the tokens in C: a list comprehension of 800K tokens took 280 ms, this 70 (loaded 2-core VM, 2026-12-04).
    token_ids = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=int(lengths.sum()))
    return flat_sequence_cache(token_ids, lengths, pad_id, device, name)


def flat_sequence_cache(
    token_ids: np.ndarray, lengths: np.ndarray, pad_id: int, device: torch.device, name: str
) -> SentenceCache:
    """``sequence_cache`` of sequences given as one array of their token ids, one after another, and their lengths."""
    lengths = torch.from_numpy(np.asarray(lengths, dtype=np.int64))
    empty = torch.zeros(0, dtype=torch.long)
    return SentenceCache(
        token_ids=torch.from_numpy(np.asarray(token_ids, dtype=np.int64)).to(device),
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device),
        byte_lengths=torch.zeros(len(lengths), dtype=torch.long, device=device),
        phenomenon_index=empty.to(device),
        subtype_index=empty.to(device),
        phenomena=[],
        subtypes=[],
        prefix_token_id=pad_id,
        tokenizer_name=name,
        fingerprint=name,
        benchmark_source=name,
        benchmark_md5="",
        benchmark_release="",
    )


def span_questions(host: TokenSequences, spans: Sequence[int], at_most: int) -> tuple[np.ndarray, int]:
    """Each sequence's group (a harness question: the spans, the last ``len(spans)`` sequences of ``host``, with the
    same context) and the inputs of the largest group's prefix tree of those of at most ``at_most`` inputs (the
    context once, then each span's inputs after it, as ``TokenSequences.shared_trees`` counts them). A sequence
    outside such a group is a group of its own (a sentence; BLiMP's requests, which share only the prefix token, make
    a group larger than any row)."""
    groups = np.arange(len(host))
    first = len(host) - len(spans)
    ids, offsets = host.ids, host.offsets.tolist()
    questions: dict[bytes, list[int]] = {}  # a context's tokens -> [its tree's inputs, its first span]
    for k, scored in enumerate(spans):
        start, end = offsets[first + k], offsets[first + k + 1]
        question = questions.setdefault(ids[start : end - scored].tobytes(), [end - scored - start, first + k])
        question[0] += scored - 1
        groups[first + k] = question[1]
    fitting = {holder: tree for tree, holder in questions.values() if tree <= at_most}
    alone = ~np.isin(groups, np.fromiter(fitting, dtype=np.int64, count=len(fitting)))
    groups[alone] = np.flatnonzero(alone)
    return groups, max(fitting.values(), default=0)


def question_rows(cache: SentenceCache, sequences: TokenSequences | None, row_length: int) -> tuple[int, TokenSequences | None]:
    """``row_length`` raised so that a harness question's choices share one row (``WHOLE_TREE_ROWS``), and the host
    sequences to lay out: ``sequences`` (their ``shared_prefixes`` name the questions), or, for spans in a cache of
    sentences (the in-loop pass), the cache's own with the questions found by their contexts (``span_questions``)."""
    at_most = WHOLE_TREE_ROWS * row_length
    if sequences is not None:
        trees = sequences.shared_trees()
        return max(row_length, int(trees[trees <= at_most].max(initial=0))), sequences
    if not cache.span_tokens:
        return row_length, None
    host = TokenSequences(cache.token_ids, cache.offsets)  # the layouts' host ids too: copied from the device once
    host.groups, tree = span_questions(host, cache.span_tokens, at_most)
    return max(row_length, tree), host


class SpanReader:
    """Which sequences of a scorer's cache are spans, from which cell on, and their greedy flags after a pass.

    Args:
        cells: the scorer's cells.
        first: the index in the cache of the first span sequence (the spans come last, one after another).
        scored: the tokens scored at the end of each span.
    """

    def __init__(self, cells: Cells, first: int, scored: Sequence[int]):
        sequences = len(cells.widths)
        self.first, self.count = first, len(scored)
        self.is_span = torch.zeros(sequences, dtype=torch.bool, device=cells.device)
        self.is_span[first : first + len(scored)] = True
        # Each sequence's first scored input (0 for a sentence, the one before the continuation's first token for a
        # span), on the host: the layouts of the passes that read the spans hold no (context, target) pair before it
        # (``packing.build_layout``), and a span's cells are its continuation's (``cells``).
        self.scored_from = np.zeros(sequences, dtype=np.int64)
        self.scored_from[first : first + len(scored)] = np.asarray(cells.lengths[first:]) - 1 - np.asarray(scored)
        # The spans' cells, and the span of each: what ``greedy`` reads (not every cell of the cache).
        self._continuation_cells = torch.arange(int(cells.starts[first]), cells.total, device=cells.device)
        scored = torch.tensor(list(scored), dtype=torch.long, device=cells.device)
        self._owner = torch.repeat_interleave(torch.arange(len(scored), device=cells.device), scored)
        self.cells = cells
        self.misses = cells.empty()  # 1 in each cell whose token is not its position's argmax (this pass)
        self._tokens_read = torch.zeros((), dtype=torch.long, device=cells.device)  # counted on the device: no sync

    @property
    def tokens_read(self) -> int:
        """Continuation tokens this process gave the head in the latest pass."""
        return int(self._tokens_read)

    def begin(self) -> None:
        """A new pass: no misses, nothing read."""
        self.misses = self.cells.empty()
        self._tokens_read = torch.zeros((), dtype=torch.long, device=self.cells.device)

    def greedy(self) -> list[bool]:
        """Each span's ``is_greedy`` from the latest pass (the misses added over processes)."""
        misses = torch.zeros(self.count, dtype=self.misses.dtype, device=self.misses.device)
        misses.index_add_(0, self._owner, self.misses[self._continuation_cells])
        return (misses == 0).tolist()

    def batch_logprobs(self, scorer, batch: Batch, output: torch.Tensor, head: str, read: Callable) -> torch.Tensor:
        """The batch's log-probs, one per scored (context, target) as the scorer writes them: the sentences' from
        ``read(output, part)`` (the scorer's head), the spans' continuations' from ``greedy_head`` (their misses
        noted; a span's context tokens are not in the batch). ``output``: the forward call's hidden states (or logits)
        at the batch's read positions."""
        mine = self.is_span[batch.score_sentences]  # the layout holds a span's continuation tokens only (``scored_from``)
        logprobs = torch.zeros(mine.shape, dtype=torch.float32, device=self.cells.device)
        plain = ~mine
        any_plain, any_mine = torch.stack([plain.any(), mine.any()]).tolist()  # the batch's one sync of its own
        if any_plain:
            logprobs[plain] = read(*_narrowed(output, batch, plain)).to(logprobs.device)
        if any_mine:
            hidden, part = _narrowed(output, batch, mine) if any_plain else (output, batch)  # spans alone: all of it
            lp, top = greedy_logprobs(scorer.lm, hidden, part.score_contexts, part.score_targets, head, scorer.memory_budget)
            logprobs[mine] = lp.to(logprobs.device)
            self.misses[self.cells.starts[part.score_sentences] + part.score_slots] = (~top).to(self.misses)
            self._tokens_read += mine.sum()
        return logprobs


def _narrowed(output: torch.Tensor, batch: Batch, keep: torch.Tensor) -> tuple[torch.Tensor, Batch]:
    """The rows of ``output`` and the (context, target) pairs of ``batch`` that ``keep`` selects, contexts renumbered."""
    # The distinct contexts, sorted, and each pair's among them (``unique(return_inverse=True)`` without its sort):
    # the contexts are indices into the batch's read positions, so a mark over those finds them in one pass.
    contexts = batch.score_contexts[keep]
    present = torch.zeros(len(batch.score_positions), dtype=torch.bool, device=contexts.device)
    present[contexts] = True
    read = present.nonzero().squeeze(1)
    inverse = (present.cumsum(0) - 1)[contexts]
    part = replace(
        batch,
        score_positions=batch.score_positions[read],
        score_contexts=inverse,
        score_targets=batch.score_targets[keep],
        score_sentences=batch.score_sentences[keep],
        score_slots=batch.score_slots[keep],
    )
    return output[read.to(output.device)], part
