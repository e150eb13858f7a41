"""What a new user gets wrong fails at once with a message that points the right way; output survives `| head`."""

from __future__ import annotations

import html
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DATA, tiny_llama
from tatblimp_callback import TatBLiMPCallback, evaluate
from tatblimp_callback.cli import build_parser, main
from tatblimp_callback.engine.scoring import ScoringError

TATBLIMP = str(Path(sys.executable).parent / "tatblimp")


def error_of(args, capsys) -> str:
    assert main(args) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err.split(": error: ", 1)[1].rstrip("\n")


def test_a_mistyped_path_fails_without_asking_the_hub(tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # as on a user's machine: the Hub would be asked, with retries
    asked = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *args, **kwargs: asked.append(args))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: asked.append(args))
    assert error_of(["score", "runs/nope", "--data", str(DATA)], capsys) == (
        "runs/nope: no such model folder (not taken as a Hub id: runs is a local folder)"
    )
    for name in ("./x", "../x", "a/b/c", "runs/x/checkpoint-40"):
        assert error_of(["score", name, "--data", str(DATA)], capsys).startswith(f"{name}: no such model folder")
    assert asked == []


@pytest.mark.slow
def test_a_mistyped_path_fails_at_once_in_a_real_process(tmp_path):
    """Before, `runs/nope` next to a folder `runs` spent 51 s in Hub retries; the bound here is far below that."""
    (tmp_path / "runs").mkdir()
    env = {key: value for key, value in __import__("os").environ.items() if key != "HF_HUB_OFFLINE"}
    done = subprocess.run(
        [TATBLIMP, "score", "runs/nope", "--data", str(DATA)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=40
    )
    assert done.returncode == 1
    assert (
        done.stderr == "tatblimp score: error: runs/nope: no such model folder (not taken as a Hub id: runs is a local folder)\n"
    )


def test_what_needs_no_model_is_checked_before_it_loads(model_dir, tmp_path, monkeypatch, capsys):
    import tatblimp_callback.commands.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    (tmp_path / "a-file").write_text("")
    model = ["score", str(model_dir)]
    assert error_of([*model, "--data", str(tmp_path / "nope.jsonl")], capsys).startswith(
        f"{tmp_path / 'nope.jsonl'}: cannot read the benchmark file"
    )
    assert error_of([*model, "--output", str(tmp_path / "a-file" / "r.json")], capsys) == (
        f"--output {tmp_path / 'a-file' / 'r.json'}: {tmp_path / 'a-file'} is a file, not a folder"
    )
    assert error_of([*model, "--output", str(tmp_path)], capsys) == f"--output {tmp_path}: a folder; give a file name"
    assert (
        error_of([*model, "--data", str(DATA), "--tokenizer", str(tmp_path / "tok")], capsys)
        == f"{tmp_path / 'tok'}: no such tokenizer folder"
    )
    assert error_of([*model, "--data", str(DATA), "--phenomena", "binding,nope"], capsys).startswith(
        f"{DATA}: no phenomenon nope"
    )


def test_score_names_a_damaged_weights_file(model_dir, tmp_path, capsys):
    damaged = shutil.copytree(model_dir, tmp_path / "checkpoint-40")
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    assert error_of(["score", str(damaged), "--data", str(DATA)], capsys).startswith(
        f"{weights}: cannot be read, the weights file is damaged or incomplete ("
    )
    weights.write_bytes(b"\xff" * 64)  # a header length that makes no sense
    assert error_of(["score", str(damaged), "--data", str(DATA)], capsys).startswith(
        f"{weights}: cannot be read, the weights file is damaged or incomplete ("
    )


def test_verbose_works_after_the_command_and_each_command_lists_it(tmp_path, capsys, caplog):
    parser = build_parser()
    assert parser.parse_args(["score", "m", "-v"]).verbose and parser.parse_args(["-v", "score", "m"]).verbose
    assert not parser.parse_args(["score", "m"]).verbose
    assert parser.parse_args(["sweep", "r", "--verbose"]).verbose and parser.parse_args(["compare", "a", "-v"]).verbose
    for command in ("score", "sweep", "compare"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "-v, --verbose" in capsys.readouterr().out
    assert main(["score", str(tmp_path / "nope"), "--data", str(DATA), "-v"]) == 1
    assert "tatblimp score failed\nTraceback" in caplog.text  # -v after the command took effect: the traceback is logged


def test_version(capsys):
    from tatblimp_callback import __version__

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"tatblimp {__version__}\n"


@pytest.mark.parametrize("eval_steps", [None, "500", 0, -3, 1.5, True])
def test_eval_steps_that_are_neither_steps_nor_a_fraction_are_refused(eval_steps):
    with pytest.raises(ValueError, match=r"eval_steps must be a number of steps .* or a fraction of the run's total steps"):
        TatBLiMPCallback(eval_steps=eval_steps)


def test_a_prefix_token_past_the_vocabulary_is_named_as_such(bpe_tokenizer, small_data):
    model = tiny_llama(len(bpe_tokenizer))
    with pytest.raises(ScoringError) as raised:
        evaluate(model, bpe_tokenizer, small_data, allow_modified=True, prefix_token_id=99999)
    assert str(raised.value) == (
        f"prefix token id 99999 is not a token of the model (its embedding has {len(bpe_tokenizer)} rows); pass a "
        "prefix_token_id below that (tatblimp: --prefix-token-id), or none for the tokenizer's BOS/EOS"
    )


def test_compare_says_it_takes_log_prob_results_for_a_forced_choice_file(model_dir, chat_tokenizer, tmp_path, capsys):
    chat = shutil.copytree(model_dir, tmp_path / "chat")
    chat_tokenizer.save_pretrained(chat)
    result = tmp_path / "fc.json"
    args = ["--data", str(DATA), "--device", "cpu", "--limit", "1", "--output", str(result)]
    assert main(["score", str(chat), "--protocol", "forced-choice", *args]) == 0
    capsys.readouterr()
    assert error_of(["compare", str(result)], capsys) == (
        f"{result}: a forced-choice result (score --protocol forced-choice); compare takes log-prob results "
        "(score --output without --protocol, sweep and callback history lines)"
    )


@pytest.fixture(scope="module")
def results_files(model_dir, bpe_tokenizer, tmp_path_factory):
    """A two-line sweep file and one score --output file, all of two phenomena, 3 pairs each."""
    folder = tmp_path_factory.mktemp("results")
    other = folder / "other-model"
    tiny_llama(len(bpe_tokenizer), seed=1).save_pretrained(other)
    bpe_tokenizer.save_pretrained(other)
    common = ["--data", str(DATA), "--device", "cpu", "--limit", "3", "--phenomena", "binding,passives"]
    records = []
    for model, name in ((model_dir, "a.json"), (other, "b.json")):
        assert main(["score", str(model), *common, "--output", str(folder / name)]) == 0
        records.append(json.loads((folder / name).read_text()))
    sweep = folder / "run" / "tatblimp.jsonl"
    sweep.parent.mkdir()
    sweep.write_text("".join(json.dumps({"step": step, **r}) + "\n" for step, r in zip((10, 20), records)))
    return sweep, folder / "b.json"


@pytest.mark.slow
def test_output_piped_into_head_writes_every_file_and_is_not_an_error(results_files, tmp_path):
    sweep, single = results_files
    out = tmp_path / "out"
    command = (
        f"set -o pipefail; {TATBLIMP} compare {sweep} {single} --json {out}/c.json --markdown {out}/c.md --plot {out}/c.png"
        " | head -n 0"  # head exits at once: every line the command prints meets a closed pipe
    )
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == ""
    assert json.loads((out / "c.json").read_text())["runs"][0]["label"] == "run"
    assert (out / "c.md").read_text().startswith("## TatBLiMP comparison")
    assert (out / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_missing_matplotlib_is_reported_before_the_tables(results_files, tmp_path, monkeypatch, capsys):
    sweep, single = results_files
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["compare", str(sweep), str(single), "--plot", str(tmp_path / "c.png"), "--json", str(tmp_path / "c.json")]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and not (tmp_path / "c.json").exists()
    assert captured.err == "tatblimp compare: error: plotting needs matplotlib: pip install 'tatblimp-callback[plot]'\n"


def test_a_plot_path_that_is_no_image_name_is_refused_before_any_file(results_files, tmp_path, capsys):
    """``--plot out/curves`` wrote ``out/curves.png`` (exit 0), and ``--plot out/curves.txt`` failed after ``--json``
    was written."""
    pytest.importorskip("matplotlib")
    sweep, _ = results_files
    for name in ("curves", "curves.txt"):
        plot, written = tmp_path / name, tmp_path / "c.json"
        assert error_of(["compare", str(sweep), "--plot", str(plot), "--json", str(written)], capsys).startswith(
            f"--plot {plot}: not an image file name; end it in .png, .svg or .pdf ("
        )
        assert not written.exists() and not plot.exists() and not (tmp_path / "curves.png").exists()
    assert main(["compare", str(sweep), "--plot", str(tmp_path / "curves.svg")]) == 0
    assert (tmp_path / "curves.svg").read_text().lstrip().startswith("<?xml")


def test_compare_refuses_pairing_results_of_different_selections(results_files, tmp_path, capsys):
    _, single = results_files
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps({**json.loads(single.read_text()), "selection": None}))
    selection = "first 3 pairs of each phenomenon; phenomena binding,passives (6 of 1248 pairs)"
    assert error_of(["compare", str(single), str(whole)], capsys) == (
        f"the results cover different pairs (b: {selection}, whole: all pairs); they cannot be compared pair by pair "
        "(--no-paired shows them side by side)"
    )
    assert main(["compare", str(single), str(whole), "--no-paired"]) == 0
    assert (  # side by side: said to be over other pairs (only another file was noted)
        f"note: the runs were scored on different pairs of the file (b: {selection}; whole: all pairs); side by side only"
        in capsys.readouterr().out
    )
    # The report's header named the first run's benchmark for every run.
    other = tmp_path / "other.json"
    record = json.loads(single.read_text())
    other.write_text(json.dumps({**record, "benchmark": {**record["benchmark"], "release": "modified (md5 0123)"}}))
    assert main(["report", str(single), str(other), "--no-paired", "--output", str(tmp_path / "r.html")]) == 0
    header = (tmp_path / "r.html").read_text(encoding="utf-8").split('<div class="meta">', 1)[1].split(" · ")[0]
    assert html.unescape(header) == (
        f"the runs' benchmarks differ: b: {record['benchmark']['release']}; other: modified (md5 0123)"
    )


def test_options_that_would_do_nothing_are_refused(model_dir, results_files, tmp_path, monkeypatch, capsys):
    """Each of these was ignored: the command ran as if it were not given."""
    import tatblimp_callback.commands.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    model = ["score", str(model_dir), "--data", str(DATA)]
    assert error_of([*model, "--revision", "v2"], capsys) == (
        f"--revision v2: {model_dir} is a local folder, one version; --revision picks a Hub model's branch, tag or commit"
    )
    assert error_of([*model, "--columns", "good=a,bad=b"], capsys) == (
        "--columns 'good=a,bad=b': where a --suite file's fields are; no --suite NAME=PATH is given"
    )
    sweep, single = results_files
    assert error_of(["compare", str(single), f"{sweep}@10", "--data", str(DATA)], capsys) == (
        f"--data {DATA}: the benchmark file of --flips' sentences and --json's pair numbers; neither is given"
    )
    assert error_of(["report", str(single), "--steps", "10", "20", "--output", str(tmp_path / "r.html")], capsys) == (
        "--steps: two steps of a sweep's; none of the results is a sweep (a score file holds one evaluation)"
    )
    report = ["report", str(single), "--output", str(tmp_path / "r.html")]
    assert error_of([*report, "--device", "cpu", "--dtype", "bfloat16", "--data", str(DATA)], capsys) == (
        "--device, --dtype: options of --model (the model that scores the pairs shown); no --model is given"
    )
    assert not (tmp_path / "r.html").exists()
    assert main(["report", str(single), str(sweep), "--steps", "10", "20", "--output", str(tmp_path / "r.html")]) == 0


def test_flipped_pairs_of_a_selection_are_named_by_their_index_in_the_file(results_files, tmp_path, capsys):
    """``--limit 3 --phenomena binding,passives``: compare and report named the pairs by their place among the 6
    scored (#0 binding), which ``explain --pair 0`` reads as the file's first pair (anaphor_agreement)."""
    import re

    _, single = results_files
    first = single.with_name("a.json")
    pairs = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    selected = [k for name in ("binding", "passives") for k in [k for k, p in enumerate(pairs) if p["phenomenon"] == name][:3]]
    assert main(["compare", str(first), str(single), "--flips", "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    shown = re.findall(r"    #(\d+)  (\w+)\n      good: (.*)\n", out)
    assert shown and {int(n) for n, _, _ in shown} <= set(selected)
    assert all(pairs[int(n)]["phenomenon"] == name and pairs[int(n)]["good"] == good for n, name, good in shown)
    written = json.loads((tmp_path / "c.json").read_text())
    listed = {n for entry in written["paired"] for key in ("baseline_only_pairs", "run_only_pairs") for n in entry[key]}
    assert listed == {int(n) for n, _, _ in shown} and "pair_numbers" not in written
    assert main(["report", str(first), str(single), "--output", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert {int(n) for n in re.findall(r'<li data-pair="(\d+)">', page)} == listed
    # The benchmark file gone: the places among the pairs scored, marked as such.
    for path in (first, single):
        record = json.loads(path.read_text())
        record["benchmark"]["source"] = str(tmp_path / "moved.jsonl")
        (tmp_path / path.name).write_text(json.dumps(record))
    assert main(["compare", str(tmp_path / first.name), str(tmp_path / single.name), "--flips"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"    #@(\d+)  \w+\n", out) and not re.findall(r"    #\d+  ", out)
    assert "(#@N: the pair's place among those scored, a selection of the file's; pass --data for the file's #N)" in out
