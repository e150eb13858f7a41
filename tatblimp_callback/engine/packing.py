"""Laying the cached sentences out in rows for the forward passes.

Three layouts share one shape, a list of ``Batch`` objects:

- tree: sentences sorted by their token ids fill rows of ``row_length`` positions as prefix
  trees: sentences that start with the same tokens (a minimal pair's two sentences, the prefix
  token of every sentence) share those positions, so each distinct context is computed once (on
  TatBLiMP about a third fewer positions). Position ids are depths in the tree and a 4D mask lets
  each position see its ancestors only; it needs an attention that takes such a mask (sdpa, eager);
- packed: sentences are packed first-fit-decreasing into rows, with position ids that restart at
  every sentence and no attention mask, so that transformers builds a block-diagonal causal mask
  (flash-attention takes its variable-length path) and almost no compute goes to padding;
- padded: one sentence a row, rows sorted by length and right-padded, with an attention mask; the
  fallback for architectures that honour neither.

Each batch also says which of its positions are read and which token each of them must predict
for which sentence: a position may be the context of several sentences' tokens. A sentence's last
token predicts nothing, so it is left out of the rows: a sentence of ``n`` tokens needs ``n - 1``
positions. The forced-choice prompts use the same layouts with ``answer_ids``: every token of a
prompt is an input, and only its last position is read, for the log-prob of each answer token.

Every scored (position, token) also names its cell: its sequence and its slot there, for sentences
the token's place in the sentence, for prompts the answer's index. Each cell is written once, so
the scorer can sum a sentence's tokens in a fixed order, whatever the batching.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Batch:
    """One forward call's inputs, the positions read from it, and the tokens they predict."""

    input_ids: torch.Tensor  # [rows, length]
    position_ids: torch.Tensor  # [rows, length]
    # None when packed; [rows, length] when padded; [rows, 1, length, length] (bool, or additive
    # float for eager attention) for prefix trees.
    attention_mask: torch.Tensor | None
    score_positions: torch.Tensor  # [k] flat indices into rows * length: the contexts read
    score_contexts: torch.Tensor  # [t] for each scored token, its context: an index into score_positions
    score_targets: torch.Tensor  # [t] token ids to be predicted
    score_sentences: torch.Tensor  # [t] sentence (or prompt) index of each scored token
    score_slots: torch.Tensor  # [t] its place among its sequence's cells (token place, or answer index)

    @property
    def num_positions(self) -> int:
        return self.input_ids.numel()


class Batches(Sequence):
    """A layout's batches, each built (and moved to the device) when it is read, and not kept.

    Only the rows (sequence indices) are held, so the memory of a layout does not grow with the
    masks and index tensors of every row: one forward call's batch exists at a time.
    """

    def __init__(self, groups: list[tuple[list[list[int]], int]], sequences, options: dict):
        self.groups = groups  # (rows, width) of each batch
        self.sequences = sequences
        self.options = options  # pad_id, kind, answer_ids, tree_mask_dtype, device

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        rows, width = self.groups[index]
        o = self.options
        batch, _ = _make_batch(rows, width, self.sequences, o["pad_id"], o["kind"], o["answer_ids"], o["tree_mask_dtype"])
        return _to_device(batch, o["device"])

    def __iter__(self):
        for index in range(len(self)):
            yield self[index]  # not bound to a name here: the previous batch is freed before the next is built

    @property
    def positions(self) -> list[int]:
        """Positions (rows x width) of each batch, without building it."""
        return [len(rows) * width for rows, width in self.groups]


class TokenSequences(Sequence):
    """A cache's sequences on the host, compact: one int32 array and the offsets; a sequence is a list when read.

    The scorer keeps these for its layouts' batches: 4 bytes a token, where lists of Python ints take
    about ten times as much.
    """

    def __init__(self, token_ids: torch.Tensor, offsets: torch.Tensor):
        self.ids = token_ids.cpu().numpy().astype(np.int32)
        self.offsets = offsets.cpu().numpy().astype(np.int64)

    @classmethod
    def of(cls, sequences: Sequence[list[int]]) -> TokenSequences:
        """``sequences`` as they are if they are ``TokenSequences``, else (lists of ids) packed into one."""
        if isinstance(sequences, TokenSequences):
            return sequences
        lengths = torch.tensor([0] + [len(ids) for ids in sequences], dtype=torch.long)
        return cls(torch.tensor([t for ids in sequences for t in ids], dtype=torch.long), lengths.cumsum(0))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> list[int]:
        return self.ids[self.offsets[index] : self.offsets[index + 1]].tolist()

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass
class Layout:
    """All batches of one evaluation, plus what it costs in padding and saves by sharing."""

    kind: str  # "tree", "packed" or "padded"
    batches: Batches
    padded_positions: int
    total_positions: int
    sentence_positions: int  # positions the sequences would take one by one (their inputs)

    @property
    def padding_share(self) -> float:
        return self.padded_positions / max(self.total_positions, 1)

    @property
    def saved_by_prefix_sharing(self) -> float:
        """Share of the sentences' positions that prefix sharing saved (0 unless ``kind == "tree"``)."""
        used = self.total_positions - self.padded_positions
        return 1 - used / max(self.sentence_positions, 1)


LAYOUTS = ("tree", "packed", "padded")
COMPARED_AT_ONCE = 8192  # sorted sequences compared with their neighbours at a time when laying out trees


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


def tree_rows(sequences: Sequence[list[int]], row_length: int) -> list[list[int]]:
    """Indices into ``sequences`` per row, in sorted order, each row's prefix tree at most ``row_length`` nodes.

    In sorted order a sequence shares the most leading tokens with the one just before it, so the
    tree grows by the tokens after that common prefix.
    """
    sequences = TokenSequences.of(sequences)
    lengths = sequences.lengths()
    return _tree_rows(_input_matrix(sequences, list(range(len(lengths))), lengths), lengths, row_length)[0]


def _tree_rows(matrix: np.ndarray, lengths: np.ndarray, row_length: int) -> tuple[list[list[int]], int]:
    """``tree_rows`` of the sequences padded with -1 into ``matrix`` [sequences x longest], and the nodes of all rows.

    Sorted as lists sort (a shorter sequence before the longer ones it starts; -1 is below any token
    id), equal sequences by index; the common prefixes of neighbours are computed for all at once.
    """
    too_long = np.flatnonzero(lengths > row_length)
    if len(too_long):
        raise ValueError(f"sentence {too_long[0]} has {lengths[too_long[0]]} tokens, more than a row of {row_length}")
    order = np.lexsort((np.arange(len(lengths)), *matrix.T[::-1]))
    common = np.zeros(len(order), dtype=np.int64)  # tokens each shares with the one before it
    for start in range(1, len(order), COMPARED_AT_ONCE):  # in slices: no sorted copy of the whole matrix
        current = matrix[order[start : start + COMPARED_AT_ONCE]]
        previous = matrix[order[start - 1 : start - 1 + len(current)]]
        same = (current == previous) & (current >= 0)
        common[start : start + len(current)] = np.logical_and.accumulate(same, axis=1).sum(axis=1)
    rows: list[list[int]] = []
    size = nodes = 0
    for index, length, shared in zip(order.tolist(), lengths[order].tolist(), common.tolist()):
        new = length - shared
        if not rows or size + new > row_length:
            nodes += size
            rows.append([])
            size, new = 0, length
        rows[-1].append(index)
        size += new
    return rows, nodes + size


def build_layout(
    sequences: list[list[int]],
    kind: str,
    row_length: int,
    tokens_per_batch: int,
    *,
    pad_id: int,
    device: torch.device | str = "cpu",
    chosen: list[int] | None = None,
    answer_ids: tuple[int, ...] = (),
    tree_mask_dtype: torch.dtype = torch.bool,
) -> Layout:
    """Rows of the given kind, grouped into batches of at most ``tokens_per_batch`` positions.

    Without ``answer_ids`` a sequence's inputs are all its tokens but the last and its targets all
    but the first. With ``answer_ids`` all its tokens are inputs and its last position is read for
    each answer token (one position read per sequence). ``chosen`` limits the layout to those
    sequence indices (all by default). ``tree_mask_dtype``: the tree layout's mask is boolean (True:
    attend), or additive in this floating dtype (0 or its most negative value), as the model's
    attention wants it.
    """
    sequences = TokenSequences.of(sequences)
    chosen = list(range(len(sequences)) if chosen is None else chosen)
    chosen_inputs = sequences.lengths()[chosen] - (0 if answer_ids else 1)
    inputs = dict(zip(chosen, chosen_inputs.tolist()))
    row_length = max(row_length, max(inputs.values()))
    if kind == "tree":
        tree, used = _tree_rows(_input_matrix(sequences, chosen, chosen_inputs), chosen_inputs, row_length)
        rows = [[chosen[i] for i in row] for row in tree]
        widths = [row_length] * len(rows)
    elif kind == "packed":
        rows = [[chosen[i] for i in row] for row in pack_rows([inputs[s] for s in chosen], row_length)]
        widths = [row_length] * len(rows)
    elif kind == "padded":
        rows = [[s] for s in sorted(chosen, key=lambda s: (-inputs[s], s))]
        widths = [inputs[row[0]] for row in rows]
    else:
        raise ValueError(f"unknown layout {kind!r}; expected one of {LAYOUTS}")

    groups, total = [], 0
    start = 0
    while start < len(rows):
        # Rows are sorted longest first (or all as wide), so the first row of a batch sets its width;
        # a batch ends where the budget does, or where rows get a quarter narrower (less padding).
        width = widths[start]
        end, limit = start + 1, min(len(rows), start + max(1, tokens_per_batch // width))
        while end < limit and 4 * widths[end] >= 3 * width:
            end += 1
        groups.append((rows[start:end], width))
        total += (end - start) * width
        start = end
    options = dict(pad_id=pad_id, kind=kind, answer_ids=answer_ids, tree_mask_dtype=tree_mask_dtype, device=device)
    if kind != "tree":
        used = sum(inputs.values())
    return Layout(
        kind=kind,
        batches=Batches(groups, sequences, options),
        padded_positions=total - used,
        total_positions=total,
        sentence_positions=sum(inputs.values()),
    )


def _make_batch(rows, width, sequences, pad_id, kind, answer_ids, tree_mask_dtype) -> tuple[Batch, int]:
    """The batch of these rows, and how many of its positions are not padding."""
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    used = torch.zeros((len(rows), width), dtype=torch.long)
    # Each column's parent column in its row's tree (itself at a root and in padding): the mask is built
    # from these with tensor ops, never from a Python list of every attending pair (a forward call has millions).
    parents = torch.arange(width).repeat(len(rows), 1)
    depth_most = 0
    positions, contexts, targets, owners, slots = [], [], [], [], []
    filled = 0
    for r, row in enumerate(rows):
        columns: dict[tuple[int, int], int] = {}  # a node of the row -> its column
        read: dict[int, int] = {}  # column -> its index in ``positions``
        for sequence in row:
            ids = sequences[sequence]
            last = len(ids) - (1 if answer_ids else 2)  # the depth of its last input
            parent = -1
            for depth, token in enumerate(ids[: last + 1]):
                # In a tree a node is a distinct prefix; otherwise every sequence has positions of its own.
                node = (parent, token) if kind == "tree" else (sequence, depth)
                column = columns.get(node)
                if column is None:
                    column = columns[node] = len(columns)
                    if parent >= 0:
                        parents[r, column] = parent
                    input_ids[r, column] = token
                    position_ids[r, column] = depth
                    depth_most = max(depth_most, depth)
                parent = column
                if answer_ids and depth < last:
                    continue
                if column not in read:
                    read[column] = len(positions)
                    positions.append(r * width + column)
                read_here = enumerate(answer_ids) if answer_ids else [(depth, ids[depth + 1])]
                for slot, target in read_here:
                    contexts.append(read[column])
                    targets.append(target)
                    owners.append(sequence)
                    slots.append(slot)
        filled += len(columns)
        used[r, : len(columns)] = 1
        # Padding after the last sequence: its own position run, so it is a separate block when packed.
        position_ids[r, len(columns) :] = torch.arange(width - len(columns))
    if kind == "tree":
        attention_mask = _tree_mask(parents, depth_most).unsqueeze(1)
        if tree_mask_dtype != torch.bool:
            attention_mask = torch.zeros(attention_mask.shape, dtype=tree_mask_dtype).masked_fill_(
                ~attention_mask, torch.finfo(tree_mask_dtype).min
            )
    else:
        attention_mask = used if kind == "padded" else None
    batch = Batch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        score_positions=torch.tensor(positions, dtype=torch.long),
        score_contexts=torch.tensor(contexts, dtype=torch.long),
        score_targets=torch.tensor(targets, dtype=torch.long),
        score_sentences=torch.tensor(owners, dtype=torch.long),
        score_slots=torch.tensor(slots, dtype=torch.long),
    )
    return batch, filled


def _tree_mask(parents: torch.Tensor, depth_most: int) -> torch.Tensor:
    """[rows, width, width] bool: each column sees itself and its ancestors (``parents``: [rows, width], a
    root's and padding's parent is itself, so padding attends to itself only)."""
    rows, width = parents.shape
    tree = torch.zeros((rows, width, width), dtype=torch.bool)
    seen = torch.arange(width).repeat(rows, 1)  # each column's ancestor at the current step up
    for _ in range(depth_most + 1):  # a column at depth d has d ancestors: d steps up reach its root
        tree.scatter_(2, seen.unsqueeze(2), True)
        seen = parents.gather(1, seen)
    return tree


def _input_matrix(sequences: TokenSequences, chosen: list[int], inputs: np.ndarray) -> np.ndarray:
    """The first ``inputs[i]`` tokens of each chosen sequence, one a row, padded with -1: [chosen x longest input]."""
    # The flat index of every input token, row after row: each row's start, plus 0, 1, ... within the row.
    flat = np.arange(inputs.sum()) + np.repeat(sequences.offsets[chosen] - np.cumsum(inputs) + inputs, inputs)
    matrix = np.full((len(chosen), int(inputs.max(initial=0))), -1, dtype=np.int32)
    matrix[np.arange(matrix.shape[1]) < inputs[:, None]] = sequences.ids[flat]
    return matrix


def _to_device(batch: Batch, device: torch.device) -> Batch:
    return Batch(**{name: None if value is None else value.to(device) for name, value in vars(batch).items()})
