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

from .rows import RowOrder, packed_order, padded_matrix, padded_order, shared_prefix_order, tree_order, trees_in_rows
from .tree_mask import interval_mask
from .tree_nodes import new_nodes, nodes_at, subtree_ends


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


class TokenSequences(Sequence):
    """A cache's sequences on the host, compact: one int32 array and the offsets; a sequence is a list when read.

    The scorer keeps these for its layouts' batches: 4 bytes a token, where lists of Python ints take
    about ten times as much.
    """

    def __init__(
        self,
        token_ids: torch.Tensor | np.ndarray,
        offsets: torch.Tensor | np.ndarray,
        shared_prefixes: tuple[np.ndarray, np.ndarray] | None = None,
    ):
        self.ids = np.asarray(token_ids.cpu() if isinstance(token_ids, torch.Tensor) else token_ids, dtype=np.int32)
        self.offsets = np.asarray(offsets.cpu() if isinstance(offsets, torch.Tensor) else offsets).astype(np.int64)
        # (holder, prefix) where the maker knows them: sequence k starts with the first prefix[k] tokens of sequence
        # holder[k] (the harness's requests: a question's choices hold its context), so that tree rows sort the
        # distinct prefixes once (``rows.shared_prefix_order``).
        self.shared_prefixes = shared_prefixes
        # Each sequence's group where the maker knows them without the prefixes (a question's spans in a fused cache,
        # ``scored_spans.question_rows``): a tree row ends before a group it would split.
        self.groups: np.ndarray | None = None

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

    def shared_trees(self) -> np.ndarray:
        """Inputs of each group of sequences that share a prefix (``shared_prefixes``), as one prefix tree: the prefix
        once, then each sequence's inputs after it (at most that: two choices may start alike); none without them."""
        if self.shared_prefixes is None or len(self) == 0:
            return np.zeros(0, dtype=np.int64)
        holder, prefix = self.shared_prefixes
        holders = np.unique(holder)
        after = np.bincount(holder, weights=self.lengths() - 1 - prefix, minlength=len(self))
        return (prefix[holders] + after[holders]).astype(np.int64)


class Batches(Sequence):
    """A layout's batches: prepared once as compact tensors on the device (the plan), or built when read.

    With ``prepared`` (the plan fits its share of the memory budget) reading a batch only widens its
    integer tensors and broadcasts the tree mask from the subtree sizes; otherwise each batch's arrays
    are computed (with numpy, from the rows) when it is read, and freed before the next.
    """

    def __init__(self, rows: RowOrder, groups: list[tuple[int, int, int]], sequences: TokenSequences, options: dict):
        self.rows = rows
        self.groups = groups  # (first row, end row, width) of each batch
        self.sequences = sequences
        self.options = options  # pad_id, kind, answer_ids, tree_mask_dtype, device, scored_from
        self.prepared: list[dict[str, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        first, end, width = self.groups[index]
        o = self.options
        if self.prepared is not None:
            arrays = self.prepared[index]
        else:
            arrays = _to_tensors(self.arrays(index), o["device"])
        return _batch(arrays, end - first, width, o["kind"], o["tree_mask_dtype"])

    def __iter__(self):
        for index in range(len(self)):
            yield self[index]  # not bound to a name here: the previous batch is freed before the next is built

    def arrays(self, index: int) -> dict[str, np.ndarray]:
        """The compact arrays of batch ``index``, computed from the rows."""
        first, end, width = self.groups[index]
        o = self.options
        return batch_arrays(
            self.sequences, self.rows, first, end, width, o["pad_id"], o["answer_ids"], o["kind"] == "tree", o["scored_from"]
        )

    def prepare(self) -> None:
        """Compute every batch's arrays now and keep them on the device: the plan every evaluation reuses."""
        self.prepared = [_to_tensors(self.arrays(i), self.options["device"]) for i in range(len(self))]

    @property
    def plan_bytes(self) -> int:
        """Bytes the prepared plan holds (0 when the batches are built when read)."""
        return sum(t.numel() * t.element_size() for arrays in self.prepared or [] for t in arrays.values())

    @property
    def positions(self) -> list[int]:
        """Positions (rows x width) of each batch, without building it."""
        return [(end - first) * width for first, end, width in self.groups]


@dataclass
class Layout:
    """All batches of one evaluation, plus what it costs in padding and saves by sharing."""

    kind: str  # "tree", "packed" or "padded"
    batches: Batches
    padded_positions: int
    total_positions: int
    sentence_positions: int  # positions the sequences would take one by one (their inputs)
    scored_tokens: int = 0  # (context, target) pairs read: one per scored token, or per answer of a prompt

    @property
    def padding_share(self) -> float:
        return self.padded_positions / max(self.total_positions, 1)

    @property
    def saved_by_prefix_sharing(self) -> float:
        """Share of the sentences' positions that prefix sharing saved (0 unless ``kind == "tree"``)."""
        used = self.total_positions - self.padded_positions
        return 1 - used / max(self.sentence_positions, 1)

    @property
    def plan_bytes(self) -> int:
        """Bytes the prepared plan holds on the device (0 when the batches are built when read)."""
        return self.batches.plan_bytes


LAYOUTS = ("tree", "packed", "padded")
TREE_WIDTH_STEP = 64  # tree rows are as wide as their positions rounded up to this (at most the row length)
# Bytes a prepared plan holds: per position its token id (4), position id and subtree size (2 each
# when a row is under 32K positions); per read position its index (4); per scored token its context,
# target and sequence (4 each) and slot (2). The estimate, with 4-byte positions and sizes, is an upper bound.
PLAN_BYTES_PER_POSITION = 12
PLAN_BYTES_PER_SCORED = 18


def pack_rows(lengths: list[int], row_length: int) -> list[list[int]]:
    """First-fit decreasing: indices into ``lengths`` per row, each row's lengths summing to <= row_length."""
    return packed_order(np.asarray(lengths, dtype=np.int64), row_length).rows()


def tree_rows(sequences: Sequence[list[int]], row_length: int) -> list[list[int]]:
    """Indices into ``sequences`` per row, in sorted order, each row's prefix tree at most ``row_length`` nodes."""
    sequences = TokenSequences.of(sequences)
    lengths = sequences.lengths()
    return tree_order(padded_matrix(sequences.ids, sequences.offsets[:-1], lengths), lengths, row_length).rows()


def build_layout(
    sequences: Sequence[list[int]],
    kind: str,
    row_length: int,
    tokens_per_batch: int,
    *,
    pad_id: int,
    device: torch.device | str = "cpu",
    chosen: Sequence[int] | None = None,
    answer_ids: tuple[int, ...] = (),
    tree_mask_dtype: torch.dtype = torch.bool,
    plan_budget: int = 0,
    scored_from: np.ndarray | None = None,
) -> Layout:
    """Rows of the given kind, grouped into batches of at most ``tokens_per_batch`` positions.

    Without ``answer_ids`` a sequence's inputs are all its tokens but the last and its targets all
    but the first. With ``answer_ids`` all its tokens are inputs and its last position is read for
    each answer token (one position read per sequence). ``chosen`` limits the layout to those
    sequence indices (all by default). ``tree_mask_dtype``: the tree layout's mask is boolean (True:
    attend), or additive in this floating dtype (0 or its most negative value), as the model's
    attention wants it. ``plan_budget``: bytes the prepared batches may hold on ``device``; a plan
    estimated within it is computed now and kept (``Layout.plan_bytes``), otherwise each batch is
    built when it is read. ``scored_from``: per sequence (an index as ``chosen``'s), the first input read
    for the token after it (lm-evaluation-harness requests: the continuation's first), and the slot of that token's
    cell is counted from it (``cells``); without it, every input.
    """
    sequences = TokenSequences.of(sequences)
    known = sequences.shared_prefixes if chosen is None and not answer_ids else None
    sequence_groups = sequences.groups if chosen is None else None
    chosen = np.arange(len(sequences)) if chosen is None else np.asarray(list(chosen), dtype=np.int64)
    inputs = sequences.lengths()[chosen] - (0 if answer_ids else 1)
    row_length = max(row_length, int(inputs.max(initial=0)))
    if kind == "tree":
        known = None if known is None else shared_prefix_order(sequences.ids, sequences.offsets[:-1], inputs, *known)
        if known is not None:
            order, common, groups = known
            rows = trees_in_rows(order, common, inputs, row_length, groups)
        else:
            rows = tree_order(
                padded_matrix(sequences.ids, sequences.offsets[chosen], inputs), inputs, row_length, sequence_groups
            )
    elif kind == "packed":
        rows = packed_order(inputs, row_length)
    elif kind == "padded":
        rows = padded_order(inputs)
    else:
        raise ValueError(f"unknown layout {kind!r}; expected one of {LAYOUTS}")
    rows.order = chosen[rows.order]
    nodes = rows.row_nodes()
    if kind == "tree":
        # A tree row's width is its own, rounded up to a step, the widest rows first: a row's numbers do not depend on
        # its batch (nor on the budget), and a question's tree wider than the rest does not widen every row.
        widths = np.minimum(-(-nodes // TREE_WIDTH_STEP) * TREE_WIDTH_STEP, row_length)
        by_width = np.argsort(-widths, kind="stable")
        rows, nodes, widths = rows.in_order(by_width), nodes[by_width], widths[by_width]
    else:
        widths = nodes if kind == "padded" else np.full(rows.num_rows, row_length)

    groups, total = [], 0
    start = 0
    while start < rows.num_rows:  # a loop over batches
        # Rows are sorted widest first (or all as wide), so the first row of a batch sets its width; a batch ends where
        # the budget does, or where rows get narrower: a quarter narrower when padded, at all for trees (their own widths).
        width = int(widths[start])
        limit = min(rows.num_rows, start + max(1, tokens_per_batch // max(width, 1)))
        narrower = np.flatnonzero(
            (widths[start + 1 : limit] < width) if kind == "tree" else (4 * widths[start + 1 : limit] < 3 * width)
        )
        end = start + 1 + (int(narrower[0]) if len(narrower) else limit - start - 1)
        groups.append((start, end, width))
        total += (end - start) * width
        start = end
    options = dict(
        pad_id=pad_id, kind=kind, answer_ids=answer_ids, tree_mask_dtype=tree_mask_dtype, device=device, scored_from=scored_from
    )
    if answer_ids:
        scored = len(chosen) * len(answer_ids)
    else:
        scored = int(inputs.sum() - (0 if scored_from is None else np.minimum(scored_from[chosen], inputs).sum()))
    layout = Layout(
        kind=kind,
        batches=Batches(rows, groups, sequences, options),
        padded_positions=total - int(nodes.sum()),
        total_positions=total,
        sentence_positions=int(inputs.sum()),
        scored_tokens=scored,
    )
    if total * PLAN_BYTES_PER_POSITION + scored * PLAN_BYTES_PER_SCORED <= plan_budget:
        layout.batches.prepare()
    return layout


def batch_arrays(
    sequences: TokenSequences,
    rows: RowOrder,
    first: int,
    end: int,
    width: int,
    pad_id: int,
    answer_ids: tuple,
    tree: bool,
    scored_from: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The compact arrays of the batch of rows ``first`` to ``end`` (exclusive), each ``width`` positions, with numpy.

    The sequences of these rows, in order, add their inputs after the ones they share with the previous
    sequence (``rows.common``) as new nodes, numbered one after another (``tree_nodes``). The positions read
    are the contexts of the scored tokens (every node, unless ``scored_from`` leaves some out).
    """
    lo, hi = rows.row_starts[first], rows.row_starts[end]
    seqs = rows.order[lo:hi]
    n, c = rows.inputs[lo:hi], rows.common[lo:hi]
    m = len(seqs)
    row_of = np.repeat(np.arange(end - first), np.diff(rows.row_starts[first : end + 1]))
    first_token = sequences.offsets[seqs]  # where each sequence's tokens start in ``sequences.ids``
    base, node_seq, node_depth = new_nodes(n, c)
    row_base = base[rows.row_starts[first:end] - lo]  # each row's first node
    node_row = row_of[node_seq]
    flat = node_row * width + np.arange(len(node_seq)) - row_base[node_row]
    used = np.bincount(node_row, minlength=end - first)
    input_ids = np.full((end - first) * width, pad_id, dtype=np.int32)
    input_ids[flat] = sequences.ids[first_token[node_seq] + node_depth]
    small = np.int16 if width < 2**15 else np.int32
    # Padding after a row's last node: a position run of its own (a block of its own when packed).
    position_ids = (np.arange(width)[None, :] - used[:, None]).astype(small).ravel()
    position_ids[flat] = node_depth
    arrays = {"input_ids": input_ids, "position_ids": position_ids}
    if tree:
        sizes = np.ones((end - first) * width, dtype=small)  # padding: a subtree of its own column only
        sizes[flat] = subtree_ends(n, c, base) - np.arange(len(node_seq))
        arrays["sizes"] = sizes
    else:
        arrays["used"] = used.astype(np.int32)
    index = np.arange(m)
    if answer_ids:  # a prompt's last input is read, once per answer
        last, contexts = np.unique(nodes_at(index, n - 1, base, c), return_inverse=True)
        arrays["score_positions"] = flat[last].astype(np.int32)
        arrays["score_contexts"] = np.repeat(contexts.astype(np.int32), len(answer_ids))
        arrays["score_targets"] = np.tile(np.asarray(answer_ids, dtype=np.int32), m)
        arrays["score_sentences"] = np.repeat(seqs.astype(np.int32), len(answer_ids))
        arrays["score_slots"] = np.tile(np.arange(len(answer_ids), dtype=np.int16), m)
    else:  # each input from its sequence's first scored one on is read (its node is the context), for the token after it
        skipped = np.zeros(m, dtype=np.int64) if scored_from is None else np.minimum(scored_from[seqs], n)
        count = n - skipped
        scored_seq = np.repeat(index, count)
        scored_depth = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count - skipped, count)
        read = np.zeros(len(node_seq), dtype=bool)  # the nodes some scored token is read at, in node order
        contexts = nodes_at(scored_seq, scored_depth, base, c)
        read[contexts] = True
        arrays["score_positions"] = flat[read].astype(np.int32)
        arrays["score_contexts"] = (np.cumsum(read) - 1)[contexts].astype(np.int32)
        arrays["score_targets"] = sequences.ids[first_token[scored_seq] + scored_depth + 1]
        arrays["score_sentences"] = seqs[scored_seq].astype(np.int32)
        arrays["score_slots"] = (scored_depth - skipped[scored_seq]).astype(small)  # a span's from its first scored
    return arrays


def _to_tensors(arrays: dict[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array).to(device) for name, array in arrays.items()}


def _batch(arrays: dict[str, torch.Tensor], rows: int, width: int, kind: str, tree_mask_dtype: torch.dtype) -> Batch:
    """The model's inputs from a batch's compact tensors: ids widened to int64, the mask broadcast."""
    if kind == "tree":
        attention_mask = interval_mask(arrays["sizes"].view(rows, width), tree_mask_dtype)
    elif kind == "padded":
        columns = torch.arange(width, device=arrays["used"].device)
        attention_mask = (columns[None, :] < arrays["used"][:, None]).long()
    else:
        attention_mask = None
    return Batch(
        input_ids=arrays["input_ids"].view(rows, width).long(),
        position_ids=arrays["position_ids"].view(rows, width).long(),
        attention_mask=attention_mask,
        score_positions=arrays["score_positions"].long(),
        score_contexts=arrays["score_contexts"].long(),
        score_targets=arrays["score_targets"].long(),
        score_sentences=arrays["score_sentences"].long(),
        score_slots=arrays["score_slots"].long(),
    )
