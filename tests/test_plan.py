"""The plan: row layouts made once with numpy, kept compactly, reused by every evaluation until the budget changes."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_llama
from tatblimp_callback import Evaluator, Scorer, ScoringMethod
from tatblimp_callback.engine import packing
from tatblimp_callback.engine.packing import build_layout, pack_rows
from tatblimp_callback.engine.tree_mask import flex_mask_mod, interval_mask

BOS = 1


def random_sentences(rng: random.Random, count: int, vocab: int) -> list[list[int]]:
    """Sentences that often start alike (a prefix of an earlier one, then their own tokens), some equal."""
    sentences: list[list[int]] = []
    for _ in range(count):
        if sentences and rng.random() < 0.5:
            base = rng.choice(sentences)
            start = base[: rng.randint(1, len(base))]
        else:
            start = [BOS]
        sentences.append(start + [rng.randrange(2, vocab) for _ in range(rng.randint(0 if len(start) > 1 else 1, 8))])
    return sentences


def trie_reference(rows: list[list[int]], sentences: list[list[int]], width: int, inputs_of) -> tuple[list, torch.Tensor, list]:
    """Each row's tokens, its dense ancestor mask and its number of nodes, from a trie of dicts walked sentence
    by sentence: a column sees itself and every column on its path from the root (the definition, built plainly)."""
    tokens, masks, nodes = [], torch.zeros(len(rows), width, width, dtype=torch.bool), []
    for r, row in enumerate(rows):
        columns: dict[tuple[int, int], int] = {}
        parent_of: dict[int, int] = {}
        row_tokens = []
        for s in row:
            parent = -1
            for token in sentences[s][: inputs_of(sentences[s])]:
                node = (parent, token)
                if node not in columns:
                    columns[node] = len(columns)
                    parent_of[columns[node]] = parent
                    row_tokens.append(token)
                parent = columns[node]
        for column in range(width):
            masks[r, column, column] = True
            ancestor = parent_of.get(column, -1)
            while ancestor >= 0:
                masks[r, column, ancestor] = True
                ancestor = parent_of[ancestor]
        tokens.append(row_tokens + [BOS] * (width - len(row_tokens)))
        nodes.append(len(row_tokens))
    return tokens, masks, nodes


@pytest.mark.parametrize("answers", [(), (3, 4)])
def test_the_interval_mask_equals_the_dense_ancestor_mask_on_random_tries(answers):
    rng = random.Random(7)
    for trial in range(40):
        sentences = random_sentences(rng, rng.randint(2, 30), rng.choice([3, 6, 40]))
        row_length = rng.choice([10, 16, 24])
        layout = build_layout(sentences, "tree", row_length, rng.choice([16, 64, 4096]), pad_id=BOS, answer_ids=answers)
        rows = layout.batches.rows.rows()
        seen = 0
        for batch in layout.batches:
            width = batch.input_ids.shape[1]
            count = batch.input_ids.shape[0]
            inputs_of = lambda s: len(s) - (0 if answers else 1)  # noqa: E731
            tokens, masks, nodes = trie_reference(rows[seen : seen + count], sentences, width, inputs_of)
            seen += count
            assert batch.input_ids.tolist() == tokens, trial
            assert torch.equal(batch.attention_mask[:, 0], masks), trial
            # A node's position id is its depth, its number of ancestors.
            for r in range(count):
                assert batch.position_ids[r, : nodes[r]].tolist() == (masks[r, : nodes[r]].sum(-1) - 1).tolist(), trial
        assert seen == len(rows)


def test_the_flex_mask_mod_and_the_additive_mask_are_the_same_test():
    rng = random.Random(3)
    layout = build_layout(random_sentences(rng, 40, 6), "tree", 24, 4096, pad_id=BOS, plan_budget=2**20)
    batch = layout.batches[0]
    sizes = layout.batches.prepared[0]["sizes"].long().view(batch.input_ids.shape)
    dense = batch.attention_mask[:, 0]
    rows, width = sizes.shape
    mask_mod = flex_mask_mod(sizes)
    b, q, kv = torch.arange(rows)[:, None, None], torch.arange(width)[None, :, None], torch.arange(width)[None, None, :]
    assert torch.equal(mask_mod(b, 0, q, kv), dense)
    additive = interval_mask(sizes, torch.float32)[:, 0]
    assert torch.equal(additive == 0, dense) and additive.min() == torch.finfo(torch.float32).min


def test_first_fit_decreasing_row_by_row_equals_sentence_by_sentence():
    def first_fit_decreasing(lengths, row_length):  # the textbook loop
        rows, free = [], []
        for s in sorted(range(len(lengths)), key=lambda s: (-lengths[s], s)):
            row = next((r for r, room in enumerate(free) if room >= lengths[s]), None)
            if row is None:
                rows.append([])
                free.append(row_length)
                row = len(rows) - 1
            rows[row].append(s)
            free[row] -= lengths[s]
        return rows

    rng = random.Random(5)
    for _ in range(200):
        lengths = [rng.randint(1, 30) for _ in range(rng.randint(1, 60))]
        row_length = rng.choice([30, 47, 64])
        assert pack_rows(lengths, row_length) == first_fit_decreasing(lengths, row_length)


@pytest.fixture
def sentences_cache():
    from test_packing import cache_of

    rng = random.Random(11)
    return cache_of(random_sentences(rng, 60, 16))


def test_the_plan_is_made_once_and_reused_by_every_evaluation(sentences_cache, monkeypatch):
    model = tiny_llama(16)
    built = []
    original = packing.batch_arrays
    monkeypatch.setattr(packing, "batch_arrays", lambda *args: built.append(1) or original(*args))
    scorer = Scorer(model, sentences_cache, method=ScoringMethod("tree", "tiled"), memory_budget=2**16, row_length=24)
    first = scorer.score()
    layout = scorer.layout()
    assert len(layout.batches) >= 3 and len(built) == len(layout.batches) and scorer.layouts_built == 1
    assert scorer.setup_seconds["plan"] > 0
    # What the plan holds: int32 ids, int16 positions and subtree sizes a position; int32 indices a scored token.
    positions, scored = layout.total_positions, layout.scored_tokens
    assert layout.plan_bytes == 8 * positions + 4 * (positions - layout.padded_positions) + 14 * scored
    built.clear()
    second = scorer.score()
    assert built == [] and scorer.layouts_built == 1 and scorer.setup_seconds["plan"] == 0.0
    assert torch.equal(first, second)
    # Built per forward call when the plan does not fit its share of the budget: the same numbers.
    monkeypatch.setattr("tatblimp_callback.engine.scoring.PLAN_SHARE", 2**40)
    unplanned = Scorer(model, sentences_cache, method=ScoringMethod("tree", "tiled"), memory_budget=2**16, row_length=24)
    assert torch.equal(unplanned.score(), first) and unplanned.layout().plan_bytes == 0
    built.clear()
    unplanned.score()
    assert len(built) == len(unplanned.layout().batches)


def test_a_new_budget_makes_a_new_plan(sentences_cache, monkeypatch):
    model = tiny_llama(16)
    scorer = Scorer(model, sentences_cache, method=ScoringMethod("tree", "tiled"), memory_budget=2**25, row_length=24)
    expected = scorer.score()
    plan = scorer.layout()
    failed = []
    original = Scorer._batch_logprobs

    def out_of_memory_once(self, batch, head, spans=None):
        if not failed:
            failed.append(1)
            raise torch.OutOfMemoryError("simulated")
        return original(self, batch, head, spans)

    monkeypatch.setattr(Scorer, "_batch_logprobs", out_of_memory_once)
    assert torch.equal(scorer.score(), expected)
    assert scorer.oom_retries == 1 and scorer.memory_budget == 2**24
    assert (
        scorer.layouts_built == 2
        and scorer.layout() is not plan
        and list(scorer._layouts) == [("tree", scorer.row_length, scorer.tokens_per_batch)]
    )


def test_a_model_moved_to_another_dtype_gets_a_new_plan(bpe_tokenizer, small_data):
    model = tiny_llama(len(bpe_tokenizer))
    evaluator = Evaluator(bpe_tokenizer, small_data, allow_modified=True)
    evaluator(model)
    first = evaluator._scorer
    built = first.layouts_built
    evaluator(model)
    assert evaluator._scorer is first and first.layouts_built == built
    model.to(torch.float64)
    evaluator(model)
    assert evaluator._scorer is not first and evaluator._scorer.layout().batches is not first.layout().batches
    assert evaluator._scorer.layout().batches.prepared[0]["input_ids"].dtype == torch.int32


def test_the_plan_is_compact_and_on_the_cache_device(sentences_cache):
    layout = build_layout(
        [sentences_cache.sentence(s) for s in range(sentences_cache.num_sentences)], "tree", 24, 64, pad_id=BOS, plan_budget=2**20
    )
    dtypes = {name: t.dtype for name, t in layout.batches.prepared[0].items()}
    assert dtypes == {
        "input_ids": torch.int32,
        "position_ids": torch.int16,
        "sizes": torch.int16,
        "score_positions": torch.int32,
        "score_contexts": torch.int32,
        "score_targets": torch.int32,
        "score_sentences": torch.int32,
        "score_slots": torch.int16,
    }
    per_position = layout.plan_bytes / layout.total_positions
    assert (
        per_position
        <= packing.PLAN_BYTES_PER_POSITION + packing.PLAN_BYTES_PER_SCORED * layout.scored_tokens / layout.total_positions
    )


def test_the_heads_in_place_log_sum_exp_equals_torchs_also_where_logits_are_not_finite():
    from tatblimp_callback.engine.tiled_head import _fresh_log_sum_exp

    logits = torch.randn(6, 50) * 30
    logits[1, 7] = float("inf")  # a logit of inf: inf
    logits[2] = float("-inf")  # a row of -inf: -inf
    logits[3, 0] = float("nan")
    expected = torch.logsumexp(logits, -1)
    got = _fresh_log_sum_exp(logits.clone())
    assert torch.equal(torch.isnan(got), torch.isnan(expected)) and got[1] == float("inf") and got[2] == float("-inf")
    finite = torch.isfinite(expected)
    assert torch.allclose(got[finite], expected[finite], rtol=1e-6, atol=0)


def _count_head_paths(monkeypatch) -> dict[str, int]:
    """Calls of the head's one-tile path and of its tiled log-sum-exp (one per row tile), counted from now on."""
    from tatblimp_callback.engine import tiled_head

    counts = {"one_tile": 0, "tiled": 0}
    for name, key in (("_one_tile_logprobs", "one_tile"), ("_log_sum_exp", "tiled")):
        original = getattr(tiled_head, name)
        monkeypatch.setattr(tiled_head, name, lambda *a, _f=original, _k=key: counts.__setitem__(_k, counts[_k] + 1) or _f(*a))
    return counts


@pytest.mark.parametrize("answers", [(), (3, 4)])
def test_one_tile_of_the_head_gives_the_tiled_heads_log_probs_and_the_models_own(sentences_cache, answers, monkeypatch):
    from dataclasses import replace

    from tatblimp_callback.engine.forward import model_output, read_logprobs
    from tatblimp_callback.engine.scoring_method import agree, relative_tolerance

    model = tiny_llama(16)
    cache = replace(sentences_cache, answer_ids=answers)  # the same sequences as forced-choice prompts
    scorer = Scorer(model, cache, method=ScoringMethod("tree", "tiled"), row_length=24)
    counts = _count_head_paths(monkeypatch)
    rtol = relative_tolerance(torch.float32, torch.device("cpu"))
    for batch in scorer.layout().batches:
        hidden = model_output(model, model, batch, "tiled")
        one_tile = read_logprobs(model, hidden, batch, "tiled", (hidden.shape[0], 16), None)
        assert counts == {"one_tile": 1, "tiled": 0}
        tiled = read_logprobs(model, hidden, batch, "tiled", (3, 5), None)  # row tiles of 3, columns of 5: 4 parts
        assert counts == {"one_tile": 1, "tiled": -(-hidden.shape[0] // 3)}
        own = read_logprobs(model, model_output(model, model, batch, "full_logits"), batch, "full_logits", None, None)
        ones = torch.ones_like(own)
        assert agree(one_tile, tiled, ones, rtol) and agree(one_tile, own, ones, rtol) and agree(tiled, own, ones, rtol)
        assert one_tile.shape == (batch.score_targets.numel(),) and one_tile.max() < -0.01  # log-probs, not zeros
        counts.update(one_tile=0, tiled=0)


@pytest.mark.parametrize("dtype, autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_every_tile_of_the_head_is_written_into_the_same_memory_with_the_heads_own_values(dtype, autocast):
    """The tiles of one readout share one buffer (a fresh tile each time lands at addresses the system must zero and
    the cache has never held), and each holds ``F.linear``'s logits of its columns widened to float32, softcapped, the
    narrower last tile included, under bf16 autocast too (as scoring float32 weights in bf16 runs); with the model's
    own logits given, their copy."""
    import contextlib

    import torch.nn.functional as F

    from tatblimp_callback.engine.tiled_head import vocabulary_tiles

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 16, generator=generator).to(dtype)
    weight, bias = torch.randn(50, 16, generator=generator).to(dtype), torch.randn(50, generator=generator).to(dtype)
    own = F.linear(hidden, weight)  # the model's own logits, for the copy
    for bias_or_none, cap, own_logits in [(None, None, False), (bias, 30.0, False), (None, None, True)]:
        places, firsts = set(), []
        given = (own, None) if own_logits else (hidden, weight)
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            for first, logits in vocabulary_tiles(*given, bias_or_none, cap, 16):
                part = slice(first, first + 16)
                if own_logits:
                    expected = own[:, part].float()
                else:  # the matmul of this tile's columns, as the head computes it
                    expected = F.linear(hidden, weight[part], None if bias_or_none is None else bias_or_none[part])
                    assert expected.dtype == (torch.bfloat16 if autocast else dtype)
                    expected = expected.float()
                expected = (expected / cap).tanh() * cap if cap else expected
                assert logits.dtype == torch.float32 and torch.equal(logits, expected)
                places.add(logits.data_ptr())
                firsts.append(first)
                logits.fill_(float("nan"))  # the caller may change a tile in place: the next is written anew
        assert firsts == [0, 16, 32, 48] and len(places) == 1


def test_under_bf16_autocast_the_tiled_heads_target_logits_are_rounded_as_its_tiles():
    """Float32 weights scored in bf16 run under autocast, where the head's matmul rounds its inputs and its output to
    bf16: each target's logit is rounded alike, so the tiled head gives the one tile's log-probs (it was 0.03 nats
    off, the target's logit in float32 against a bf16 normaliser)."""
    from tatblimp_callback.engine.tiled_head import head_logprobs

    model = tiny_llama(3000, hidden=32)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 32, generator=generator)
    contexts, targets = torch.arange(40).repeat(2), torch.randint(0, 3000, (80,), generator=generator)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        one_tile = head_logprobs(model, hidden, contexts, targets, (40, 3000))
        tiled = head_logprobs(model, hidden, contexts, targets, (16, 512))
    assert one_tile.dtype == tiled.dtype == torch.float32
    assert (tiled - one_tile).abs().max() < 1e-4 and one_tile.max() < -0.01


def test_one_tile_of_the_head_is_non_finite_where_the_tiled_head_is():
    from tatblimp_callback.engine.tiled_head import head_logprobs

    model = tiny_llama(16, hidden=8)
    hidden = torch.randn(5, 8)
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight[:, :4] = 0
        weight[7, 0] = 1e30  # row 1: a logit of inf at token 7
        weight[:, 1] = 1e30  # row 2: every logit -inf
        weight[3, 3] = 1e30  # row 4: a logit of -inf at token 3, the others finite
    hidden[:, :4] = 0
    hidden[1, 0], hidden[2, 1], hidden[3, 2], hidden[4, 3] = 1e30, -1e30, float("nan"), -1e30  # row 3: NaN
    contexts = torch.tensor([0, 0, 1, 1, 1, 2, 3, 4, 4])
    targets = torch.tensor([2, 7, 7, 2, 3, 5, 5, 3, 9])
    one_tile = head_logprobs(model, hidden, contexts, targets, (5, 16))
    tiled = head_logprobs(model, hidden, contexts, targets, (2, 6))
    nan, minus_inf = torch.isnan(one_tile), one_tile == float("-inf")
    assert nan.tolist() == [False, False, True, False, False, True, True, False, False]  # inf - inf, all -inf, NaN
    assert minus_inf.tolist() == [False, False, False, True, True, False, False, True, False]
    assert torch.equal(nan, torch.isnan(tiled)) and torch.equal(minus_inf, tiled == float("-inf"))
    finite = torch.isfinite(one_tile)
    assert torch.allclose(one_tile[finite], tiled[finite], rtol=2e-6, atol=0)


@pytest.mark.parametrize("answers", [(), (3, 4)])
def test_the_head_takes_one_tile_where_the_vocabulary_fits_and_tiles_where_not(sentences_cache, answers, monkeypatch):
    from dataclasses import replace

    from tatblimp_callback.engine.scoring_method import agree, relative_tolerance

    model = tiny_llama(16)
    cache = replace(sentences_cache, answer_ids=answers)
    method = ScoringMethod("tree", "tiled")
    counts = _count_head_paths(monkeypatch)
    roomy = Scorer(model, cache, method=method, row_length=24)
    fits = roomy.score()
    assert roomy.head_tile[1] == 16 and counts == {"one_tile": len(roomy.layout().batches), "tiled": 0}
    counts.update(one_tile=0, tiled=0)
    tight = Scorer(model, cache, method=method, row_length=24, memory_budget=4 * 16 * 8)  # a tile of 4 contexts
    tiles = tight.score()
    contexts = [b.score_positions.numel() for b in tight.layout().batches]
    # A forward call of at most 4 contexts (a row of few prompts) is still one tile.
    assert tight.head_tile == (4, 16) and max(contexts) > 4
    assert counts == {"one_tile": sum(k <= 4 for k in contexts), "tiled": sum(-(-k // 4) for k in contexts if k > 4)}
    ones = torch.ones_like(fits)
    assert agree(tiles, fits, ones, relative_tolerance(torch.float32, torch.device("cpu")))


def test_a_cpu_tile_of_a_narrow_vocabulary_holds_as_many_logits_as_a_wide_ones():
    from tatblimp_callback.engine.tiled_head import head_tile

    cpu, budget = torch.device("cpu"), 512 * 2**20
    assert head_tile(cpu, 48000, torch.float32, budget) == (2048, 2048)
    # A character-level vocabulary: thousands of contexts a forward call are still one tile of 16 MiB.
    assert head_tile(cpu, 100, torch.float32, budget) == (2048 * 2048 // 100, 100)
    assert head_tile(cpu, 100, torch.float32, 2**20) == (2**20 // (100 * 8), 100)  # and within the budget
