"""Reading minimal-pair suites: the real BLiMP folder, CSV/TSV layouts, column mappings, left-out pairs, malformed rows."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from conftest import DATA, SHARED
from tatblimp_callback import BenchmarkError
from tatblimp_callback.reading.suites import load_suite, parse_columns, suites_from_args

BLIMP = SHARED / "blimp" / "data"
# The pairs of BLiMP whose two sentences are identical, as released (shared/blimp/README.md: 7 of them).
IDENTICAL = [
    ("passive_1.jsonl", 325),
    ("passive_1.jsonl", 811),
    ("principle_A_case_2.jsonl", 106),
    ("principle_A_case_2.jsonl", 288),
    ("principle_A_case_2.jsonl", 373),
    ("principle_A_case_2.jsonl", 817),
    ("principle_A_case_2.jsonl", 968),
]


@pytest.fixture(scope="module")
def blimp(request):
    caplog = logging.getLogger("tatblimp_callback.reading.suites")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    caplog.addHandler(handler)
    try:
        suite = load_suite("blimp", BLIMP)
    finally:
        caplog.removeHandler(handler)
    return suite, records


def test_all_of_blimp_is_read_with_the_identical_pairs_left_out_and_named(blimp):
    suite, warnings = blimp
    assert len(suite) == 66_993
    assert [(Path(e["file"]).name, e["line"]) for e in suite.left_out] == IDENTICAL
    assert {e["reason"] for e in suite.left_out} == {"the good and bad sentences are identical"}
    for entry in suite.left_out:  # the line named is really that pair
        record = json.loads(Path(entry["file"]).read_text(encoding="utf-8").split("\n")[entry["line"] - 1])
        assert record["sentence_good"] == record["sentence_bad"]
    assert len(suite.phenomena) == 13  # linguistics_term
    assert len({p.subtype for p in suite.pairs}) == 67  # UID
    # One warning names every left-out pair by file and line.
    assert len(warnings) == 1 and all(f"{name}:{line}" in warnings[0].getMessage() for name, line in IDENTICAL)
    # Sorted file order, then each file's rows in order.
    first = json.loads((BLIMP / "adjunct_island.jsonl").read_text(encoding="utf-8").split("\n")[0])
    assert (suite.pairs[0].good, suite.pairs[0].subtype) == (first["sentence_good"], "adjunct_island")
    assert suite.pairs[-1].subtype == sorted(p.stem for p in BLIMP.glob("*.jsonl"))[-1]


def test_official_tatblimp_as_a_suite_is_read_as_strictly_as_ever(tmp_path):
    suite = load_suite("tat", DATA)
    assert len(suite) == 1248 and suite.left_out == ()
    assert suite.phenomena[0] == json.loads(DATA.read_text(encoding="utf-8").split("\n")[0])["phenomenon"]


def write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.write_bytes(text.encode(encoding))
    return path


def test_a_semicolon_csv_with_a_bom_and_turblimp_columns(tmp_path):
    folder = tmp_path / "turblimp"
    folder.mkdir()
    write(
        folder / "b_passives.csv",
        "\ufeffgood_sentence;bad_sentence;good_cue;bad_cue;critical_region;phenomenon\r\n"
        "Kitap okundu.;Kitap okudu.;okundu;okudu;2;passives\r\n"
        "Ev yap\u0131ld\u0131.;Ev yapt\u0131.;yap\u0131ld\u0131;yapt\u0131;2;passives\r\n",
    )
    write(
        folder / "a_anaphor.csv",
        "good_sentence;bad_sentence;phenomenon;subtype\nO kendini gördü.;O kendimi gördü.;anaphor;person\n",
    )
    (folder / "README.md").write_text("not data")
    suite = load_suite("turblimp", folder)
    # Sorted file names: a_anaphor first; its row's own subtype; b_passives' rows take the file name as subtype.
    assert [(p.good, p.bad, p.phenomenon, p.subtype) for p in suite.pairs] == [
        ("O kendini gördü.", "O kendimi gördü.", "anaphor", "person"),
        ("Kitap okundu.", "Kitap okudu.", "passives", "b_passives"),
        ("Ev yap\u0131ld\u0131.", "Ev yapt\u0131.", "passives", "b_passives"),
    ]


def test_a_comma_csv_with_quoted_fields_holding_commas_quotes_and_line_breaks(tmp_path):
    file = write(
        tmp_path / "agreement.csv",
        'good_sentence,bad_sentence,phenomenon\n"Yes, they run.","Yes, they runs.",sva\n'
        '"She said ""go""\nand left.","She said ""go""\nand leave.",sva\n'
        "The dogs bark.,The dogs barks.,sva\n",
    )
    suite = load_suite("own", file)
    assert [p.good for p in suite.pairs] == ["Yes, they run.", 'She said "go"\nand left.', "The dogs bark."]
    assert {p.subtype for p in suite.pairs} == {"agreement"}  # the file name, as it differs from the phenomenon
    # A malformed row after a multi-line record is named by the line it starts on.
    broken = write(tmp_path / "broken.csv", file.read_text(encoding="utf-8") + "only,two\n")
    with pytest.raises(BenchmarkError, match=r"broken\.csv:7: 2 fields, but the header has 3"):
        load_suite("own", broken)


def test_a_tsv_without_phenomenon_takes_the_file_name(tmp_path):
    file = write(tmp_path / "word_order.tsv", "sen\twrong_sen\nMin kitap ukyim.\tMin ukyim kitap.\n")
    (pair,) = load_suite("multiblimp", file).pairs
    assert (pair.good, pair.bad, pair.phenomenon, pair.subtype) == ("Min kitap ukyim.", "Min ukyim kitap.", "word_order", None)


def test_multiblimp_jsonl_and_a_jsonl_bom(tmp_path):
    line = {"sen": "Ул килде.", "wrong_sen": "Ул килдем.", "phenomenon": "SV-P"}
    file = write(tmp_path / "tat.jsonl", "\ufeff" + json.dumps(line, ensure_ascii=False) + "\n")
    (pair,) = load_suite("multiblimp", file).pairs
    assert (pair.good, pair.phenomenon, pair.subtype) == ("Ул килде.", "SV-P", "tat")


def test_a_json_file_is_json_lines_or_one_array_of_records(tmp_path):
    """A ``.json`` suite was read as CSV: a truncated one said "2 fields, but the header has 1 (delimiter ',')"."""
    lines = write(tmp_path / "lines.json", '{"good": "a b", "bad": "a c", "phenomenon": "p"}\n')
    array = write(
        tmp_path / "array.json", '[{"good": "a b", "bad": "a c", "phenomenon": "p"},\n {"good": "d e", "bad": "d f"}]\n'
    )
    assert [(p.good, p.bad) for p in load_suite("s", lines).pairs] == [("a b", "a c")]
    assert [(p.good, p.phenomenon) for p in load_suite("s", array).pairs] == [("a b", "p"), ("d e", "array")]
    truncated = write(tmp_path / "cut.json", '[{"good": "a b",\n "bad": ')
    with pytest.raises(BenchmarkError, match=r"cut\.json:2: invalid JSON"):
        load_suite("s", truncated)
    with pytest.raises(BenchmarkError, match=r"odd\.json: record 2 of the array is not a JSON object"):
        load_suite("s", write(tmp_path / "odd.json", '[{"good": "a b", "bad": "a c"}, 5]'))
    # JSON lines saved as .txt: read as such (its first object was taken for a CSV header, its second line blamed).
    text = write(tmp_path / "pairs.txt", '{"good": "a b", "bad": "a c"}\n{"good": "d e", "bad": "d f"}\n')
    assert [(p.good, p.bad) for p in load_suite("s", text).pairs] == [("a b", "a c"), ("d e", "d f")]
    assert [p.good for p in load_suite("s", write(tmp_path / "table.txt", "good,bad\na b,a c\n")).pairs] == ["a b"]


def test_a_column_mapping_for_other_layouts(tmp_path):
    file = write(tmp_path / "mine.csv", "ID;SENT_OK;SENT_BAD;CAT\n1;A cat sleeps.;A cat sleep.;agreement\n")
    with pytest.raises(BenchmarkError, match=r"mine\.csv:2: no sentence fields"):
        load_suite("mine", file)
    columns = parse_columns("good=SENT_OK,bad=SENT_BAD,phenomenon=CAT")
    (pair,) = load_suite("mine", file, columns).pairs
    assert (pair.good, pair.bad, pair.phenomenon, pair.subtype) == ("A cat sleeps.", "A cat sleep.", "agreement", "mine")
    # A role the mapping leaves out is read from its usual field: the rows' own phenomenon and subtype (before, every
    # pair went under the file's name).
    file = write(tmp_path / "mycols.jsonl", '{"ok": "A b.", "nok": "A c.", "phenomenon": "agreement", "subtype": "number"}\n')
    (pair,) = load_suite("mine", file, parse_columns("good=ok,bad=nok")).pairs
    assert (pair.good, pair.bad, pair.phenomenon, pair.subtype) == ("A b.", "A c.", "agreement", "number")
    with pytest.raises(ValueError, match="unknown role 'sentence'"):
        parse_columns("good=A,bad=B,sentence=C")
    with pytest.raises(ValueError, match="needs good= and bad="):
        parse_columns("good=A")


def test_identical_pairs_of_a_csv_are_left_out_and_counted(tmp_path, caplog):
    file = write(tmp_path / "x.csv", "good,bad,phenomenon\na b,a c,p\nsame,same,p\nd e,d f,p\n")
    with caplog.at_level(logging.WARNING, logger="tatblimp_callback.reading.suites"):
        suite = load_suite("x", file)
    assert len(suite) == 2
    assert suite.left_out == ({"file": str(file), "line": 3, "reason": "the good and bad sentences are identical"},)
    assert len(caplog.records) == 1 and f"{file}:3" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    ("name", "content", "error"),
    [
        (
            "a.jsonl",
            '{"good": "a b", "bad": "a c", "phenomenon": "p"}\n{"good": "a b", "phenomenon": "p"}\n',
            r"a\.jsonl:2: missing field 'bad'",
        ),
        ("a.jsonl", '{"good": "a b", "bad": "  ", "phenomenon": "p"}\n', r"a\.jsonl:1: field 'bad' is empty"),
        ("a.jsonl", '{"good": "a b", "bad": "a c", "phenomenon": ""}\n', r"a\.jsonl:1: field 'phenomenon' is empty"),
        ("a.jsonl", '{"good": "a b", "bad": "a c"}\n{"good": "a b", "bad": \n', r"a\.jsonl:2: invalid JSON"),
        ("a.jsonl", '{"good": "a b", "bad": "a c"}\n\n{"good": "a b", "bad": "a c"}\n', r"a\.jsonl:2: empty line"),
        ("a.csv", "good,bad\nx y,x z\nx y,\n", r"a\.csv:3: field 'bad' is empty"),
        ("a.csv", "good,bad,phenomenon\nx y,x z,p,extra\n", r"a\.csv:2: 4 fields, but the header has 3"),
        ("a.csv", 'good,bad\n"x y,x z\n', r"a\.csv:\d+: (malformed CSV|1 fields)"),
        ("a.tsv", "good\tbad\nx y\n", r"a\.tsv:2: 1 fields, but the header has 2"),
    ],
)
def test_a_malformed_row_names_its_file_and_line(tmp_path, name, content, error):
    with pytest.raises(BenchmarkError, match=error):
        load_suite("bad", write(tmp_path / name, content))


def test_invalid_utf8_names_its_line(tmp_path):
    file = tmp_path / "a.csv"
    file.write_bytes(b"good,bad\nx y,x z\nx \xff,x w\n")
    with pytest.raises(BenchmarkError, match=r"a\.csv:3: bytes that are not UTF-8"):
        load_suite("bad", file)


def test_empty_folders_and_missing_paths(tmp_path):
    with pytest.raises(BenchmarkError, match="no suite file"):
        load_suite("empty", tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(BenchmarkError, match="no suite file"):
        load_suite("empty", tmp_path)
    write(tmp_path / "a.jsonl", "\n")
    with pytest.raises(BenchmarkError, match=r"a\.jsonl: the file holds no pairs"):
        load_suite("empty", tmp_path)
    with pytest.raises(BenchmarkError, match="no such file or folder"):
        load_suite("gone", tmp_path / "gone")


def test_the_command_line_options(tmp_path):
    from argparse import Namespace

    a = write(tmp_path / "a.csv", "S1;S2\nx y;x z\n")
    b = write(tmp_path / "b.jsonl", '{"sentence_good": "p q", "sentence_bad": "p r", "UID": "u"}\n')
    suites = suites_from_args(Namespace(suite=[f"mine={a}", f"other={b}"], columns=["mine:good=S1,bad=S2"], suites_only=False))
    assert list(suites) == ["mine", "other"] and suites["mine"].pairs[0].good == "x y" and suites["other"].pairs[0].subtype == "u"
    with pytest.raises(ValueError, match="a name given twice"):
        suites_from_args(Namespace(suite=[f"x={a}", f"x={b}"], columns=[], suites_only=False))
    with pytest.raises(ValueError, match="no --suite named 'nope'"):
        suites_from_args(Namespace(suite=[f"x={b}"], columns=["nope:good=A,bad=B"], suites_only=False))
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        suites_from_args(Namespace(suite=["blimp"], columns=[], suites_only=False))


def test_the_callback_checks_suite_every():
    from tatblimp_callback import TatBLiMPCallback

    for wrong in (0, {"other": 2}, {"blimp": 0}):
        with pytest.raises(ValueError, match="suite_every must be an int >= 1"):
            TatBLiMPCallback(suites={"blimp": str(BLIMP)}, suite_every=wrong)
    with pytest.raises(ValueError, match="suite names must differ from the log prefix"):
        TatBLiMPCallback(suites={"tb": str(BLIMP)}, log_prefix="tb")
    with pytest.raises(ValueError, match="suite name 'tatblimp': it prefixes the suite's logged keys"):
        TatBLiMPCallback(suites={"tatblimp": str(BLIMP)}, log_prefix="tb")  # the default prefix of every other reader
    with pytest.raises(ValueError, match="suites= are scored by log-probs"):
        TatBLiMPCallback(suites={"blimp": str(BLIMP)}, protocol="forced-choice")
