"""Reading never writes (``reading.jsonl``); the one writer (``results.records_file``) cuts a partial last line
off before it appends (#30: every torchrun rank of a sweep read, and cut, the results file)."""

from __future__ import annotations

import json
import logging

from tatblimp_callback.commands.sweep import read_records
from tatblimp_callback.reading.jsonl import read_complete_lines
from tatblimp_callback.results.records_file import _CHUNK, append_record, cut_partial_line

WHOLE = '{"checkpoint": "checkpoint-10", "step": 10, "acc": 0.5}\n{"checkpoint": "checkpoint-20", "step": 20, "acc": 0.6}\n'
BEING_WRITTEN = '{"checkpoint": "checkpoint-30", "st'


def test_reading_a_file_another_process_is_appending_to_leaves_it_alone(tmp_path, caplog):
    path = tmp_path / "tatblimp.jsonl"
    path.write_bytes((WHOLE + BEING_WRITTEN).encode())
    before = path.stat()
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_records(path)] == [10, 20]  # as every rank of a sweep reads it
        assert len(read_complete_lines(path)) == 2
    # Before: the partial line was cut off the file, under the feet of the process writing it.
    assert path.read_bytes() == (WHOLE + BEING_WRITTEN).encode() and path.stat().st_mtime_ns == before.st_mtime_ns
    assert "ends in a partial line" in caplog.text


def test_the_writer_cuts_a_partial_last_line_before_it_appends(tmp_path):
    path = tmp_path / "tatblimp.jsonl"
    path.write_bytes((WHOLE + BEING_WRITTEN).encode())
    append_record(path, {"checkpoint": "checkpoint-30", "step": 30, "acc": "\u2028"})
    lines = path.read_text(encoding="utf-8").split("\n")
    assert lines[:2] == WHOLE.split("\n")[:2] and json.loads(lines[2])["step"] == 30 and lines[3] == ""
    append_record(path, {"step": 40})  # a whole file: nothing cut
    assert [json.loads(line)["step"] for line in read_complete_lines(path)] == [10, 20, 30, 40]


def test_a_partial_line_longer_than_a_chunk_and_a_file_without_any_newline(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_bytes(WHOLE.encode() + b"x" * (3 * _CHUNK + 5))
    assert cut_partial_line(path) == 3 * _CHUNK + 5 and path.read_bytes() == WHOLE.encode()
    path.write_bytes(b"y" * (_CHUNK + 1))
    assert cut_partial_line(path) == _CHUNK + 1 and path.read_bytes() == b""
    assert cut_partial_line(tmp_path / "none.jsonl") == 0


def test_an_empty_file_has_no_partial_line_to_warn_of(tmp_path, caplog):
    """A history file emptied on purpose (a new run into the same output_dir) was warned of as "ended in a partial
    line (0 bytes, from an interrupted write)" at its first append."""
    path = tmp_path / "tatblimp_history.jsonl"
    path.write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        assert cut_partial_line(path) == 0
        append_record(path, {"step": 0})
    assert caplog.text == "" and [json.loads(line)["step"] for line in read_complete_lines(path)] == [0]
