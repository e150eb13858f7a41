"""Where each log-prob lands, and how the cells are reduced: the readout's last steps.

Every scored token (sentences) or answer (prompts) has its own cell: a sequence's cells follow each
other, in token (or answer) order, and the sequences' in cache order. A span (``scored_spans``: a harness
request, scored on its continuation only) has a cell for each continuation token alone, its slots counted from
the first. A batch writes its log-probs into their cells once (``write``); a sentence's log-prob is then the sum
of its cells, added from the left as Python's ``sum()`` adds a list (``reduce``), so it is exactly the sum of its
token log-probs on any device, whatever the batching and the number of processes.
"""

from __future__ import annotations

import numpy as np
import torch

from ..tokenized.cache import SentenceCache


class Cells:
    """The cells of a cache's sequences: a sentence of n tokens has n - 1 (its scored tokens), a span one per scored
    token (``cache.span_tokens``), a prompt one per answer."""

    def __init__(self, cache: SentenceCache):
        self.answers = len(cache.answer_ids)
        self.lengths = list(cache.lengths)
        if self.answers:
            widths = torch.full((cache.num_sentences,), self.answers)
        else:
            widths = torch.tensor(self.lengths, dtype=torch.long) - 1
            if cache.span_tokens:
                widths[len(widths) - len(cache.span_tokens) :] = torch.tensor(cache.span_tokens, dtype=torch.long)
        self.widths = widths.to(cache.device)  # each sequence's number of cells
        self.starts = (widths.cumsum(0) - widths).to(cache.device)  # each sequence's first cell
        self.total = int(widths.sum())
        self.device = cache.device
        # For the reduction: the sentences longest first, so that those still adding a cell at slot k are
        # the first ``alive[k]`` of them (a slice, not a mask).
        order = torch.sort(widths, descending=True, stable=True).indices
        self._order = order.to(cache.device)
        self._order_starts = self.starts[self._order]
        counts = torch.bincount(widths, minlength=1)  # sentences of each width
        self._alive = counts.flip(0).cumsum(0).flip(0)[1:].tolist()  # alive[k]: sentences with more than k cells

    def empty(self) -> torch.Tensor:
        """Zeros, one a cell: float64 (float32 on MPS, which has no float64)."""
        dtype = torch.float32 if self.device.type == "mps" else torch.float64
        return torch.zeros(self.total, dtype=dtype, device=self.device)

    def write(self, cells: torch.Tensor, sequences: torch.Tensor, slots: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Put each log-prob in the cell of its sequence and slot (token place, or answer index)."""
        cells[self.starts[sequences] + slots] = logprobs.to(cells.dtype)

    def owners(self) -> torch.Tensor:
        """The sequence of each cell."""
        return torch.repeat_interleave(torch.arange(len(self.widths), device=self.device), self.widths)

    def non_finite(self, cells: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        """The sequences with a NaN or inf cell, and a mask of all their cells: ``([], None)`` when every cell is finite.

        A NaN in one sequence of a packed or tree row spreads to the row's other sequences (masked
        attention weights are zero, but zero times NaN is NaN), so only a row of its own tells
        which sequences are really non-finite: the scorer scores these again that way.
        """
        if torch.isfinite(cells).all():
            return [], None
        owners = self.owners()
        bad = owners[~torch.isfinite(cells)].unique().tolist()
        return bad, torch.isin(owners, torch.tensor(bad, device=owners.device))

    def reduce(self, cells: torch.Tensor) -> torch.Tensor:
        """Sentences: the sum of each one's cells, left to right; prompts: the answers' log-probs, [prompts, answers]."""
        if self.answers:
            return cells.view(-1, self.answers)
        if cells.device.type == "cpu" and self.device.type == "cpu":
            # The same additions in numpy: a slot's step costs a fifth of torch's on the CPU. Detached: a readout
            # called outside ``scoring_mode`` (the method check's, a test's) may carry autograd history.
            values, starts = cells.detach().numpy(), self._order_starts.numpy()
            by_width = np.zeros(len(starts), dtype=values.dtype)
            for slot, alive in enumerate(self._alive):
                by_width[:alive] += values[starts[:alive] + slot]
            total = np.empty_like(by_width)
            total[self._order.numpy()] = by_width
            return torch.from_numpy(total)
        by_width = torch.zeros(len(self.starts), dtype=cells.dtype, device=cells.device)
        for slot, alive in enumerate(self._alive):
            by_width[:alive] += cells[self._order_starts[:alive] + slot]  # slot k of every sentence that has one
        total = torch.empty_like(by_width)
        total[self._order] = by_width
        return total

    def per_sentence(self, cells: torch.Tensor) -> list[list[float]]:
        """Each sentence's cells as a list of floats, in token order (a span's: its scored tokens')."""
        values = cells.cpu().double().tolist()
        return [values[start : start + width] for start, width in zip(self.starts.tolist(), self.widths.tolist())]
