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


def nodes_at(sequence: np.ndarray, depth: np.ndarray, base: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The node of input ``depth[k]`` of sequence ``sequence[k]`` (each ``depth[k]`` below that sequence's ``n``).

    An input the sequence adds is its own new node. A shared one (below its ``c``) is the new node of the last
    sequence before it that added that depth (``c <= depth``): every sequence in between shares the depth with the one
    before it. That sequence is found by binary lifting over running minima of ``c``: work per shared input and
    doubling, not per node (the first sequence of every row has ``c = 0``, so there is always one).
    """
    nodes = base[sequence] + depth - c[sequence]
    shared = np.flatnonzero(depth < c[sequence])
    if len(shared):
        owner = _last_adding(c, sequence[shared], depth[shared])
        nodes[shared] = base[owner] + depth[shared] - c[owner]
    return nodes


def _last_adding(c: np.ndarray, sequence: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """For each ``(sequence[k], depth[k])`` the last sequence at or before it with ``c <= depth[k]``."""
    minima = [c]  # minima[k][i]: the smallest c of sequences i - 2**k + 1 .. i (of 0 .. i near the start)
    while 1 << len(minima) <= len(c):
        step, below = 1 << (len(minima) - 1), minima[-1]
        minima.append(np.concatenate([below[:step], np.minimum(below[step:], below[:-step])]))
    at = sequence.copy()
    for k in range(len(minima) - 1, -1, -1):  # jump over 2**k sequences that all share more than the depth
        step = 1 << k
        jump = at >= step
        jump[jump] = minima[k][at[jump]] > depth[jump]
        at[jump] -= step
    return at


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
