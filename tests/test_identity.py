"""One identity for what was scored (``identity.fingerprint``): the bytes, the column mapping and the selection,
compared by the tokenized cache, by ``sweep``'s refusal to mix files and by ``pair_sentences``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import SHARED, tiny_llama
from tatblimp_callback import Evaluator, evaluate
from tatblimp_callback.commands.sweep import SweepError, check_same_files
from tatblimp_callback.reading.data import load_benchmark
from tatblimp_callback.reading.suites import load_suite
from tatblimp_callback.results.flips import pair_sentences

# Ten Tatar pairs in two columns; read good=A,bad=B or the other way round. Escapes: the linter flags
# Cyrillic letters that look Latin.
ROWS = [
    ("\u041c\u0438\u043d \u0431\u0430\u0440\u0430\u043c.", "\u041c\u0438\u043d \u0431\u0430\u0440\u0430\u0441\u044b\u04a3."),
    (
        "\u0410\u043b\u0430\u0440 \u043a\u0438\u043b\u0434\u0435.",
        "\u0410\u043b\u0430\u0440 \u043a\u0438\u043b\u0434\u0435\u043c.",
    ),
    ("\u0421\u0438\u043d \u0443\u043a\u044b\u0439\u0441\u044b\u04a3.", "\u0421\u0438\u043d \u0443\u043a\u044b\u0439\u043c."),
    ("\u0411\u0435\u0437 \u0431\u0430\u0440\u0430\u0431\u044b\u0437.", "\u0411\u0435\u0437 \u0431\u0430\u0440\u0430."),
    ("\u0423\u043b \u044f\u0437\u0430.", "\u0423\u043b \u044f\u0437\u0430\u043c."),
]


@pytest.fixture(scope="module")
def two_columns(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("own") / "own.csv"
    path.write_text("A;B;phenomenon\n" + "".join(f"{a};{b};person\n" for a, b in ROWS), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def model(bpe_tokenizer):
    return tiny_llama(len(bpe_tokenizer), seed=3)


AB, BA = {"good": "A", "bad": "B"}, {"good": "B", "bad": "A"}


def test_the_fingerprint_tells_mappings_selections_and_hand_made_subsets_apart(two_columns, small_data):
    ab, ba = load_suite("own", two_columns, AB), load_suite("own", two_columns, BA)
    assert ab.md5 == ba.md5 and ab.fingerprint != ba.fingerprint  # the same bytes, other pairs
    assert load_suite("own", two_columns, dict(AB)).fingerprint == ab.fingerprint  # stable across reads
    benchmark = load_benchmark(small_data, allow_modified=True)
    subset = replace(benchmark, pairs=benchmark.pairs[:5])  # by hand: the full file's md5, no selection
    assert len({benchmark.fingerprint, benchmark.select(limit=1).fingerprint, subset.fingerprint}) == 3


def test_a_cache_file_is_not_reused_for_the_same_bytes_read_with_another_mapping(
    bpe_tokenizer, model, small_data, two_columns, tmp_path
):
    cache = tmp_path / "cache.safetensors"
    first = Evaluator(
        bpe_tokenizer, small_data, allow_modified=True, cache_path=cache, suites={"own": load_suite("own", two_columns, AB)}
    )
    scored_ab = first(model).suites["own"]
    swapped = {"own": load_suite("own", two_columns, BA)}
    again = Evaluator(bpe_tokenizer, small_data, allow_modified=True, cache_path=cache, suites=swapped)(model).suites["own"]
    fresh = evaluate(model, bpe_tokenizer, small_data, allow_modified=True, suites=swapped).suites["own"]
    # Before the fix the swapped mapping reused the A/B cache and gave A/B's numbers.
    assert [p.good for p in again.pairs] == [b for _, b in ROWS]
    assert (again.acc, again.acc_norm) == (fresh.acc, fresh.acc_norm)
    assert again.acc == pytest.approx(1 - scored_ab.acc - scored_ab.overall.ties / scored_ab.overall.n)
    assert again.acc != scored_ab.acc


def test_a_sweep_refuses_records_of_another_mapping_or_selection(bpe_tokenizer, model, small_data, two_columns, tmp_path):
    benchmark = load_benchmark(small_data, allow_modified=True)
    ab = load_suite("own", two_columns, AB)
    results = evaluate(model, bpe_tokenizer, benchmark, suites={"own": ab})
    record = {"checkpoint": "checkpoint-10", "step": 10, **{k: v for k, v in results.to_dict().items() if k != "pairs"}}
    path = tmp_path / "tatblimp.jsonl"
    check_same_files([record], benchmark, {"own": ab}, path)  # the same files, mapping and selection: appended to
    with pytest.raises(SweepError, match=r"scored with own \(md5 \w+, fingerprint \w+\), this sweep asks for own"):
        check_same_files([record], benchmark, {"own": load_suite("own", two_columns, BA)}, path)
    with pytest.raises(SweepError, match=r"was scored on md5 \w+, fingerprint \w+, this sweep reads"):
        check_same_files([record], benchmark.select(limit=1), {"own": ab}, path)


def test_flipped_pairs_of_a_selection_get_the_selections_sentences(bpe_tokenizer, model, small_data):
    benchmark = load_benchmark(small_data, allow_modified=True)
    chosen = benchmark.select(limit=1, phenomena="binding,passives")
    record = {k: v for k, v in evaluate(model, bpe_tokenizer, chosen).to_dict().items() if k != "pairs"}  # a history line
    # Before the fix: the whole file's first pairs (the md5 matches), other pairs' sentences.
    assert pair_sentences(record) == [(p.good, p.bad) for p in chosen.pairs]
    hand_made = replace(benchmark, pairs=benchmark.pairs[10:14])  # the callback's data= with a subset: not found again
    record = {k: v for k, v in evaluate(model, bpe_tokenizer, hand_made).to_dict().items() if k != "pairs"}
    assert pair_sentences(record) is None


def test_a_suites_flips_get_its_sentences_from_a_file_with_a_mapping_or_a_folder(
    bpe_tokenizer, model, small_data, two_columns, tmp_path
):
    folder = tmp_path / "blimp"
    folder.mkdir()
    lines = (SHARED / "blimp" / "data" / "passive_1.jsonl").read_text(encoding="utf-8").split("\n")[:6]
    (folder / "passive_1.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    suites = {"own": load_suite("own", two_columns, BA), "blimp": load_suite("blimp", folder)}
    record = evaluate(model, bpe_tokenizer, small_data, allow_modified=True, suites=suites).to_dict()
    for name, suite in suites.items():
        line = {k: v for k, v in record["suites"][name].items() if k != "pairs"}  # a sweep's or history's suite record
        assert pair_sentences(line) == [(p.good, p.bad) for p in suite.pairs], name  # before: None
        assert pair_sentences(line, suite.source) == [(p.good, p.bad) for p in suite.pairs], name


def test_compare_refuses_pair_by_pair_the_same_bytes_read_two_ways_and_names_columns_for_runs(
    bpe_tokenizer, model, small_data, two_columns, tmp_path
):
    from tatblimp_callback.commands.compare import format_text
    from tatblimp_callback.results.comparison import compare_runs
    from tatblimp_callback.results.runs import CompareError, load_runs

    paths = []
    for name, mapping in (("ab", AB), ("ba", BA), ("ab2", AB)):
        record = evaluate(model, bpe_tokenizer, load_suite("own", two_columns, mapping)).to_dict()
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(record), encoding="utf-8")
    with pytest.raises(CompareError, match="cover different pairs"):  # before: the same md5, so compared pair by pair
        compare_runs(load_runs([paths[0], paths[1]]))
    text = format_text(compare_runs(load_runs([paths[0], paths[2]])))
    assert "only ab  only ab2" in text and "baseline only" not in text  # the columns named for the runs


def test_explains_subset_names_itself_instead_of_claiming_the_whole_file(bpe_tokenizer, model, small_data, monkeypatch):
    from tatblimp_callback.commands.explain import score_pairs
    from tatblimp_callback.evaluation import Evaluator

    benchmark = load_benchmark(small_data, allow_modified=True)
    picked = benchmark.pick([7, 3])
    assert [p.good for p in picked.pairs] == [benchmark.pairs[7].good, benchmark.pairs[3].good]
    assert picked.selection == "pairs #7, #3 (2 of 48 pairs)" and picked.fingerprint != benchmark.fingerprint
    seen = []
    real_init = Evaluator.__init__

    def spy(self, tokenizer, data, **options):
        seen.append(data)
        real_init(self, tokenizer, data, **options)

    monkeypatch.setattr(Evaluator, "__init__", spy)
    details = score_pairs(model, bpe_tokenizer, benchmark, [7, 3])
    # Before: a subset holding the whole file's md5 and no selection (its results were not partial).
    assert seen[0].selection == picked.selection and seen[0].fingerprint == picked.fingerprint
    assert details[7][0].good == benchmark.pairs[7].good
