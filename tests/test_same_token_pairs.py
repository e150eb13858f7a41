"""Pairs whose sentences differ as text but not as token ids (a tokenizer that folds whitespace, as
SentencePiece's ``remove_extra_whitespaces`` does): flagged, by pair, in the results and a warning (#30)."""

from __future__ import annotations

import copy
import logging

from conftest import tiny_llama
from tatblimp_callback import evaluate
from tatblimp_callback.reading.suites import load_suite

ROWS = [
    ("\u041c\u0438\u043d \u0431\u0430\u0440\u0430\u043c.", "\u041c\u0438\u043d  \u0431\u0430\u0440\u0430\u043c."),  # two spaces
    (
        "\u0410\u043b\u0430\u0440 \u043a\u0438\u043b\u0434\u0435.",
        "\u0410\u043b\u0430\u0440 \u043a\u0438\u043b\u0434\u0435\u043c.",
    ),
]


def test_pairs_with_the_same_token_ids_are_flagged(bpe_tokenizer, tmp_path, caplog):
    from tokenizers import Regex, normalizers

    folding = copy.deepcopy(bpe_tokenizer)
    folding.backend_tokenizer.normalizer = normalizers.Replace(Regex(r"\s+"), " ")  # whitespace folded
    path = tmp_path / "own.csv"
    path.write_text("good;bad;phenomenon\n" + "".join(f"{a};{b};person\n" for a, b in ROWS), encoding="utf-8")
    suite = load_suite("own", path)
    model = tiny_llama(len(bpe_tokenizer))
    with caplog.at_level(logging.WARNING):
        results = evaluate(model, folding, suite)
    pair = results.pairs[0]
    assert pair.good_logprob == pair.bad_logprob  # indistinguishable: the raw comparison is a tie
    # Before: nothing said so; now named in the results, the table and one warning.
    assert results.same_token_pairs == [0] and results.to_dict()["same_token_pairs"] == [0]
    assert "1 pairs have the same token ids for both sentences" in results.format_table()
    assert "pairs #0" in caplog.text and "same token ids" in caplog.text
    assert evaluate(model, bpe_tokenizer, suite).same_token_pairs == []  # a tokenizer that keeps the two spaces
