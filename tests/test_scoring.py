"""The scorer equals the definition computed plainly, whatever the batching, layout or order."""

from __future__ import annotations

import pytest
import torch

from conftest import DATA, ignore_tree_masks, reference_logprobs, tiny_llama
from tatblimp_callback import Evaluator, Scorer, ScoringError, ScoringMethod, build_cache, evaluate, load_benchmark
from tatblimp_callback.reading.data import Benchmark


@pytest.fixture(scope="module")
def model(bpe_tokenizer):
    return tiny_llama(len(bpe_tokenizer))


@pytest.fixture(scope="module")
def cache(bpe_tokenizer):
    return build_cache(bpe_tokenizer, DATA)


@pytest.fixture(scope="module")
def reference(model, cache):
    return torch.tensor(reference_logprobs(model, [cache.sentence(s) for s in range(cache.num_sentences)]))


def test_full_benchmark_matches_one_at_a_time(model, cache, reference):
    scorer = Scorer(model, cache)
    scores = scorer.score()
    assert scores.shape == (2496,)
    assert str(scorer.method) == "tree rows, tiled head"
    assert (scores - reference).abs().max().item() < 1e-4
    # The prefix token is not scored; every other token is, once.
    batches = scorer.layout().batches
    assert sum(cache.lengths) - 2496 == sum(b.score_targets.numel() for b in batches)
    # Each distinct context (a sentence's first k tokens) is computed once, give or take those
    # that recur at the start of the next row (the prefix token, a shared first word).
    contexts = {tuple(cache.sentence(s)[:k]) for s in range(cache.num_sentences) for k in range(1, cache.lengths[s])}
    computed = sum(b.score_positions.numel() for b in batches)
    assert len(contexts) <= computed <= 1.03 * len(contexts) < 0.8 * (sum(cache.lengths) - 2496)


@pytest.mark.parametrize(
    "options",
    [
        dict(method=ScoringMethod("padded", "tiled")),
        dict(method=ScoringMethod("packed", "tiled")),
        dict(method=ScoringMethod("tree", "full_logits")),
        pytest.param(dict(method=ScoringMethod("packed", "full_logits")), marks=pytest.mark.slow),
        dict(method=ScoringMethod("padded", "full_logits")),
        dict(memory_budget=20 * 2**20, row_length=96),
        dict(memory_budget=200 * 2**20, row_length=1024),
    ],
    ids=["padded", "packed", "tree-logits", "packed-logits", "padded-logits", "small-batches", "large-batches"],
)
def test_every_method_and_batching_gives_the_same_decisions(model, cache, reference, options):
    scores = Scorer(model, cache, **options).score()
    assert (scores - reference).abs().max().item() < 1e-4
    assert (scores[0::2] > scores[1::2]).tolist() == (reference[0::2] > reference[1::2]).tolist()


@pytest.mark.slow
def test_sentence_order_does_not_change_scores(model, bpe_tokenizer, reference):
    benchmark = load_benchmark(DATA)
    reversed_pairs = Benchmark(pairs=benchmark.pairs[::-1], source="reversed", md5="x")
    scores = Scorer(model, build_cache(bpe_tokenizer, reversed_pairs)).score()
    # Pair i of the reversed file is pair 1247 - i of the original.
    restored = scores.view(-1, 2).flip(0).reshape(-1)
    assert (restored - reference).abs().max().item() < 1e-4


@pytest.mark.slow
def test_eager_attention_takes_an_additive_tree_mask(bpe_tokenizer, cache, reference):
    model = tiny_llama(len(bpe_tokenizer), attn_implementation="eager")
    scorer = Scorer(model, cache)
    scores = scorer.score()
    assert str(scorer.method) == "tree rows, tiled head"
    assert scorer.layout().batches[0].attention_mask.dtype == torch.float32
    assert (scores - reference).abs().max().item() < 1e-4


@pytest.mark.slow
def test_falls_back_to_packed_then_padded_rows_where_the_model_ignores_them(model, cache, reference, monkeypatch):
    import transformers.masking_utils as masking_utils

    ignore_tree_masks(monkeypatch)  # trees are wrong
    scorer = Scorer(model, cache)
    scores = scorer.score()
    assert scorer.method.layout == "packed"
    assert (scores - reference).abs().max().item() < 1e-4

    # Nor does it support packed sequences: position ids do not split the rows.
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    scorer = Scorer(model, cache)
    scores = scorer.score()
    assert scorer.method.layout == "padded"
    assert (scores - reference).abs().max().item() < 1e-4


def test_bf16_model_scores_with_float32_softmax(bpe_tokenizer, cache):
    model = tiny_llama(len(bpe_tokenizer)).to(torch.bfloat16)
    scores = Scorer(model, cache).score()
    sample = list(range(0, 2496, 97))
    with torch.no_grad():
        expected = []
        for s in sample:
            ids = torch.tensor([cache.sentence(s)])
            logits = model(input_ids=ids).logits[0, :-1].float()
            expected.append(float(logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).sum()))
    assert scores.dtype == torch.float64
    diffs = (scores[sample] - torch.tensor(expected, dtype=torch.float64)).abs()
    assert diffs.max().item() < 0.05 * max(cache.lengths)


def test_model_mode_is_restored(bpe_tokenizer, small_data):
    model = tiny_llama(len(bpe_tokenizer), attention_dropout=0.5)
    model.train()
    first = evaluate(model, bpe_tokenizer, small_data, allow_modified=True)
    assert model.training
    second = evaluate(model, bpe_tokenizer, small_data, allow_modified=True)
    # Dropout was off while scoring, so two evaluations agree exactly.
    assert [p.good_logprob for p in first.pairs] == [p.good_logprob for p in second.pairs]
    model.eval()
    evaluate(model, bpe_tokenizer, small_data, allow_modified=True)
    assert not model.training


def test_evaluator_tokenizes_once(model, bpe_tokenizer, small_data, monkeypatch):
    evaluator = Evaluator(bpe_tokenizer, small_data, allow_modified=True)
    first = evaluator(model)
    import tatblimp_callback.tokenized.cache as cache_module

    monkeypatch.setattr(cache_module, "encode_sentences", lambda *a, **k: pytest.fail("tokenized again"))
    second = evaluator(model)
    assert first.acc == second.acc and first.run_info["scoring_method"] == second.run_info["scoring_method"]


def test_vocabulary_mismatch_is_an_error_before_any_forward(bpe_tokenizer, cache):
    small = tiny_llama(100)
    with pytest.raises(ScoringError, match="embedding has only 100 rows"):
        Scorer(small, cache)


def test_meta_device_model_is_an_error(bpe_tokenizer, cache):
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(bpe_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
            )
        )
    with pytest.raises(ScoringError, match="meta device"):
        Scorer(model, cache)


def test_too_long_sentence_is_an_error_or_counted_truncation(bpe_tokenizer, cache):
    model = tiny_llama(len(bpe_tokenizer), max_position_embeddings=20)
    longest = max(cache.lengths)
    too_long = sum(n > 20 for n in cache.lengths)
    with pytest.raises(ScoringError) as raised:
        Scorer(model, cache)
    assert str(raised.value) == (
        f"{too_long:,} of {cache.num_sentences:,} sentences have more tokens than the model's context of 20 "
        f"(the longest, pair {cache.lengths.index(longest) // 2}'s {('good', 'bad')[cache.lengths.index(longest) % 2]} "
        f"sentence, has {longest}); pass truncate=True (tatblimp: --truncate) to cut them"
    )
    results = evaluate(model, cache=cache, truncate=True)
    assert longest > 20 and results.truncated_sentences == too_long > 0
    assert max(p.good_tokens for p in results.pairs) == 19


def test_a_cut_sentence_is_normalised_by_the_bytes_it_was_scored_on(bpe_tokenizer, tmp_path):
    """``truncate=True``: acc_norm divided the kept tokens' log-prob by the whole sentence's bytes, so a pair cut
    before its edit (the same tokens scored for both) was decided by the length of text the model never saw."""
    from conftest import write_pairs

    head = "Бу бик озын җөмлә, анда күп сүзләр бар һәм ул модельнең контекстыннан озынрак. " * 2  # noqa: RUF001 (Tatar text)
    data = write_pairs(
        tmp_path / "cut.jsonl",
        [
            {"good": head + "Мин китапларны укыйм.", "bad": head + "Мин китап укыйм.", "phenomenon": "good_longer"},
            {"good": head + "Мин китап укыйм.", "bad": head + "Мин китапларны укыйм.", "phenomenon": "bad_longer"},
        ],
    )
    results = evaluate(
        tiny_llama(len(bpe_tokenizer), max_position_embeddings=16), bpe_tokenizer, data, allow_modified=True, truncate=True
    )
    encoded = bpe_tokenizer(head, add_special_tokens=False, return_offsets_mapping=True)
    covered = len(head[: encoded["offset_mapping"][14][1]].encode("utf-8"))  # the first 15 tokens, after the prefix
    for pair in results.pairs:
        assert (pair.good_tokens, pair.bad_tokens) == (15, 15) and pair.good_logprob == pair.bad_logprob
        assert pair.good_bytes == pair.bad_bytes == covered < len(head.encode("utf-8"))
        assert not pair.passed and not pair.passed_norm  # a tie fails, per byte too
    assert results.truncated_sentences == 4 and results.acc_norm == 0.0


@pytest.mark.parametrize("family", [pytest.param("gemma2", marks=pytest.mark.slow), "phi"])
def test_soft_capped_logits_and_a_head_with_bias(bpe_tokenizer, cache, family):
    """Gemma 2 caps its logits (30 tanh(x / 30)); Phi's LM head has a bias: the tiled head does both."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    size = dict(
        vocab_size=len(bpe_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if family == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(head_dim=8, final_logit_softcapping=2.0, **size))
    else:
        model = PhiForCausalLM(PhiConfig(**size))
        assert model.lm_head.bias is not None
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.5)
    model.eval()
    sample = list(range(0, 2496, 7))
    reference = torch.tensor(reference_logprobs(model, [cache.sentence(s) for s in sample]))
    scorer = Scorer(model, cache)
    scores = scorer.score()
    assert str(scorer.method) == "tree rows, tiled head"
    assert (scores[sample] - reference).abs().max().item() < 1e-4


def test_a_sentence_exactly_at_the_context_leaves_room_only_where_a_token_is_generated(bpe_tokenizer, small_data):
    from tatblimp_callback.engine.model_checks import fit_cache_to_context
    from tatblimp_callback.engine.vllm_scoring import GENERATED

    cache = build_cache(bpe_tokenizer, small_data, allow_modified=True)
    longest = max(cache.lengths)
    assert fit_cache_to_context(cache, longest, truncate=False) is cache  # the default backend: it fits exactly
    at = sum(length == longest for length in cache.lengths)
    with pytest.raises(
        ScoringError,
        match=rf"{at} of 96 sentences have more tokens than the model's context of {longest} "
        "less the 1 token generated after each",
    ):
        fit_cache_to_context(cache, longest, truncate=False, room=GENERATED)
    cut = fit_cache_to_context(cache, longest, truncate=True, room=GENERATED)
    assert max(cut.lengths) == longest - 1 and len(cut.truncated) == at
