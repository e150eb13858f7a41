"""Token-level results: per-token log-probs from the engine's cells, token texts and edit spans."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_llama
from tatblimp_callback import Evaluator, Scorer, ScoringMethod, build_cache
from tatblimp_callback.engine.scoring_method import agree, relative_tolerance
from tatblimp_callback.results.token_results import edit_margins, edit_span, pair_tokens, token_texts

METHODS = [ScoringMethod(layout, head) for layout in ("tree", "packed", "padded") for head in ("tiled", "full_logits")]


@pytest.fixture(scope="module")
def model(bpe_tokenizer):
    return tiny_llama(len(bpe_tokenizer))


@pytest.fixture(scope="module")
def cache(bpe_tokenizer, small_data):
    return build_cache(bpe_tokenizer, small_data, allow_modified=True)


def plain_token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """One sentence alone, the whole model, float32 log-softmax: each scored token's log-prob."""
    with torch.no_grad():
        x = torch.tensor([ids])
        logprobs = model(input_ids=x, use_cache=False).logits[0, :-1].float().log_softmax(-1)
    return logprobs.gather(-1, x[0, 1:, None])[:, 0].double()


@pytest.mark.parametrize("method", METHODS, ids=str)
def test_token_logprobs_sum_exactly_and_equal_a_plain_forward(model, cache, method):
    scorer = Scorer(model, cache, method=method, keep_token_logprobs=True)
    sentence_logprobs = scorer.score().tolist()
    tokens = scorer.token_logprobs()
    rtol = relative_tolerance(torch.float32, cache.device)
    for s, values in enumerate(tokens):
        assert len(values) == cache.lengths[s] - 1
        assert sum(values) == sentence_logprobs[s]  # exactly: the same cells, added in the same order
        reference = plain_token_logprobs(model, cache.sentence(s))
        assert agree(torch.tensor(values), reference, torch.ones(len(values)), rtol), (method, s)


def test_token_logprobs_are_held_between_evaluations_only_when_asked(model, cache):
    scorer = Scorer(model, cache)
    scorer.score()
    assert scorer._token_cells is None  # a float64 per token is not held until the next evaluation
    with pytest.raises(RuntimeError, match="keep_token_logprobs=True"):
        scorer.token_logprobs()
    scorer.keep_token_logprobs = True
    scorer.score()
    assert scorer._token_cells.shape == (sum(cache.lengths) - cache.num_sentences,)
    assert [len(values) for values in scorer.token_logprobs()] == [n - 1 for n in cache.lengths]


def test_a_sentence_is_summed_from_its_cells_left_to_right(model, cache):
    # Float32 log-probs in float64 cells add up exactly in any order; full float64 cells show the order.
    scorer = Scorer(model, cache)
    cells = torch.randn(sum(cache.lengths) - cache.num_sentences, dtype=torch.float64)
    sums = scorer.cells.reduce(cells).tolist()
    starts = scorer.cells.starts.tolist()
    rows = [cells[start : start + length - 1].tolist() for start, length in zip(starts, cache.lengths)]
    assert sums == [sum(row) for row in rows]
    assert starts[1] == cache.lengths[0] - 1 and sum(map(len, rows)) == len(cells)


def test_edit_span_of_each_edit_kind_on_token_ids():
    # substitution, insertion, deletion, permutation, and repeats at the boundary (the suffix never overlaps the prefix)
    assert edit_span([1, 2, 3, 4], [1, 2, 9, 4]) == ((2, 3), (2, 3))
    assert edit_span([1, 2, 4], [1, 2, 7, 8, 4]) == ((2, 2), (2, 4))
    assert edit_span([1, 2, 7, 4], [1, 2, 4]) == ((2, 3), (2, 2))
    assert edit_span([1, 2, 3, 5, 6], [1, 3, 2, 5, 6]) == ((1, 3), (1, 3))
    assert edit_span([1, 2, 2, 3], [1, 2, 3]) == ((2, 3), (2, 2))
    assert edit_span([5, 5], [5, 5, 5]) == ((2, 2), (2, 3))
    assert edit_span([1, 2], [3, 4]) == ((0, 2), (0, 2))


# Real TatBLiMP pairs (index in test.jsonl) and, for the test's BPE tokenizer, the token texts of the edit.
EDITS = {
    "substitution": (0, ["ем"], ["ең"]),  # үземне -> үзеңне
    "insertion": (640, [], [" бер", "к", "ай", "ч", "ан", " да"]),  # noqa: RUF001 (Tatar text) + беркайчан да
    "deletion": (87, ["нән"], []),  # мәчесеннән -> мәчесен
    "permutation": (313, [" ", "Б", "ул", "ат", " сө", "т"], [" сө", "т", " ", "Б", "ул", "ат"]),  # Булат сөт -> сөт Булат
}


@pytest.mark.parametrize("kind", EDITS)
def test_edit_spans_on_real_pairs_of_each_kind(bpe_tokenizer, records, kind):
    index, good_edit, bad_edit = EDITS[kind]
    pair = records[index]
    good, bad = (bpe_tokenizer(pair[k], add_special_tokens=False)["input_ids"] for k in ("good", "bad"))
    (gs, ge), (bs, be) = edit_span(good, bad)
    good_text, bad_text = token_texts(bpe_tokenizer, good), token_texts(bpe_tokenizer, bad)
    assert "".join(good_text) == pair["good"] and "".join(bad_text) == pair["bad"]
    assert (good_text[gs:ge], bad_text[bs:be]) == (good_edit, bad_edit)
    assert good[:gs] == bad[:bs] and good[ge:] == bad[be:]  # outside the span, the same tokens


def byte_level_piece(byte: int) -> str:
    """GPT-2's byte-to-character map: printable Latin-1 bytes stand for themselves, the others from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def test_token_texts_of_a_split_character_go_to_the_token_that_completes_it(bpe_tokenizer):
    text = "Җ"  # two UTF-8 bytes; the byte-level tokenizer may hold them in one token or two
    ids = bpe_tokenizer(text, add_special_tokens=False)["input_ids"]
    byte_ids = [bpe_tokenizer.convert_tokens_to_ids(byte_level_piece(b)) for b in text.encode()]  # one token per byte
    assert bpe_tokenizer.unk_token_id not in byte_ids and None not in byte_ids
    assert token_texts(bpe_tokenizer, byte_ids) == ["", "Җ"]
    assert "".join(token_texts(bpe_tokenizer, ids)) == text


def test_token_texts_join_to_the_sentence_with_a_tokenizer_that_adds_a_prefix_space(bpe_tokenizer):
    """``add_prefix_space=True``: the pieces joined to " Мин китап укыйм." (the decoded text), not the sentence."""
    import copy

    from tokenizers import pre_tokenizers

    spaced = copy.deepcopy(bpe_tokenizer)
    spaced.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    sentence = "Мин китап укыйм."
    ids = spaced(sentence, add_special_tokens=False)["input_ids"]
    assert token_texts(spaced, ids)[0].startswith(" ")  # the decoding, as it is
    pieces = token_texts(spaced, ids, sentence)
    assert "".join(pieces) == sentence and len(pieces) == len(ids) and pieces[0] == token_texts(spaced, ids)[0][1:]


def test_score_include_tokens_writes_pair_fields_and_edit_margins(model, bpe_tokenizer, small_data, tmp_path):
    results = Evaluator(bpe_tokenizer, small_data, allow_modified=True, include_tokens=True)(model)
    record = json.loads(json.dumps(results.to_dict()))  # through JSON, as score --output writes it
    lines = small_data.read_text(encoding="utf-8").splitlines()
    for pair, line in zip(record["pairs"], lines):
        source = json.loads(line)
        assert sum(pair["good_token_logprobs"]) == pair["good_logprob"]
        assert sum(pair["bad_token_logprobs"]) == pair["bad_logprob"]
        assert len(pair["good_token_logprobs"]) == len(pair["good_tokens_text"]) == pair["good_tokens"]
        assert "".join(pair["good_tokens_text"]) == source["good"] and "".join(pair["bad_tokens_text"]) == source["bad"]
        (gs, ge), (bs, be) = pair["edit"]["good"], pair["edit"]["bad"]
        assert 0 <= gs <= ge <= pair["good_tokens"] and gs == bs and pair["good_tokens"] - ge == pair["bad_tokens"] - be
    margins = record["edit_margins"]
    assert margins["n"] == 48 and set(margins["phenomena"]) == set(results.phenomena)
    assert margins["mean_margin"] == pytest.approx(results.overall.mean_margin, abs=1e-9)
    assert abs(margins["mean_before_edit"]) < 1e-4  # the same tokens in the same context
    assert margins["edit_share"] == pytest.approx(margins["mean_at_edit"] / margins["mean_margin"])
    # Without the option, nothing of it.
    plain = Evaluator(bpe_tokenizer, small_data, allow_modified=True)(model).to_dict()
    assert "edit_margins" not in plain and "edit" not in plain["pairs"][0]


def test_pair_tokens_checks_the_number_of_sentences(cache):
    with pytest.raises(ValueError, match="token lists for 96 sentences"):
        pair_tokens(cache, [[0.0]] * 3)
    assert edit_margins([], [])["edit_share"] is None


def test_token_texts_of_a_raw_sentencepiece_model(records):
    from conftest import SPM_MODEL
    from tatblimp_callback import SentencePieceTokenizer

    tokenizer = SentencePieceTokenizer(SPM_MODEL)
    for pair in records[:20]:
        ids = tokenizer.encode_batch([pair["good"]])[0]
        pieces = token_texts(tokenizer, ids)
        assert len(pieces) == len(ids) and "".join(pieces) == pair["good"]
        assert pieces[1:] == [tokenizer.processor.id_to_piece(i).replace("▁", " ") for i in ids[1:]]
