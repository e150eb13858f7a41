"""The harness model's host work without a Python step per request (issue #52, item 4): the requests read into
arrays in one pass, the prefix-tree order sorted as byte strings (the distinct contexts once), the tree mask compared
by numpy on the CPU. Each is checked against the per-request (or per-column) computation it replaces."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from conftest import tiny_llama
from tatblimp_callback.engine.packing import TokenSequences, build_layout
from tatblimp_callback.engine.rows import padded_matrix, prefix_order, shared_prefix_order, sorted_order, tree_order
from tatblimp_callback.engine.tree_mask import interval_mask
from tatblimp_callback.harness.fused import RequestScorer, request_sequences, request_tokens
from test_packing import _assert_each_scored_token_sees_its_own_sequence

# Token ids whose big-endian bytes end in or hold zero bytes, and the largest int32.
AWKWARD_IDS = [0, 1, 255, 256, 65_535, 65_536, 16_777_216, 2**31 - 1]


def random_requests(rng: random.Random, count: int) -> list[tuple[list[int], list[int]]]:
    """Requests whose contexts often repeat or start alike (a question's choices), some long, ids from AWKWARD_IDS too."""
    token = lambda: rng.choice(AWKWARD_IDS) if rng.random() < 0.3 else rng.randrange(50_000)  # noqa: E731
    requests = []
    for _ in range(count):
        if requests and rng.random() < 0.6:
            context = list(rng.choice(requests)[0][: rng.randint(1, 40)])
        else:
            context = [token() for _ in range(rng.randint(1, 40))]
        requests.append((context, [token() for _ in range(rng.randint(1, 12))]))
    return requests


@pytest.mark.parametrize("max_length", [8, 20, 2048])
def test_request_tokens_are_the_request_sequences_end_to_end(max_length):
    rng = random.Random(max_length)
    requests = [r for r in random_requests(rng, 300) if len(r[1]) <= max_length]
    sequences, continuation_lengths = request_sequences(requests, max_length)
    tokens, lengths, continuations, _shared = request_tokens(requests, max_length)
    assert any(len(c) + len(k) > max_length + 1 for c, k in requests) == (max_length < 2048)  # some cut from the left
    assert tokens.tolist() == [t for s in sequences for t in s]
    assert lengths.tolist() == [len(s) for s in sequences]
    assert continuations.tolist() == continuation_lengths


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (([], [3]), "harness request 2: empty context tokens"),
        (([3], []), "harness request 2: empty continuation tokens"),
        (([3], [4] * 9), "harness request 2: a continuation of 9 tokens, over max_length 8"),
    ],
)
def test_request_tokens_name_the_first_bad_request_as_request_sequences_does(bad, message):
    requests = [([1, 2], [3]), ([4], [5, 6]), bad, ([], [])]
    for read in (request_sequences, request_tokens):
        with pytest.raises(ValueError, match=message):
            read(requests, 8)


def test_sorted_order_is_lexsorts_order_of_the_padded_sequences():
    """Byte strings of big-endian ids sort as ``np.lexsort`` over the -1-padded columns: a sequence before the longer
    ones it starts, equal ones by index, ids with zero bytes (256, 65,536) in their numeric place."""
    rng = random.Random(3)
    for trial in range(30):
        sequences = [c + k for c, k in random_requests(rng, rng.randint(1, 200))]
        sequences += [list(s) for s in rng.sample(sequences, min(5, len(sequences)))]  # equal ones
        sequences += [s[: rng.randint(0, len(s))] for s in rng.sample(sequences, min(5, len(sequences)))]  # prefixes
        rng.shuffle(sequences)
        inputs = np.array([len(s) for s in sequences])
        matrix = np.full((len(sequences), inputs.max(initial=0)), -1, dtype=np.int32)
        for i, s in enumerate(sequences):
            matrix[i, : len(s)] = s
        expected = np.lexsort((np.arange(len(inputs)), *matrix.T[::-1]))
        assert sorted_order(matrix, inputs).tolist() == expected.tolist(), trial
        assert sorted(range(len(sequences)), key=sequences.__getitem__) == expected.tolist(), trial  # as lists sort
        if inputs.min() > 0:
            assert tree_order(matrix, inputs, int(inputs.max()) * 3).order.tolist() == expected.tolist(), trial


def question_requests(rng: random.Random, questions: int, nested: bool) -> list[tuple[list[int], list[int]]]:
    """Multiple-choice requests as the harness model hands them out: a question's choices hold one context list. Some
    questions ask again with an equal context in a list of its own, some contexts start alike (a few-shot prefix);
    with ``nested``, some contexts are also another's first tokens (a proper prefix)."""
    token = lambda: rng.choice(AWKWARD_IDS) if rng.random() < 0.3 else rng.randrange(50_000)  # noqa: E731
    shot = [token() for _ in range(rng.randint(1, 30))]
    contexts, requests = [], []
    for _ in range(questions):
        draw = rng.random()
        if contexts and draw < 0.15:
            context = list(rng.choice(contexts))  # equal tokens, another list
        elif contexts and nested and draw < 0.3:
            context = rng.choice(contexts)[: rng.randint(1, 8)]
        else:
            context = (shot if rng.random() < 0.5 else []) + [token() for _ in range(rng.randint(1, 30))]
        contexts.append(context)
        choices = [[token() for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 4))]
        choices += [list(choices[0])] if rng.random() < 0.2 else []  # the same choice twice
        choices += [[*choices[0][:1], token()]] if rng.random() < 0.3 else []  # choices that start alike
        requests += [(context, choice) for choice in choices]
    order = list(range(len(requests)))
    rng.shuffle(order)
    return [requests[k] for k in order]


def test_the_order_of_shared_contexts_is_the_sort_of_the_whole_sequences():
    """Sorting the distinct contexts once and then each request's continuation gives the order, and the tokens each
    shares with the one before, that sorting the whole sequences gives; where a context is another's proper prefix
    the harness model sorts the whole sequences. Its rows hold whole questions (a question is split only over rows of
    its own, where it does not fit one), and each scored token sees its own sequence."""
    rng = random.Random(5)
    used = {True: 0, False: 0}
    for trial in range(40):
        nested = trial % 2 == 1
        requests = question_requests(rng, rng.randint(1, 60), nested)
        tokens, lengths, _, shared = request_tokens(requests, 2048)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        inputs = lengths - 1
        expected = prefix_order(padded_matrix(tokens, offsets[:-1], inputs), inputs)
        known = shared_prefix_order(tokens, offsets[:-1], inputs, *shared)
        distinct = {tuple(context) for context, _ in requests}
        nested_contexts = any(a != b and b[: len(a)] == a for a in distinct for b in distinct)
        assert (known is None) == nested_contexts, trial
        used[known is not None] += 1
        if known is not None:
            assert known[0].tolist() == expected[0].tolist(), trial
            assert known[1].tolist() == expected[1].tolist(), trial
        sequences = [context + continuation for context, continuation in requests]
        for row_length in (int(inputs.max()), 3 * int(inputs.max())):
            hinted = build_layout(TokenSequences(tokens, offsets, shared), "tree", row_length, 4 * row_length, pad_id=0)
            _assert_each_scored_token_sees_its_own_sequence(hinted, sequences, None)
            if known is None:
                continue
            rows = hinted.batches.rows.rows()
            for row, after in itertools.pairwise(rows):  # a question split: the rows after its first hold it alone
                split = {tuple(requests[k][0]) for k in row} & {tuple(requests[k][0]) for k in after}
                assert not split or {tuple(requests[k][0]) for k in after} == split, (trial, row_length)
                assert not split or tuple(requests[row[0]][0]) in split, (trial, row_length)
    assert used[True] >= 15 and used[False] >= 5, used  # both ways, often


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.bfloat16])
def test_the_cpu_tree_mask_is_the_interval_test_element_by_element(dtype):
    """``interval_mask`` on the CPU (numpy's comparison) holds ``0 <= q - k < sizes[row, k]`` at every element, in
    the boolean and the additive form."""
    generator = torch.Generator().manual_seed(0)
    for width, size_dtype in [(7, torch.int16), (33, torch.int32), (64, torch.int64)]:
        sizes = torch.randint(1, width + 1, (5, width), generator=generator, dtype=size_dtype)
        q = torch.arange(width)[:, None]
        k = torch.arange(width)[None, :]
        expected = (q - k >= 0)[None] & (q - k < sizes[:, None, :].long())
        mask = interval_mask(sizes, dtype)
        assert mask.shape == (5, 1, width, width) and mask.dtype == dtype
        if dtype == torch.bool:
            assert torch.equal(mask[:, 0], expected)
        else:
            assert torch.equal(mask[:, 0] == 0, expected)
            assert (mask[:, 0][~expected] == torch.finfo(dtype).min).all()


def test_the_harness_model_scores_requests_anew_when_only_the_split_of_their_tokens_differs():
    """The latest call's scorer serves the same requests again, compared as arrays; the same tokens split otherwise
    between context and continuation are other requests: scored anew, as a fresh scorer scores them."""
    model = tiny_llama(50, seed=8)
    requests = [([1, 5, 7, 2], [9, 3]), ([1, 5, 7, 2], [4]), ([2, 8], [11, 12, 13])]
    resplit = [([1, 5, 7], [2, 9, 3]), ([1, 5, 7, 2], [4]), ([2, 8], [11, 12, 13])]
    scorer = RequestScorer(model, memory_budget=64 << 20)
    first = scorer.score(requests, 0, 64)
    kept = scorer._scorer
    assert scorer.score([(list(c), list(k)) for c, k in requests], 0, 64) == first and scorer._scorer is kept
    other = scorer.score(resplit, 0, 64)
    assert scorer._scorer is not kept
    assert other == RequestScorer(model, memory_budget=64 << 20).score(resplit, 0, 64)
    assert other[0] != first[0] and other[1:] == first[1:]
