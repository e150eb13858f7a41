"""The Python API's options are checked where they are given: the callbacks and the ``Evaluator`` refuse a value of the
wrong kind when made (the ``Scorer`` a wrong size too), naming the option and the value, where it used to fail deep
inside an evaluation, or to be taken silently."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import tiny_llama
from tatblimp_callback import Evaluator, Scorer, TatBLiMPCallback

BAD = [("memory_budget", -5), ("memory_budget", 0), ("memory_budget", 1.5e9), ("memory_budget", "2GB"), ("row_length", 0)]
BAD += [("row_length", 12.0), ("row_length", True)]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_every_entry_point_refuses_a_size_that_is_not_a_positive_whole_number(bpe_tokenizer, small_data, name, value):
    from tatblimp_callback import build_cache
    from tatblimp_callback.lightning import TatBLiMPLightningCallback

    message = f"^{name} must be a positive whole number of .*; got {value!r}$"
    for make in (TatBLiMPCallback, TatBLiMPLightningCallback, lambda **o: Evaluator(bpe_tokenizer, small_data, **o)):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            make(**{name: value})
    cache = build_cache(bpe_tokenizer, small_data, allow_modified=True)
    with pytest.raises(ValueError, match=message):
        Scorer(tiny_llama(len(bpe_tokenizer)), cache, **{name: value})


def test_whole_numbers_of_any_integer_type_and_none_are_taken(bpe_tokenizer, small_data):
    from tatblimp_callback import build_cache

    cache = build_cache(bpe_tokenizer, small_data, allow_modified=True)
    scorer = Scorer(tiny_llama(len(bpe_tokenizer)), cache, memory_budget=np.int64(2**24), row_length=np.int32(64))
    assert scorer.memory_budget == 2**24 and scorer.row_length >= 64
    assert TatBLiMPCallback(memory_budget=None, row_length=None).memory_budget is None


def entry_points(bpe_tokenizer, small_data):
    """Each way in that takes these options, made with ``options``: both callbacks and the ``Evaluator``."""
    from tatblimp_callback.lightning import TatBLiMPLightningCallback

    return {
        "TatBLiMPCallback": lambda **options: TatBLiMPCallback(**options),
        "TatBLiMPLightningCallback": lambda **options: TatBLiMPLightningCallback(**options),
        "Evaluator": lambda **options: Evaluator(options.pop("tokenizer", bpe_tokenizer), small_data, **options),
    }


TOKENIZER = "/models/tok/kypchak_unigram_48k.model"
REFUSED = [
    ({"tokenizer": TOKENIZER}, f"^tokenizer={TOKENIZER!r} is a path or a name, not a tokenizer: load it first"),
    ({"prefix_token_id": 2.9}, r"^prefix_token_id must be a token id \(a whole number\) or None, got 2.9$"),
    ({"prefix_token_id": "1"}, "^prefix_token_id must be a token id"),
    ({"suites": ["blimp"]}, r"^suites= must be \{name: path or Suite\}"),
    ({"suites": "blimp/data"}, r"^suites= must be \{name: path or Suite\}"),
    ({"suites": {5: "blimp/data"}}, "^suite names must be non-empty strings, got 5$"),
    ({"suites": {"blimp": 5}}, "^suite 'blimp': expected a path or a Suite, got 5$"),
    ({"suites": {"en/blimp": "blimp/data"}}, r"^suite name 'en/blimp': it prefixes the suite's logged keys, so no '/'"),
    ({"suites": {"tatblimp": "blimp/data"}}, r"^suite name 'tatblimp': it prefixes the suite's logged keys"),
    ({"allow_modified": "no"}, "^allow_modified must be True or False, got 'no'$"),
    ({"truncate": "no"}, "^truncate must be True or False, got 'no'$"),
    ({"exact_decisions": "no"}, "^exact_decisions must be True or False, got 'no'$"),
]
CALLBACKS_ONLY = [
    ({"head_method": "tree2"}, "^unknown head method 'tree2'"),
    ({"log_prefix": None}, "^log_prefix must be a non-empty string"),
    ({"log_prefix": ""}, "^log_prefix must be a non-empty string"),
    ({"acquisition_threshold": 80}, "^acquisition_threshold must be an acc_norm from 0 to 1, got 80$"),
    ({"raise_on_error": "yes"}, "^raise_on_error must be True or False"),
    ({"alert_on_regression": "False"}, "^alert_on_regression must be True or False, got 'False'$"),
]


@pytest.mark.parametrize(("options", "message"), REFUSED + CALLBACKS_ONLY)
def test_a_mistyped_option_is_refused_where_it_is_given(bpe_tokenizer, small_data, options, message):
    """Before: a tokenizer's path failed every evaluation of a run that trained on (``AttributeError: 'str' object has
    no attribute 'bos_token_id'``), a list of suite names stopped training at its start (``AttributeError``), a
    mistyped head method left the run with no scores, ``prefix_token_id=2.9`` scored with token 2 and ``"no"`` read as
    True."""
    for name, make in entry_points(bpe_tokenizer, small_data).items():
        if name == "Evaluator" and (options, message) in CALLBACKS_ONLY:
            continue
        with pytest.raises(ValueError, match=message):
            make(**dict(options))


def test_every_flag_of_both_callbacks_is_checked(bpe_tokenizer, small_data):
    """``eval_on_evaluate``, ``log_table`` and ``alert_on_regression`` took ``"False"`` and acted as True."""
    from tatblimp_callback import TatBLiMPCallback

    for name in ("eval_on_evaluate", "log_table"):  # the Trainer callback's own
        with pytest.raises(ValueError, match=f"^{name} must be True or False, got 'False'$"):
            TatBLiMPCallback(tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, **{name: "False"})


def test_an_evaluators_data_tokenizer_and_prefix_token_set_anew_are_used(bpe_tokenizer, small_data, tmp_path):
    """``evaluator.data = other`` (or ``.tokenizer``, ``.prefix_token_id``) after a call went on scoring the first
    cache's pairs, with no word."""
    from conftest import train_bpe, write_pairs

    model = tiny_llama(len(bpe_tokenizer))
    evaluator = Evaluator(bpe_tokenizer, small_data, allow_modified=True)
    assert len(evaluator(model).pairs) == 48
    lines = small_data.read_text(encoding="utf-8").splitlines()
    evaluator.data = write_pairs(tmp_path / "four.jsonl", [json.loads(line) for line in lines[:4]])
    assert len(evaluator(model).pairs) == 4 and evaluator(model).benchmark_source == str(tmp_path / "four.jsonl")
    evaluator.prefix_token_id = bpe_tokenizer.eos_token_id
    assert evaluator(model).run_info["prefix_token_id"] == bpe_tokenizer.eos_token_id
    evaluator.tokenizer = other = train_bpe(vocab_size=300, lines=500)
    results = evaluator(tiny_llama(len(other)))
    first = json.loads(lines[0])["good"]
    assert evaluator.cache.sentence(0)[1:] == other(first, add_special_tokens=False)["input_ids"]
    assert results.tokens == sum(len(other(t, add_special_tokens=False)["input_ids"]) for t in evaluator.cache.sentences)


def test_the_scoring_paths_below_refuse_a_tokenizers_path_and_a_list_of_suites_by_name(bpe_tokenizer, small_data):
    from tatblimp_callback import build_cache, evaluate

    model = tiny_llama(len(bpe_tokenizer))
    with pytest.raises(ValueError, match="is a path or a name, not a tokenizer"):
        build_cache(TOKENIZER, small_data, allow_modified=True)
    with pytest.raises(ValueError, match=r"^no tokenizer"):
        build_cache(None, small_data, allow_modified=True)
    with pytest.raises(ValueError, match="is a path or a name, not a tokenizer"):
        evaluate(model, TOKENIZER, small_data, allow_modified=True)
    evaluator = Evaluator(bpe_tokenizer, small_data, allow_modified=True, suites={"again": small_data})
    with pytest.raises(ValueError, match=r"^suites= takes a list of suite names, got the string 'again'"):
        evaluator(model, suites="again")
    assert set(evaluator(model, suites=["again"]).suites) == {"again"}


def test_sequence_indices_outside_the_cache_and_data_that_is_no_path_are_named(bpe_tokenizer, small_data):
    """``score([1000])`` failed with numpy's ``IndexError`` (and ``[-1]`` with one naming an index the caller never
    gave); data given as a list of records failed in pathlib."""
    from tatblimp_callback import BenchmarkError, build_cache, evaluate

    cache = build_cache(bpe_tokenizer, small_data, allow_modified=True)
    scorer = Scorer(tiny_llama(len(bpe_tokenizer)), cache)
    for sequences in ([0, 1000], [-1]):
        with pytest.raises(ValueError, match=rf"^score\(sequences=\): \[{sequences[-1]}\] not among the cache's 96 sequences$"):
            scorer.score(sequences)
    assert scorer.score([0, 1])[:2].ne(0).all()
    with pytest.raises(BenchmarkError, match=r"^the benchmark is read from a JSONL file: give its path, not a list$"):
        evaluate(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, [{"good": "a", "bad": "b"}], allow_modified=True)
