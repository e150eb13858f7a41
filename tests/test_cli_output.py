"""What the commands print, as a new user reads it: no progress bar of transformers' loading, ``explain``'s header
wrapped at spaces to the terminal's width (a tokenizer built in memory, named by its kind: test_tokenization.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import DATA
from tatblimp_callback.cli import main
from tatblimp_callback.commands.explain import format_pair
from tatblimp_callback.results.metrics import PairResult
from tatblimp_callback.results.token_results import PairTokens


def test_score_prints_no_loading_bar(model_dir, capsys):
    assert main(["score", str(model_dir), "--data", str(DATA), "--device", "cpu", "--limit", "1"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"^overall\s+16\s", captured.out, re.M)
    assert "Loading weights" not in captured.err and "it/s" not in captured.err


def a_pair() -> tuple[PairResult, PairTokens]:
    good = ["Ки", "бет", "тә", " Алия", " икмәк", ",", " ә", " Булат", " сөт", " сатып", " алды", "."]
    bad = [*good[:7], " сөт", " Булат", *good[9:]]
    good_lp, bad_lp = [-1.25 - k / 10 for k in range(len(good))], [-1.5 - k / 10 for k in range(len(bad))]
    pair = PairResult(sum(good_lp), sum(bad_lp), len(good), len(bad), 60, 60, "ellipsis_gapping", "second_conjunct")
    return pair, PairTokens(good_lp, bad_lp, good, bad, {"good": [7, 9], "bad": [7, 9]})


def header_of(text: str) -> list[str]:
    lines = text.splitlines()
    return lines[: next(k for k, line in enumerate(lines) if line.startswith("good "))]


def test_explains_header_wraps_at_spaces_to_the_width():
    pair, tokens = a_pair()
    unwrapped = header_of(format_pair(313, pair, tokens, width=10_000))
    assert len(unwrapped) == 4 and unwrapped[3] == "(surprisal in bits under each token; [ ]: the edit)"
    assert re.fullmatch(r"margin [+-]\d\.\d{3} nats = before the edit .* \+ after it [+-]\d\.\d{3}", unwrapped[2])
    for width, lines in ((120, 4), (100, 4), (60, 5)):
        header = header_of(format_pair(313, pair, tokens, width=width))
        assert len(header) == lines and all(len(line) <= width for line in header), (width, header)
        # Broken at spaces only: joined again, the words are those of the unwrapped header.
        assert " ".join(line.strip() for line in header).split() == " ".join(unwrapped).split()


def test_output_files_go_into_folders_made_for_them(tmp_path, capsys):
    """--json, --markdown and --plot (matplotlib's savefig makes no folder) into folders that do not exist yet."""
    demo = Path(__file__).parent / "data" / "demo_history.jsonl"
    out = tmp_path / "new" / "deeper"
    arguments = ["--json", str(out / "c.json"), "--markdown", str(out / "m" / "c.md"), "--plot", str(out / "p" / "c.png")]
    assert main(["compare", f"{demo}@0", f"{demo}@2000", *arguments]) == 0, capsys.readouterr().err
    assert json.loads((out / "c.json").read_text(encoding="utf-8"))
    assert (out / "m" / "c.md").read_text(encoding="utf-8").startswith("## TatBLiMP comparison")
    assert (out / "p" / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
