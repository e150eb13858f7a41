"""Fuzzing the loader: any bytes end in a valid benchmark or a ``BenchmarkError`` naming file and line."""

from __future__ import annotations

import json
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tatblimp_callback import BenchmarkError
from tatblimp_callback.reading.data import load_benchmark, parse_pairs

NAME = "fuzz.jsonl"
FIELDS = ["good", "bad", "phenomenon", "subtype", "sentence_good", "sentence_bad", "UID", "linguistics_term"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
# Mostly well-formed records with arbitrary values in the fields that matter, so that many
# files get past the first line and into the field checks.
records = st.dictionaries(st.sampled_from(FIELDS), json_values | st.text(min_size=1, max_size=20), min_size=2, max_size=6)
lines = st.one_of(
    json_values.map(lambda v: json.dumps(v, ensure_ascii=False)),
    records.map(lambda r: json.dumps(r, ensure_ascii=False)),
    records.map(json.dumps),  # \u escapes, lone surrogates included
    st.text(max_size=30),
)
# Hand-picked troublemakers: separators that str.splitlines() splits on but JSONL does not,
# deep nesting, huge integers, escaped lone surrogates, a byte-order mark, CRLF.
nasty = st.sampled_from(
    [
        b'{"good": "a\xe2\x80\xa8b", "bad": "b\xc2\x85a", "phenomenon": "p\x0cq"}',
        b"[" * 5000,
        b'{"good": ' + b"9" * 5000 + b"}",
        b'{"good": "\\ud800", "bad": "x", "phenomenon": "p"}',
        b'\xef\xbb\xbf{"good": "a", "bad": "b", "phenomenon": "p"}',
        b'{"good": "a", "bad": "b", "phenomenon": "p"}\r',
        b'{"good": NaN, "bad": Infinity, "phenomenon": "p"}',
        b"\x00",
    ]
)
files = st.lists(lines.map(lambda s: s.encode("utf-8", "surrogatepass")) | nasty, min_size=1, max_size=5).map(b"\n".join)

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check(raw: bytes) -> None:
    """``parse_pairs`` returns pairs or raises a ``BenchmarkError`` that names the file and a real line."""
    try:
        pairs = parse_pairs(raw, NAME)
    except BenchmarkError as err:
        message = str(err)
        assert message.startswith(f"{NAME}:"), message
        match = re.match(rf"{re.escape(NAME)}:(\d+): ", message)
        if match:
            number = int(match.group(1))
            file_lines = raw.split(b"\n")
            assert 1 <= number <= len(file_lines), message
            named = file_lines[number - 1]
            if "not UTF-8" in message:  # decoding comes first, for the whole file
                assert _not_utf8(named), message
            else:
                # Every line before the one named is fine, and the one named is not.
                if number > 1:
                    parse_pairs(b"\n".join(file_lines[: number - 1]), NAME)
                assert not _line_ok(named), message
        return
    # A valid file: one pair per line, every text usable as UTF-8.
    assert len(pairs) == len(raw.rstrip(b"\r\n").split(b"\n"))
    for pair in pairs:
        for text in (pair.good, pair.bad, pair.phenomenon, pair.subtype or "x"):
            assert isinstance(text, str) and text.strip()
            text.encode("utf-8")
        assert pair.good != pair.bad


def _not_utf8(line: bytes) -> bool:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _line_ok(line: bytes) -> bool:
    try:
        parse_pairs(line, NAME)
    except BenchmarkError:
        return False
    return True


@FAST
@given(st.binary(max_size=200))
def test_arbitrary_bytes(raw):
    check(raw)


@FAST
@given(files)
def test_arbitrary_json_lines(raw):
    check(raw)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files)
def test_files_on_disk_name_their_path(tmp_path, raw):
    path = tmp_path / "data.jsonl"
    path.write_bytes(raw)
    try:
        benchmark = load_benchmark(path, allow_modified=True)
    except BenchmarkError as err:
        assert str(err).startswith(f"{path}:"), str(err)
    else:
        assert benchmark.source == str(path) and len(benchmark) >= 1


def test_the_nasty_cases_by_hand():
    # A JSON string may hold U+2028 or U+0085 (str.splitlines() splits there); JSON Lines splits on "\n" only.
    pairs = parse_pairs(
        b'{"good": "a\xe2\x80\xa8b", "bad": "b\xc2\x85a", "phenomenon": "p"}\n{"good": "c", "bad": "d", "phenomenon": "p"}', NAME
    )
    assert [(p.good, p.bad) for p in pairs] == [("a\u2028b", "b\x85a"), ("c", "d")]
    cases = {
        b"[" * 5000: r"fuzz.jsonl:1: invalid JSON \(nested too deeply\)",
        b'{"good": ' + b"9" * 5000 + b"}": r"fuzz.jsonl:1: invalid JSON \(.*digits",
        b'{"good": "a", "bad": "b", "phenomenon": "p"}\n{"good": "\\ud800", "bad": "x", "phenomenon": "p"}': r"fuzz.jsonl:2: field 'good' is not valid Unicode",
        b'{"good": "a", "bad": "b", "phenomenon": "p"}\n\xef\xbb\xbf{}': r"fuzz.jsonl:2: invalid JSON",
    }
    for raw, pattern in cases.items():
        try:
            parse_pairs(raw, NAME)
        except BenchmarkError as err:
            assert re.match(pattern, str(err)), str(err)
        else:
            raise AssertionError(f"{raw[:40]!r} was accepted")
