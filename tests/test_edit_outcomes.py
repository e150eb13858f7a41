"""Outcomes split by how the tokenizer cut the edit: every results record carries each pair's alignment and length
sign, and ``compare`` and the report split acc and acc_norm by them, with Wilson intervals and Fisher's test, checked
against a computation from the per-pair list; a sweep's acquisition steps of aligned and unaligned pairs."""

from __future__ import annotations

import json
import math

import pytest
from scipy.stats import fisher_exact, norm

from conftest import DATA
from tatblimp_callback.cli import main
from tatblimp_callback.reports.report import build_report
from tatblimp_callback.results.edit_outcomes import split_acquisition, split_by_edit
from tatblimp_callback.results.runs import load_runs


def wilson(k: int, n: int) -> tuple[float, float]:
    z = norm.ppf(0.975)
    centre = (k + z * z / 2) / (n + z * z)
    half = z / (n + z * z) * math.sqrt(k * (n - k) / n + z * z / 4)
    return centre - half, centre + half


@pytest.fixture(scope="module")
def scored(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("scored")
    out, figures = folder / "run.json", folder / "figures.json"
    assert main(["score", str(model_dir), "--data", str(DATA), "--output", str(out), "--device", "cpu"]) == 0
    assert main(["tokenizers", str(model_dir), "--data", str(DATA), "--output", str(figures), "--include-pairs"]) == 0
    return out, json.loads(out.read_text(encoding="utf-8")), json.loads(figures.read_text(encoding="utf-8"))


def test_each_record_carries_the_alignment_the_tokenizers_command_gives(scored):
    _, record, figures = scored
    per_pair = figures["suites"]["tatblimp"][0]["pairs"]
    assert record["edit_tokens"]["aligned"] == "".join("1" if p["aligned"] else "0" for p in per_pair)
    signs = {1: "+", 0: "0", -1: "-"}
    assert record["edit_tokens"]["length_sign"] == "".join(
        signs[(d > 0) - (d < 0)] for d in (p["token_difference"] for p in per_pair)
    )
    first = record["pairs"][0]
    assert first["edit_chars"] == {"good": [27, 28], "bad": [27, 28], "good_text": "м", "bad_text": "ң"}
    assert first["critical_region"]["good_text"] == "үземне" and first["edit_aligned"] is (per_pair[0]["aligned"])


def test_the_split_equals_a_count_over_the_pairs(scored):
    _, record, _ = scored
    splits = split_by_edit(record)
    pairs = record["pairs"]
    tested = 0
    for split, member in (("alignment", lambda p: p["edit_aligned"]), ("length", lambda p: p["bad_tokens"] > p["good_tokens"])):
        for metric, key in (("acc", "passed"), ("acc_norm", "passed_norm")):
            for name in (None, "passives"):
                chosen = [p for p in pairs if name is None or p["phenomenon"] == name]
                inside = [p[key] for p in chosen if member(p)]
                outside = [p[key] for p in chosen if not member(p)]
                row = splits[split][metric]["overall" if name is None else "phenomena"]
                row = row if name is None else row[name]
                assert (row["in"]["n"], row["in"]["passed"]) == (len(inside), sum(inside))
                assert (row["out"]["n"], row["out"]["passed"]) == (len(outside), sum(outside))
                assert row["in"]["ci"] == pytest.approx(wilson(sum(inside), len(inside)), abs=1e-12)
                if min(len(inside), len(outside)) < 5:  # too few to test
                    assert row["p_value"] is None and row["difference"] is None
                    continue
                tested += 1
                table = [[sum(inside), len(inside) - sum(inside)], [sum(outside), len(outside) - sum(outside)]]
                assert row["p_value"] == pytest.approx(fisher_exact(table).pvalue, rel=1e-12)
                assert row["difference"] == pytest.approx(sum(inside) / len(inside) - sum(outside) / len(outside))
    assert tested >= 4


def test_compare_and_the_report_show_the_split_with_intervals(scored, tmp_path, capsys):
    path, record, figures = scored
    out_json, out_md = tmp_path / "c.json", tmp_path / "c.md"
    assert main(["compare", str(path), "--json", str(out_json), "--markdown", str(out_md)]) == 0
    by_edit = json.loads(out_json.read_text())["by_edit"]
    assert by_edit[next(iter(by_edit))]["splits"] == split_by_edit(record)
    aligned = split_by_edit(record)["alignment"]["acc_norm"]["overall"]["in"]
    cell = f"{aligned['acc']:.3f} [{aligned['ci'][0]:.3f}, {aligned['ci'][1]:.3f}] ({aligned['n']})"
    terminal = capsys.readouterr().out
    assert cell in out_md.read_text() and cell in terminal
    # On the terminal the split is a fixed-width table as the others are, not a Markdown one among them.
    assert not [line for line in terminal.splitlines() if line.lstrip().startswith("|")]
    split = terminal.split(f"{next(iter(by_edit))}: acc and acc_norm by alignment")[1].split("\n\n")[0].splitlines()
    assert split[1].split() == ["group", "metric", "aligned", "unaligned", "difference", "p", "(Fisher)"]
    assert set(split[2]) == {"-"} and len(split[2]) == max(map(len, split[3:]))
    assert sorted(line.split()[1] for line in split[3:]) == ["acc", "acc_norm"]
    assert {line.split()[0] for line in split[3:]} == {"overall"}  # the phenomena: in --markdown and --json
    html = build_report(load_runs([str(path)]))
    assert "Outcomes by how the tokenizer cut the edit" in html and cell in html
    overall = figures["suites"]["tatblimp"][0]
    assert "How each tokenizer cuts the edit" in html and f"<td>{overall['edit_aligned']:.1%}</td>" in html


def test_a_sweep_gives_the_acquisition_step_of_aligned_and_unaligned_pairs():
    aligned = "1100" * 5  # 10 aligned pairs, 10 not
    steps = {  # step -> acc_norm outcomes: the aligned pairs are learned at step 20, the others at 30
        10: "0000" * 5,
        20: "1100" * 5,
        30: "1111" * 5,
    }
    records = [
        {
            "step": step,
            "acc": text.count("1") / 20,
            "acc_norm": text.count("1") / 20,
            "outcomes": {"acc": text, "acc_norm": text, "phenomenon_runs": [["x", 20]]},
            "edit_tokens": {"aligned": aligned, "length_sign": "0" * 20},
        }
        for step, text in steps.items()
    ]
    found = split_acquisition(records)
    assert (found["aligned_step"], found["unaligned_step"]) == (20, 30)
    assert found["curve"] == [[10, 0.0, 0.0], [20, 1.0, 0.0], [30, 1.0, 1.0]]
    assert split_acquisition([{**records[0], "edit_tokens": {"aligned": None, "length_sign": "0" * 20}}]) is None


def test_a_tokenizer_without_offsets_scores_as_before_with_no_split(small_data):
    """A custom tokenizer (ids only, no character offsets): the cache and results have no alignment, and no split."""
    import numpy as np

    from tatblimp_callback.reading.data import load_benchmark
    from tatblimp_callback.results.metrics import compute_results
    from tatblimp_callback.tokenized.cache import build_cache

    class CharTokenizer:
        bos_token_id, eos_token_id, name_or_path = 0, None, "chars"

        def encode_batch(self, texts):
            return [[1 + ord(c) % 500 for c in text] for text in texts]

        def get_vocab(self):
            return {str(i): i for i in range(501)}

    benchmark = load_benchmark(small_data, allow_modified=True)
    cache = build_cache(CharTokenizer(), benchmark)
    assert cache.edit_aligned == ""
    record = compute_results(cache, np.zeros(cache.num_sentences)).to_dict()
    assert record["edit_tokens"]["aligned"] is None and len(record["edit_tokens"]["length_sign"]) == len(benchmark)
    assert record["pairs"][0]["edit_aligned"] is None and record["pairs"][0]["critical_region"]["good_text"]
    assert split_by_edit(record) is None
