"""One pass of a ``Scorer`` over a row layout's batches: every log-prob it reads written once into its cell.

The batches are dealt out over processes (``distributed.shard``) and the cells summed across them, or, for the
method check's sample, all run on every process; each batch's log-probs come from the scorer (through its CUDA
graphs' replays where the kept plan has them, ``cuda_graphs``). Sequences that come out NaN or inf are scored again
on rows of their own, so that one diverged sequence does not spread to the others of its row.
"""

from __future__ import annotations

import torch

from . import distributed
from .scoring_method import ScoringMethod
from .tree_mask import reused_buffer


def score_cells(
    scorer, method: ScoringMethod, sequences: range | list[int] | None = None, split=None, keep_layout=False, spans=None
) -> torch.Tensor:
    """The log-prob of every scored token (sentences) or answer (prompts), one cell each, written once
    (zeros where nothing is read): sequence ``s``'s cells start at ``scorer.cells.starts[s]``, in token (or answer) order.

    Across processes (``split``, default: all sequences) the batches are dealt out and the cells added up (each
    cell comes from one process, zeros from the others: exact); otherwise (the method check's sample) every process
    runs them all. A filler batch only keeps a sharded model's forward calls in step. Each batch is built when it is
    read and freed before the next; the kept plan's (``keep_layout``) may be CUDA graphs' replays. With ``spans``
    (``scored_spans.SpanReader``) their sequences' context tokens are not in the layout, and their greedy flags are kept.
    """
    cells = scorer.cells.empty()
    layout = scorer._layout(method, sequences, keep_layout, spans)
    split = (sequences is None if split is None else split) and not scorer.tensor_parallel
    graphs = keep_layout and scorer.graphs.batches(layout, (method, scorer.head_method), scorer.head.choosing, spans)
    with reused_buffer():  # each batch's CPU tree mask written where the one before was
        for batch, is_filler in distributed.shard(graphs or layout.batches, split=split, lockstep=scorer.sharded):
            logprobs = scorer.graphs.logprobs(batch, scorer, method.head, None if is_filler else spans)
            if not is_filler:
                scorer.cells.write(cells, batch.score_sentences, batch.score_slots, logprobs)
            del batch, logprobs  # before the next batch is built: one batch's tensors at a time
    cells = distributed.sum_over_processes(cells) if split else cells
    if spans is not None and split:
        spans.misses = distributed.sum_over_processes(spans.misses)
    if method.layout != "padded":
        cells = _rescore_non_finite(scorer, cells, method.head, spans)
    return cells


def _rescore_non_finite(scorer, cells: torch.Tensor, head: str, spans=None) -> torch.Tensor:
    """Score again, one sequence a row, the sequences with a NaN or inf log-prob (``Cells.non_finite`` says why)."""
    bad, theirs = scorer.cells.non_finite(cells)
    if bad:
        cells[theirs] = score_cells(scorer, ScoringMethod("padded", head), bad, spans=spans)[theirs]
    return cells
