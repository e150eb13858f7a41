"""Loading the benchmark: the official file, modified files, BLiMP field names, and every bad input."""

from __future__ import annotations

import json

import pytest

from conftest import DATA, write_pairs
from tatblimp_callback import BenchmarkError, load_benchmark
from tatblimp_callback.cli import main
from tatblimp_callback.reading.data import OFFICIAL_MD5, OFFICIAL_PHENOMENA, OFFICIAL_RELEASE

GOOD = {"good": "Мин китап укыйм.", "bad": "Мин китап укыйсың.", "phenomenon": "subject_verb_agreement", "subtype": "1sg"}


def test_official_release():
    benchmark = load_benchmark(DATA)
    assert len(benchmark) == 1248 and len(benchmark.sentences) == 2496
    assert benchmark.md5 == OFFICIAL_MD5 and benchmark.official and benchmark.release == OFFICIAL_RELEASE
    counts = {name: sum(p.phenomenon == name for p in benchmark.pairs) for name in benchmark.phenomena}
    assert counts == OFFICIAL_PHENOMENA
    assert benchmark.sentences[0] == benchmark.pairs[0].good and benchmark.sentences[1] == benchmark.pairs[0].bad


def test_environment_variable(monkeypatch):
    monkeypatch.setenv("TATBLIMP_DATA", str(DATA))
    assert load_benchmark().md5 == OFFICIAL_MD5


def test_a_missing_file_named_by_the_environment_variable_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("TATBLIMP_DATA", str(tmp_path / "moved.jsonl"))
    with pytest.raises(BenchmarkError, match=r"moved\.jsonl: cannot read the benchmark file named by \$TATBLIMP_DATA \("):
        load_benchmark()
    with pytest.raises(BenchmarkError) as given:  # a path given outright is the caller's: no variable named
        load_benchmark(tmp_path / "given.jsonl")
    assert "TATBLIMP_DATA" not in str(given.value)


def test_hub_download_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("TATBLIMP_DATA", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(BenchmarkError, match=r"ilchats/TatBLiMP.*(offline|cache)"):
        load_benchmark()


def test_modified_file_needs_consent_and_is_named(tmp_path, capsys):
    path = write_pairs(tmp_path / "mine.jsonl", [GOOD])
    with pytest.raises(BenchmarkError, match=r"is not the official TatBLiMP v1\.0 release") as error:
        load_benchmark(path)
    assert str(error.value).endswith("; pass allow_modified=True to score it as a modified benchmark")
    # The command names its flag: one line, that option and no Python argument (before any model loads).
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    assert main(["score", str(tmp_path / "model"), "--data", str(path)]) == 1
    assert capsys.readouterr().err == (
        f"tatblimp score: error: {path}: md5 {error.value.args[0].split('md5 ')[1].split()[0]} is not the official "
        f"TatBLiMP v1.0 release ({OFFICIAL_MD5}); pass --allow-modified to score it as a modified benchmark\n"
    )
    benchmark = load_benchmark(path, allow_modified=True)
    assert not benchmark.official
    assert benchmark.release == f"modified (md5 {benchmark.md5})" and len(benchmark.md5) == 32


def test_blimp_field_names(tmp_path):
    records = [
        {"sentence_good": "A b c.", "sentence_bad": "A c b.", "UID": "word_order_x"},
        {"sentence_good": "D e.", "sentence_bad": "D f.", "linguistics_term": "agreement", "UID": "agr_1"},
        {"sentence_good": "G h.", "sentence_bad": "H g.", "phenomenon": "binding"},
        {"sen": "I j.", "wrong_sen": "J i.", "phenomenon": "order"},  # MultiBLiMP's fields, as suites.py reads them
    ]
    pairs = load_benchmark(write_pairs(tmp_path / "blimp.jsonl", records), allow_modified=True).pairs
    # UID is a subtype (BLiMP's 67 paradigms of 13 phenomena), as suites.py takes it; without a phenomenon
    # field a BLiMP line's phenomenon is the file's name, as there.
    assert [(p.good, p.bad, p.phenomenon, p.subtype) for p in pairs] == [
        ("A b c.", "A c b.", "blimp", "word_order_x"),
        ("D e.", "D f.", "agreement", "agr_1"),
        ("G h.", "H g.", "binding", None),
        ("I j.", "J i.", "order", None),
    ]


def test_one_file_gets_the_same_labels_through_load_benchmark_and_load_suite():
    from conftest import SHARED
    from tatblimp_callback.reading.suites import load_suite

    path = SHARED / "blimp" / "data" / "adjunct_island.jsonl"
    as_benchmark, as_suite = load_benchmark(path, allow_modified=True), load_suite("blimp", path)
    # Before: load_benchmark took UID for nothing (no subtype), load_suite as the subtype.
    assert as_benchmark.pairs == as_suite.pairs and len(as_suite.pairs) == 1000
    assert {p.subtype for p in as_benchmark.pairs} == {"adjunct_island"} and as_benchmark.phenomena == ["island_effects"]


@pytest.mark.parametrize(
    "second_line, message",
    [
        (b"{not json", r":2: invalid JSON"),
        (b'["a", "b"]', r":2: expected a JSON object, got list"),
        (json.dumps({"good": "x", "phenomenon": "p"}).encode(), r":2: missing field 'bad'"),
        (json.dumps({"good": "x", "bad": " ", "phenomenon": "p"}).encode(), r":2: field 'bad' is empty"),
        (json.dumps({"good": "x", "bad": 3, "phenomenon": "p"}).encode(), r":2: field 'bad' must be a string, got int"),
        (json.dumps({"good": "x", "bad": "x", "phenomenon": "p"}).encode(), r":2: the good and bad sentences are identical"),
        (json.dumps({"good": "x", "bad": "y"}).encode(), r":2: missing field 'phenomenon'"),
        (
            json.dumps({"good": "x", "bad": "y", "phenomenon": "p", "subtype": 1}).encode(),
            r":2: field 'subtype' must be a string or null",
        ),
        ('{"good": "\u043a"}'.encode("utf-8")[:-3] + b'\xff"}', r":2: bytes that are not UTF-8"),
        (b"", r":2: empty line inside the file"),
    ],
    ids=["json", "not-object", "missing", "empty", "non-string", "identical", "no-phenomenon", "subtype", "utf8", "blank"],
)
def test_bad_lines_name_file_and_line(tmp_path, second_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        json.dumps(GOOD, ensure_ascii=False).encode() + b"\n" + second_line + b"\n" + json.dumps(GOOD).encode() + b"\n"
    )
    for allow_modified in (True, False):  # a broken line is named first, not the md5 the flag would accept
        with pytest.raises(BenchmarkError, match=str(path).replace(".", r"\.") + message):
            load_benchmark(path, allow_modified=allow_modified)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"\n")
    with pytest.raises(BenchmarkError, match=r"empty\.jsonl: the file holds no pairs"):
        load_benchmark(tmp_path / "empty.jsonl", allow_modified=True)
    with pytest.raises(BenchmarkError, match=r"nowhere\.jsonl: cannot read"):
        load_benchmark(tmp_path / "nowhere.jsonl")
