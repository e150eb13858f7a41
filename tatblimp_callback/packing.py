"""Laying the cached sentences out in rows for the forward passes.

Two layouts share one shape, a list of ``Batch`` objects:

- packed: sentences are packed first-fit-decreasing into rows of ``row_length`` tokens, with
  position ids that restart at every sentence and no attention mask, so that transformers builds
  a block-diagonal causal mask and almost no compute goes to padding;
- padded: one sentence a row, rows sorted by length and right-padded, with an attention mask; the
  fallback for architectures that do not honour packed position ids.

Each batch also says which of its positions are scored: position ``p`` predicts the token at
``p + 1`` of the same sentence. A sentence's last token predicts nothing, so it is left out of
the rows: a sentence of ``n`` tokens takes ``n - 1`` positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import SentenceCache


@dataclass
class Batch:
    """One forward call's inputs and the positions whose next-token log-prob is needed."""

    input_ids: torch.Tensor  # [rows, length]
    position_ids: torch.Tensor  # [rows, length]
    attention_mask: torch.Tensor | None  # [rows, length] for the padded layout, None when packed
    score_positions: torch.Tensor  # [k] flat indices into rows * length
    score_targets: torch.Tensor  # [k] token ids to be predicted there
    score_sentences: torch.Tensor  # [k] sentence index of each scored token

    @property
    def num_positions(self) -> int:
        return self.input_ids.numel()


@dataclass
class Layout:
    """All batches of one evaluation, plus what it costs in padding."""

    kind: str  # "packed" or "padded"
    batches: list[Batch]
    padded_positions: int
    total_positions: int

    @property
    def padding_share(self) -> float:
        return self.padded_positions / max(self.total_positions, 1)


def pack_rows(lengths: list[int], row_length: int) -> list[list[int]]:
    """First-fit decreasing: indices into ``lengths`` per row, each row's lengths summing to <= row_length."""
    order = sorted(range(len(lengths)), key=lambda s: (-lengths[s], s))
    rows: list[list[int]] = []
    free: list[int] = []
    for sentence in order:
        need = lengths[sentence]
        if need > row_length:
            raise ValueError(f"sentence {sentence} has {need} tokens, more than a row of {row_length}")
        row = next((r for r, room in enumerate(free) if room >= need), None)
        if row is None:
            rows.append([])
            free.append(row_length)
            row = len(rows) - 1
        rows[row].append(sentence)
        free[row] -= need
    return rows


def build_layout(
    cache: SentenceCache, kind: str, row_length: int, tokens_per_batch: int, sentences: list[int] | None = None
) -> Layout:
    """Rows of the given kind, grouped into batches of at most ``tokens_per_batch`` positions.

    ``sentences`` limits the layout to those sentence indices (all by default).
    """
    lengths = cache.lengths
    inputs = [n - 1 for n in lengths]  # positions a sentence takes: all its tokens but the last
    chosen = range(len(lengths)) if sentences is None else sentences
    if kind == "packed":
        row_length = max(row_length, max(inputs[s] for s in chosen))
        rows = [[chosen[i] for i in row] for row in pack_rows([inputs[s] for s in chosen], row_length)]
        row_lengths = [row_length] * len(rows)
    elif kind == "padded":
        rows = [[s] for s in sorted(chosen, key=lambda s: (-inputs[s], s))]
        row_lengths = [inputs[row[0]] for row in rows]
    else:
        raise ValueError(f"unknown layout {kind!r}; expected 'packed' or 'padded'")

    token_ids = cache.token_ids.cpu()
    offsets = cache.offsets.tolist()
    batches, padded, total = [], 0, 0
    start = 0
    while start < len(rows):
        # Rows are sorted longest first, so the first row of a batch sets its width.
        width = row_lengths[start]
        end = start + max(1, tokens_per_batch // width)
        batch = _make_batch(rows[start:end], width, token_ids, offsets, lengths, cache.prefix_token_id, kind)
        batches.append(_to_device(batch, cache.device))
        padded += batch.num_positions - sum(inputs[s] for row in rows[start:end] for s in row)
        total += batch.num_positions
        start = end
    return Layout(kind=kind, batches=batches, padded_positions=padded, total_positions=total)


def _make_batch(rows, width, token_ids, offsets, lengths, pad_id, kind) -> Batch:
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    positions, targets, sentences = [], [], []
    for r, row in enumerate(rows):
        column = 0
        for sentence in row:
            n = lengths[sentence] - 1  # inputs: every token but the last; targets: every token but the first
            start = offsets[sentence]
            input_ids[r, column : column + n] = token_ids[start : start + n]
            position_ids[r, column : column + n] = torch.arange(n)
            mask[r, column : column + n] = 1
            flat = r * width + column
            positions.append(torch.arange(flat, flat + n))
            targets.append(token_ids[start + 1 : start + n + 1])
            sentences.append(torch.full((n,), sentence, dtype=torch.long))
            column += n
        # Padding after the last sentence: its own position run, so it is a separate block when packed.
        position_ids[r, column:] = torch.arange(width - column)
    return Batch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=mask if kind == "padded" else None,
        score_positions=torch.cat(positions),
        score_targets=torch.cat(targets),
        score_sentences=torch.cat(sentences),
    )


def _to_device(batch: Batch, device: torch.device) -> Batch:
    return Batch(**{name: None if value is None else value.to(device) for name, value in vars(batch).items()})
