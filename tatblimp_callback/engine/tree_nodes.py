"""The nodes of a batch's prefix trees, from the sequences' input counts and shared prefixes: work per node, not per depth.

The sequences of a batch, in layout order, each have ``n`` inputs, of which the first ``c`` are shared with the
sequence before it (0 at the start of a row). Each adds its other inputs as new nodes, numbered one after another
(for prefix trees the depth-first order of each row's tree): sequence ``i``'s new nodes are ``base[i]``,
``base[i] + 1``, ... at depths ``c[i]``, ``c[i] + 1``, ... up to ``n[i] - 1``. A [sequences x depth] grid answers
which node each input is and where each subtree ends with running maxima and minima down its columns; this module
answers both from the nodes themselves, so a batch of long multiple-choice contexts costs its positions, not its
sequences times its longest one.
"""

from __future__ import annotations

import numpy as np


def new_nodes(n: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(base, node_sequence, node_depth)``: each sequence's first new node, and each node's sequence and depth."""
    new = n - c
    base = np.cumsum(new) - new
    node_sequence = np.repeat(np.arange(len(n)), new)
    node_depth = np.arange(int(new.sum())) - np.repeat(base - c, new)
    return base, node_sequence, node_depth


def nodes_at(sequence: np.ndarray, depth: np.ndarray, base: np.ndarray, c: np.ndarray, node_depth: np.ndarray) -> np.ndarray:
    """The node of input ``depth[k]`` of sequence ``sequence[k]`` (each ``depth[k]`` below that sequence's ``n``).

    An input the sequence adds is its own new node. A shared one (below its ``c``) is the node the sequences before it
    reached that depth at, which in depth-first order is the last node at that depth before the sequence's first new
    node: a node's descendants follow it, so a later node at that depth closes its subtree. Those are found by one
    sort of the nodes by (depth, number) and one search.
    """
    nodes = base[sequence] + depth - c[sequence]
    shared = np.flatnonzero(depth < c[sequence])
    if len(shared):
        count = len(node_depth)
        # By depth, then by number; depths as 16-bit integers where they fit, which numpy sorts by radix (6x faster).
        small = node_depth.astype(np.uint16) if node_depth.max() < 1 << 16 else node_depth
        by_depth = np.argsort(small, kind="stable")
        keys = node_depth[by_depth].astype(np.int64) * count + by_depth
        wanted = depth[shared].astype(np.int64) * count + base[sequence[shared]] - 1
        nodes[shared] = by_depth[np.searchsorted(keys, wanted, side="right") - 1]
    return nodes


def subtree_ends(n: np.ndarray, c: np.ndarray, base: np.ndarray) -> np.ndarray:
    """For each node, in node order, the node after its subtree (the nodes of a subtree run from it to there).

    The subtree of sequence ``i``'s node at depth ``d`` ends at the first new node of the first later sequence that
    shares fewer than ``d + 1`` inputs (``c[j] <= d``), or at the end. For each sequence these are the sequences of the
    chain ``i + 1``, then each one's next with a smaller ``c``: the chain's first with ``c <= d`` ends the nodes at
    depth ``d``, so a sequence's nodes fall in one depth interval per link, found for all sequences at once, one link
    a step (a chain ends where ``c`` is at most the sequence's own, at the latest at the next row).
    """
    m = len(n)
    shares = np.append(c, 0)  # a sentinel after the last sequence: it shares nothing
    starts = np.append(base, base[-1] + n[-1] - c[-1] if m else 0)
    following = np.minimum(np.arange(1, m + 2), m)  # each one's next sequence that shares fewer inputs, once found
    pending = np.flatnonzero(shares[following[:m]] >= shares[:m])
    while len(pending):  # pointer jumping: every sequence skipped shares at least as many inputs
        following[pending] = following[following[pending]]
        pending = pending[(following[pending] < m) & (shares[following[pending]] >= shares[pending])]
    link = np.arange(1, m + 1)  # each sequence's current link in its chain
    top = n.copy()  # depths below this are still to be given an end
    sequences, lows, highs, ends = [], [], [], []
    active = np.arange(m)
    while len(active):
        j = link[active]
        low = np.maximum(shares[j], c[active])
        sequences.append(active)
        lows.append(low)
        highs.append(top[active])
        ends.append(starts[j])
        top[active] = low
        link[active] = following[j]
        active = active[shares[j] > c[active]]
    sequence, low, high, end = (np.concatenate(parts) for parts in (sequences, lows, highs, ends))
    in_node_order = np.lexsort((low, sequence))  # a sequence's nodes are its depths from c up
    return np.repeat(end[in_node_order], (high - low)[in_node_order])
