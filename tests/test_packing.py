"""Row layouts on hand-made sentences: what each position holds, sees and predicts."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tatblimp_callback.engine.packing import build_layout, tree_rows
from tatblimp_callback.tokenized.cache import SentenceCache

BOS = 1


def cache_of(sentences: list[list[int]]) -> SentenceCache:
    lengths = torch.tensor([len(s) for s in sentences])
    return SentenceCache(
        token_ids=torch.tensor([t for s in sentences for t in s]),
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        byte_lengths=lengths,
        phenomenon_index=torch.zeros(len(sentences) // 2, dtype=torch.long),
        subtype_index=torch.full((len(sentences) // 2,), -1),
        phenomena=["p"],
        subtypes=[],
        prefix_token_id=BOS,
        tokenizer_name="hand-made",
        fingerprint="x",
        benchmark_source="test",
        benchmark_md5="x",
        benchmark_release="test",
    )


# A minimal pair that differs in its third word, and a pair that differs from the first word on.
SENTENCES = [[BOS, 5, 6, 7, 8], [BOS, 5, 6, 9], [BOS, 3, 4], [BOS, 2, 4]]


def test_tree_rows_share_prefixes_and_predict_every_token_once():
    layout = build_layout(SENTENCES, "tree", row_length=8, tokens_per_batch=8, pad_id=BOS)
    (batch,) = layout.batches
    # Sorted by token ids: [1 2 4], [1 3 4], [1 5 6 9], [1 5 6 7 8]; inputs are all tokens but the last.
    # Tree: 1 -> 2, 1 -> 3, 1 -> 5 -> 6 -> 7: six distinct contexts, where the sentences need 11.
    assert batch.input_ids.tolist() == [[1, 2, 3, 5, 6, 7, BOS, BOS]]
    assert batch.position_ids[0, :6].tolist() == [0, 1, 1, 1, 2, 3]
    seen = batch.attention_mask[0, 0]
    assert seen.dtype == torch.bool
    assert [seen[q].nonzero().flatten().tolist() for q in range(8)] == [
        [0],
        [0, 1],
        [0, 2],
        [0, 3],
        [0, 3, 4],
        [0, 3, 4, 5],
        [6],
        [7],
    ]
    assert batch.score_positions.tolist() == [0, 1, 2, 3, 4, 5]
    predicted = sorted(
        zip(batch.score_sentences.tolist(), batch.score_positions[batch.score_contexts].tolist(), batch.score_targets.tolist())
    )
    assert predicted == [
        (0, 0, 5), (0, 3, 6), (0, 4, 7), (0, 5, 8),
        (1, 0, 5), (1, 3, 6), (1, 4, 9),
        (2, 0, 3), (2, 2, 4),
        (3, 0, 2), (3, 1, 4),
    ]  # fmt: skip
    assert (layout.total_positions, layout.padded_positions, layout.sentence_positions) == (8, 2, 11)
    assert layout.saved_by_prefix_sharing == 1 - 6 / 11


def test_tree_mask_is_additive_for_eager_attention():
    layout = build_layout(SENTENCES, "tree", row_length=8, tokens_per_batch=8, pad_id=BOS, tree_mask_dtype=torch.bfloat16)
    mask = layout.batches[0].attention_mask[0, 0]
    assert mask.dtype == torch.bfloat16
    assert (
        mask[4].tolist()
        == [0, -torch.finfo(torch.bfloat16).max, -torch.finfo(torch.bfloat16).max, 0, 0] + [-torch.finfo(torch.bfloat16).max] * 3
    )


def test_a_new_row_starts_when_the_tree_would_outgrow_it():
    sequences = [[1, 5, 6, 7], [1, 5, 6, 9], [1, 3], [1, 2]]
    # Sorted: [1 2] (2 nodes), [1 3] (+1), [1 5 6 7] (+3: 6 > 5, new row of 4), [1 5 6 9] (+1).
    assert tree_rows(sequences, row_length=5) == [[3, 2], [0, 1]]
    assert tree_rows(sequences, row_length=7) == [[3, 2, 0, 1]]


def test_packed_and_padded_rows_read_one_position_per_token():
    for kind in ("packed", "padded"):
        layout = build_layout(SENTENCES, kind, row_length=8, tokens_per_batch=64, pad_id=BOS)
        contexts = torch.cat([b.score_contexts for b in layout.batches])
        targets = torch.cat([b.score_targets for b in layout.batches])
        assert sorted(targets.tolist()) == sorted(t for s in SENTENCES for t in s[1:])
        assert all(torch.equal(b.score_contexts, torch.arange(b.score_positions.numel())) for b in layout.batches)
        assert contexts.numel() == layout.sentence_positions == 11 and layout.saved_by_prefix_sharing == 0


def test_identical_sentences_tie_exactly_and_shared_prefixes_are_computed_once():
    from conftest import reference_logprobs, tiny_llama
    from tatblimp_callback import Scorer
    from tatblimp_callback.results.metrics import compute_results

    # Pair 0: the same sentence twice (a tie, which fails); pair 1: a sentence and its own prefix.
    sentences = [[BOS, 5, 6, 7, 8], [BOS, 5, 6, 7, 8], [BOS, 5, 6, 7], [BOS, 2, 4]]
    cache = cache_of(sentences)
    model = tiny_llama(16)
    scorer = Scorer(model, cache)
    scores = scorer.score()
    assert scorer.method.layout == "tree"
    assert scores[0].item() == scores[1].item()
    assert (scores - torch.tensor(reference_logprobs(model, sentences))).abs().max().item() < 1e-5
    results = compute_results(cache, scores)
    assert results.overall.ties == 1 and results.pairs[0].good_logprob == results.pairs[0].bad_logprob
    # Five distinct contexts (1; 1 2; 1 5; 1 5 6; 1 5 6 7) serve the 13 scored tokens.
    (batch,) = scorer.layout().batches
    assert (batch.score_positions.numel(), batch.score_targets.numel()) == (5, 13)


def test_answer_readout_reads_each_answer_after_the_last_position():
    # Forced choice: every token of a prompt is an input; its last position is read once per answer token.
    answers = (11, 12)
    layout = build_layout(SENTENCES, "tree", row_length=10, tokens_per_batch=10, pad_id=BOS, answer_ids=answers)
    (batch,) = layout.batches
    # Sorted: [1 2 4], [1 3 4], [1 5 6 7 8], [1 5 6 9]: ten distinct prefixes, the whole tree is computed.
    assert batch.input_ids.tolist() == [[1, 2, 4, 3, 4, 5, 6, 7, 8, 9]]
    assert layout.sentence_positions == 15 and layout.padded_positions == 0
    read = batch.score_positions[batch.score_contexts].tolist()
    cells = list(zip(batch.score_sentences.tolist(), batch.score_slots.tolist(), read, batch.score_targets.tolist()))
    assert sorted(cells) == [
        (0, 0, 8, 11), (0, 1, 8, 12), (1, 0, 9, 11), (1, 1, 9, 12),
        (2, 0, 4, 11), (2, 1, 4, 12), (3, 0, 2, 11), (3, 1, 2, 12),
    ]  # fmt: skip
    assert batch.score_positions.numel() == 4  # one position read per prompt


def test_every_scored_token_has_its_own_cell():
    # Sentence readout: slot k holds the log-prob of token k + 1, so a sentence's cells are its tokens in order.
    for kind in ("tree", "packed", "padded"):
        layout = build_layout(SENTENCES, kind, row_length=8, tokens_per_batch=64, pad_id=BOS)
        cells = [
            (s, slot, target)
            for b in layout.batches
            for s, slot, target in zip(b.score_sentences.tolist(), b.score_slots.tolist(), b.score_targets.tolist())
        ]
        assert sorted(cells) == sorted((s, k, ids[k + 1]) for s, ids in enumerate(SENTENCES) for k in range(len(ids) - 1))


def _random_sequences(seed: int, stem_tokens: tuple[int, int] = (0, 12), count: int = 60) -> list[list[int]]:
    """Sequences over a small vocabulary: long shared prefixes, prefixes of each other, repeats."""
    rng = random.Random(seed)
    stems = [[BOS] + [rng.randrange(2, 5) for _ in range(rng.randrange(*stem_tokens))] for _ in range(6)]
    sequences = [rng.choice(stems) + [rng.randrange(2, 9) for _ in range(rng.randrange(1, 6))] for _ in range(count)]
    return sequences + sequences[:7] + [[*stem, 2] for stem in stems]


def _scored_from(sequences: list[list[int]], seed: int, continuations_only: bool) -> np.ndarray | None:
    rng = random.Random(seed)
    return np.array([rng.randrange(0, len(ids) - 1) for ids in sequences]) if continuations_only else None


def _assert_each_scored_token_sees_its_own_sequence(layout, sequences, scored_from) -> None:
    """Each (context, target) the batches score: the positions its context sees (the tree mask) hold exactly its
    sequence's inputs so far, at position ids 0, 1, ...; every token from the first scored one is scored once, none
    before it, its slot counted from there (a span's cells are its scored tokens'); every position read is some scored
    token's context."""
    scored = []
    first = [0] * len(sequences) if scored_from is None else scored_from
    for batch in layout.batches:
        ids, positions = batch.input_ids.flatten(), batch.position_ids.flatten()
        seen = batch.attention_mask[:, 0].flatten(0, 1)  # [rows x width (queries), width (keys)]
        width = batch.input_ids.shape[1]
        assert sorted(set(batch.score_contexts.tolist())) == list(range(len(batch.score_positions)))
        for s, slot, target, context in zip(
            batch.score_sentences.tolist(), batch.score_slots.tolist(), batch.score_targets.tolist(), batch.score_contexts
        ):
            query = int(batch.score_positions[context])
            keys = (query // width) * width + seen[query].nonzero().flatten()
            depth = first[s] + slot
            assert ids[keys].tolist() == sequences[s][: depth + 1] and positions[keys].tolist() == list(range(depth + 1))
            assert target == sequences[s][depth + 1]
            scored.append((s, depth))
    assert sorted(scored) == [(s, k) for s, ids in enumerate(sequences) for k in range(first[s], len(ids) - 1)]
    assert layout.scored_tokens == len(scored)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("continuations_only", [False, True])
def test_random_trees_show_each_scored_token_its_own_sequence_and_read_only_its_contexts(seed, continuations_only):
    sequences = _random_sequences(seed)
    scored_from = _scored_from(sequences, seed, continuations_only)
    layout = build_layout(sequences, "tree", 20, 20 * 2, pad_id=BOS, scored_from=scored_from)
    assert len(layout.batches) > 3 and layout.batches.rows.num_rows > 8
    _assert_each_scored_token_sees_its_own_sequence(layout, sequences, scored_from)


@pytest.mark.parametrize("continuations_only", [False, True])
def test_deep_random_trees_show_each_scored_token_its_own_sequence(continuations_only):
    # Shared prefixes deeper than 256 inputs (a depth's 8-bit or 16-bit wrap-around would show).
    sequences = _random_sequences(0, stem_tokens=(260, 300), count=12)
    scored_from = _scored_from(sequences, 0, continuations_only)
    layout = build_layout(sequences, "tree", 700, 700, pad_id=BOS, scored_from=scored_from)
    assert len(layout.batches) > 1 and layout.batches.rows.common.max() > 256
    _assert_each_scored_token_sees_its_own_sequence(layout, sequences, scored_from)


def test_tree_rows_are_as_wide_as_their_trees_rounded_up_widest_first():
    # Stems of 30 to 200 tokens in rows of 256: the rows' trees differ in size, the last ones small.
    sequences = _random_sequences(0, stem_tokens=(30, 200), count=30)
    layout = build_layout(sequences, "tree", 256, 256 * 3, pad_id=BOS)
    nodes = layout.batches.rows.row_nodes()
    widths = [width for first, end, width in layout.batches.groups for _ in range(end - first)]
    assert widths == [min(-(-n // 64) * 64, 256) for n in nodes.tolist()]  # each row's own, 64 a step
    assert widths == sorted(widths, reverse=True) and len(set(widths)) >= 3
    assert layout.total_positions == sum(widths) < 256 * len(widths)
    _assert_each_scored_token_sees_its_own_sequence(layout, sequences, None)


def test_a_sequences_log_prob_does_not_depend_on_how_its_rows_are_batched():
    from conftest import tiny_llama
    from tatblimp_callback.engine.scoring import Scorer

    sequences = _random_sequences(0, stem_tokens=(30, 200), count=30)
    model = tiny_llama(16, seed=2)
    scorers = [Scorer(model, cache_of(sequences), method="tree", memory_budget=budget) for budget in (1 << 18, 64 << 20)]
    groups = [scorer.layout().batches.groups for scorer in scorers]
    assert len(groups[0]) > len(groups[1])  # the smaller budget: more, smaller batches
    assert torch.equal(scorers[0].score(), scorers[1].score())
