"""``tatblimp sweep HUB_ID --revisions PATTERN``: a real huggingface_hub client against a local Hub (``hub_server``).

In this process the client is pointed at the server the way ``HF_ENDPOINT`` does when huggingface_hub is imported
(its constants), with offline mode off and a cache of the test's own; the tests in processes of their own (Ctrl-C
and a rerun, two torchrun processes) set the environment variables, as a user does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import tiny_llama
from hub_server import FakeHub
from tatblimp_callback import evaluate
from tatblimp_callback.cli import main
from tatblimp_callback.commands.revisions import plan_revisions, position
from tatblimp_callback.commands.sweep import SweepError, SweepOptions, sweep
from tatblimp_callback.results.runs import load_run

REPO = "org/tiny-series"
SEEDS = (0, 1, 2, 3, 4)
COMPARED = ("acc", "acc_norm", "bits_per_byte_good", "tokens_per_byte", "tokens", "bytes", "n")


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory, bpe_tokenizer, eos_only_tokenizer):
    """Tiny random Llamas (one a seed) saved with the tokenizer, as a revision's files are uploaded; ``eos4`` is
    seed 4 with another tokenizer (no BOS)."""
    root = tmp_path_factory.mktemp("models")
    for seed in SEEDS:
        tiny_llama(len(bpe_tokenizer), seed=seed).save_pretrained(root / f"seed{seed}")
        bpe_tokenizer.save_pretrained(root / f"seed{seed}")
    tiny_llama(len(eos_only_tokenizer), seed=4).save_pretrained(root / "eos4")
    eos_only_tokenizer.save_pretrained(root / "eos4")
    return root


@pytest.fixture(scope="module")
def expected(model_folders, bpe_tokenizer, eos_only_tokenizer, small_data):
    """Each model folder scored locally, by ``evaluate`` on the model loaded from it."""
    from transformers import AutoModelForCausalLM

    def score(folder, tokenizer):
        model = AutoModelForCausalLM.from_pretrained(model_folders / folder)
        return evaluate(model, tokenizer, small_data, allow_modified=True)

    return {**{seed: score(f"seed{seed}", bpe_tokenizer) for seed in SEEDS}, "eos4": score("eos4", eos_only_tokenizer)}


def serve(monkeypatch, endpoint: str, cache) -> None:
    """Point this process's huggingface_hub at ``endpoint``, online, with ``cache`` as its cache."""
    from huggingface_hub import constants

    import tatblimp_callback.reading.hub as hub

    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "_last", None)  # the probe's remembered answer, of another test's endpoint


@pytest.fixture
def hub(monkeypatch, tmp_path):
    server = FakeHub().start()
    serve(monkeypatch, server.endpoint, tmp_path / "hf-cache")
    monkeypatch.chdir(tmp_path)
    yield server
    server.stop()


def publish(server: FakeHub, folders, names: dict[str, int], repo: str = REPO) -> dict[str, str]:
    """Upload ``seed<N>`` as the commit of each name; ``{name: sha}``."""
    shas = {name: server.commit(repo, folders / f"seed{seed}") for name, seed in names.items()}
    for name, sha in shas.items():
        server.point(repo, name, sha)
    return shas


def options(small_data, **extra) -> SweepOptions:
    return SweepOptions(data=str(small_data), allow_modified=True, progress=False, device="cpu", **extra)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def assert_scores(record: dict, results) -> None:
    reference = results.to_dict()
    for key in COMPARED:
        assert record[key] == pytest.approx(reference[key], abs=1e-9), key
    assert record["outcomes"] == reference["outcomes"]


def test_names_give_steps_tokens_and_words():
    assert position("step0") == {"step": 0}
    assert position("step143000") == {"step": 143000}
    assert position("step1000-tokens4B") == {"step": 1000, "tokens": 4_000_000_000}
    assert position("stage1-step1000-tokens5B") == {"step": 1000, "tokens": 5_000_000_000}
    assert position("stage2-ingredient1-step11931-tokens50B") == {"step": 11931, "tokens": 50_000_000_000}
    assert position("chck_10M") == {"words": 10_000_000}
    assert position("chck_1000M") == {"words": 1_000_000_000}
    assert position("tokens2.5T") == {"tokens": 2_500_000_000_000}
    assert position("main") == {} and position("stage1") == {} and position("v1.0") == {}


def test_only_the_files_a_model_needs_are_asked_for():
    from tatblimp_callback.commands.revision_downloads import RevisionFilesError, needed_files

    listing = [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "consolidated.safetensors",
        "pytorch_model.bin",
        "optimizer.pt",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "modeling_custom.py",
        "README.md",
        "original/params.json",
    ]
    assert needed_files(listing) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert "modeling_custom.py" in needed_files(listing, trust_remote_code=True)
    older = ["config.json", "pytorch_model.bin", "tokenizer.json", "vocab.json", "merges.txt", "training_args.bin"]
    assert needed_files(older) == ["config.json", "merges.txt", "pytorch_model.bin", "tokenizer.json", "vocab.json"]
    with pytest.raises(RevisionFilesError, match="no weights file"):
        needed_files(["config.json", "tokenizer.json", "optimizer.pt"])


def test_a_plan_orders_by_the_axis_groups_commits_and_finds_reuploads():
    chosen = {"step2": "c2", "step10": "c10", "step1": "c1", "step143000": "cl", "main": "cl"}
    plan = plan_revisions(chosen, [], None)
    assert [(r.name, r.step, r.names) for r in plan.todo] == [
        ("step1", 1, ("step1",)),
        ("step2", 2, ("step2",)),
        ("step10", 10, ("step10",)),
        ("step143000", 143000, ("step143000", "main")),
    ]
    assert plan.axis == "step" and plan.duplicates == {"main": "step143000"}
    scored = [
        {"checkpoint": "step1", "commit": "c1", "revisions": ["step1"]},
        {"checkpoint": "step2", "commit": "old", "revisions": ["step2"]},
    ]
    again = plan_revisions(chosen, scored, None)
    assert [r.name for r in again.todo] == ["step2", "step10", "step143000"] and again.skipped == ["step1"]
    assert again.todo[0].replaces == {"step2": "old"}
    olmo = plan_revisions({"step1000-tokens4B": "a", "step2000-tokens9B": "b", "step500-tokens2B": "c"}, [], "tokens")
    assert [(r.step, r.axis) for r in olmo.todo] == [(2 * 10**9, "tokens"), (4 * 10**9, "tokens"), (9 * 10**9, "tokens")]
    with pytest.raises(SweepError, match=r"no step, tokens or words count in the name of main"):
        plan_revisions({"main": "x", "step1": "y"}, [], None)
    with pytest.raises(SweepError, match=r"no words count in the name of step1"):
        plan_revisions({"step1": "y"}, [], "words")
    with pytest.raises(SweepError, match=r"step7 and stage2-step7 are two commits at step 7"):
        plan_revisions({"step7": "a", "stage2-step7": "b"}, [], None)


def test_a_glob_scores_one_line_per_commit_in_order_equal_to_the_folders_scored_locally(
    hub, model_folders, expected, small_data, capsys, monkeypatch
):
    import tatblimp_callback.evaluation as evaluation

    builds = []
    original = evaluation.build_cache
    monkeypatch.setattr(evaluation, "build_cache", lambda *a, **k: builds.append(1) or original(*a, **k))
    # Pythia's names, main on the last step's commit, and branches the glob leaves out.
    shas = publish(hub, model_folders, {"step4": 3, "step0": 0, "step2": 2, "step1": 1, "main": 3, "other": 4})
    hub.point(REPO, "v1.0", shas["step0"], tag=True)
    code = main(["sweep", REPO, "--revisions", "step*,main", "--data", str(small_data), "--allow-modified", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"4 revision(s) scored, 0 already in {REPO.replace('/', '--')}.tatblimp.jsonl" in out
    assert "main: the same commit as step4, scored once" in out
    assert len(builds) == 1  # the same tokenizer files in every revision: tokenized once
    written = lines(hub_results())
    assert [(r["step"], r["checkpoint"], r["revisions"]) for r in written] == [
        (0, "step0", ["step0"]),
        (1, "step1", ["step1"]),
        (2, "step2", ["step2"]),
        (4, "step4", ["step4", "main"]),
    ]
    for record, seed in zip(written, (0, 1, 2, 3)):
        assert record["commit"] == shas[record["checkpoint"]] and record["model"] == REPO
        assert record["position"] == {"step": record["step"]} and record["x"] == "step"
        assert_scores(record, expected[seed])
    # Commits, not names: a sweep of the tag (on step0's commit) scores nothing new.
    again = sweep(REPO, options(small_data), revisions="v1.0,step*")
    assert again.scored == [] and sorted(again.skipped) == ["step0", "step1", "step2", "step4", "v1.0"]
    assert again.duplicates == {"v1.0": "step0"}
    # The file reads as a sweep for compare and the report, at a step.
    run = load_run(hub_results(), step=2)
    assert run.is_sweep and run.record["checkpoint"] == "step2" and run.label == REPO.replace("/", "--")
    capsys.readouterr()
    assert main(["compare", f"{hub_results()}@1", str(hub_results())]) == 0
    assert "org--tiny-series@1" in capsys.readouterr().out
    assert main(["report", str(hub_results()), "--output", "report.html"]) == 0
    assert "org--tiny-series" in Path("report.html").read_text(encoding="utf-8")


def hub_results(repo: str = REPO) -> Path:
    return Path(repo.replace("/", "--") + ".tatblimp.jsonl")


def test_olmo_and_babylm_names_are_placed_on_tokens_and_words(
    hub, model_folders, expected, small_data, monkeypatch, caplog, tmp_path
):
    import matplotlib.figure

    import tatblimp_callback.evaluation as evaluation
    from tatblimp_callback.commands.compare import plot_comparison

    olmo = "allenai/tiny-olmo"
    publish(hub, model_folders, {"stage1-step2000-tokens9B": 2, "stage1-step1000-tokens4B": 1, "stage2-step10-tokens1B": 0}, olmo)
    report = sweep(olmo, options(small_data, x="tokens"), revisions="stage1-*")
    assert report.scored == ["stage1-step1000-tokens4B", "stage1-step2000-tokens9B"]
    written = lines(hub_results(olmo))
    assert [(r["step"], r["x"], r["position"]) for r in written] == [
        (4 * 10**9, "tokens", {"step": 1000, "tokens": 4 * 10**9}),
        (9 * 10**9, "tokens", {"step": 2000, "tokens": 9 * 10**9}),
    ]
    assert_scores(written[1], expected[2])
    labels = []
    monkeypatch.setattr(matplotlib.figure.Figure, "supxlabel", lambda self, text, **kw: labels.append(text))
    plot_comparison([load_run(hub_results(olmo))], tmp_path / "olmo.png")
    assert labels == ["tokens"]  # the curves' axis counts tokens

    # BabyLM's words; chck_2M uploaded with other tokenizer files: tokenized for it, and said so.
    builds = []
    original = evaluation.build_cache
    monkeypatch.setattr(evaluation, "build_cache", lambda *a, **k: builds.append(1) or original(*a, **k))
    babylm = "babylm/tiny-submission"
    shas = publish(hub, model_folders, {"chck_10M": 2, "chck_1M": 1, "main": 2}, babylm)
    hub.point(babylm, "chck_2M", hub.commit(babylm, model_folders / "eos4"))
    with caplog.at_level("WARNING", logger="tatblimp_callback"):
        report = sweep(babylm, options(small_data, results="babylm.jsonl"), revisions="chck_*")
    written = lines(Path("babylm.jsonl"))
    assert [(r["checkpoint"], r["step"], r["x"]) for r in written] == [
        ("chck_1M", 10**6, "words"),
        ("chck_2M", 2 * 10**6, "words"),
        ("chck_10M", 10**7, "words"),
    ]
    assert written[2]["commit"] == shas["chck_10M"] and written[2]["revisions"] == ["chck_10M"]  # main not asked for
    assert_scores(written[1], expected["eos4"])
    assert_scores(written[2], expected[2])
    assert len(builds) == 2  # chck_10M has chck_1M's tokenizer files again: no third
    assert [r.getMessage() for r in caplog.records if "tokenizer files differ" in r.getMessage()] == [
        "tatblimp: chck_2M's tokenizer files differ from those of the revisions before it: its tokenizer is loaded "
        "and the benchmark tokenized again"
    ]
    assert report.acquisition.keys() == written[0]["phenomena"].keys()


def test_a_reupload_is_scored_again_and_a_broken_revision_is_named_while_the_sweep_goes_on(
    hub, model_folders, expected, small_data, capsys
):
    first = publish(hub, model_folders, {"step1": 1, "step2": 2})
    sweep(REPO, options(small_data), revisions="step*")
    # step2 re-uploaded with other weights; step3 uploaded without its weights; step4 with a damaged weights file.
    second = hub.commit(REPO, model_folders / "seed4")
    hub.point(REPO, "step2", second)
    files = {p.name: p.read_bytes() for p in (model_folders / "seed3").iterdir()}
    hub.point(REPO, "step3", hub.commit(REPO, {k: v for k, v in files.items() if k != "model.safetensors"}))
    hub.point(REPO, "step4", hub.commit(REPO, {**files, "model.safetensors": b"\xff" * 64}))
    hub.point(REPO, "step5", hub.commit(REPO, model_folders / "seed0"))
    code = main(["sweep", REPO, "--revisions", "step*", "--data", str(small_data), "--allow-modified", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 1
    assert "2 revision(s) scored, 1 already in" in captured.out and ", 2 failed" in captured.out
    assert f"step2: re-uploaded (was commit {first['step2'][:12]}), scored again" in captured.out
    assert (
        "step3: RevisionFilesError: no weights file (model.safetensors, pytorch_model.bin, ...): an incomplete upload?"
        in captured.err
    )
    assert "step4: OSError:" in captured.err and "model.safetensors: cannot be read" in captured.err
    assert "2 revision(s) could not be scored: step3, step4" in captured.err
    written = lines(hub_results())
    assert [(r["checkpoint"], r["commit"]) for r in written] == [
        ("step1", first["step1"]),
        ("step2", first["step2"]),
        ("step2", second),
        ("step5", hub.refs[REPO]["step5"]),
    ]
    assert written[2]["replaces"] == {"step2": first["step2"]} and "replaces" not in written[1]
    assert_scores(written[2], expected[4])
    assert_scores(written[3], expected[0])
    failures = lines(hub_results().with_name(REPO.replace("/", "--") + ".tatblimp-failures.jsonl"))
    assert [(f["revision"], f["commit"], f["step"]) for f in failures] == [
        ("step3", hub.refs[REPO]["step3"], 3),
        ("step4", hub.refs[REPO]["step4"], 4),
    ]
    # The replaced line is kept in the file, but leaves the curve: compare and the report read step2 once.
    run = load_run(hub_results())
    assert [(r["checkpoint"], r["commit"]) for r in run.records] == [
        ("step1", first["step1"]),
        ("step2", second),
        ("step5", hub.refs[REPO]["step5"]),
    ]


def test_only_the_needed_files_are_fetched_the_next_while_one_is_scored_and_none_kept(
    hub, model_folders, expected, small_data, monkeypatch, tmp_path
):
    from tatblimp_callback.commands.checkpoint_scoring import CheckpointScorer

    extra = {"optimizer.pt": b"\0" * 4096, "README.md": b"# card", "training_args.bin": b"\1" * 64}
    shas = {}
    for name, seed in (("step1", 1), ("step2", 2), ("step3", 3)):
        files = {p.name: p.read_bytes() for p in (model_folders / f"seed{seed}").iterdir()}
        shas[name] = hub.commit(REPO, {**files, **extra, "pytorch_model.bin": b"\2" * 128})
        hub.point(REPO, name, shas[name])
    prefetched = []
    score = CheckpointScorer.score

    def score_watching_the_next_download(self, revision):
        following = {"step1": "step2", "step2": "step3"}.get(revision.name)
        if following:  # while this one is scored, the next one's weights arrive
            deadline = time.monotonic() + 30
            while (shas[following], "model.safetensors") not in hub.files_fetched(REPO) and time.monotonic() < deadline:
                time.sleep(0.02)
            prefetched.append((shas[following], "model.safetensors") in hub.files_fetched(REPO))
        return score(self, revision)

    monkeypatch.setattr(CheckpointScorer, "score", score_watching_the_next_download)
    report = sweep(REPO, options(small_data, keep_downloads=False), revisions="step*")
    assert report.scored == ["step1", "step2", "step3"] and prefetched == [True, True]
    fetched = {}
    for sha, name in hub.files_fetched(REPO):
        fetched.setdefault(sha, []).append(name)
    needed = sorted(p.name for p in (model_folders / "seed1").iterdir())
    assert {sha: sorted(names) for sha, names in fetched.items()} == {sha: needed for sha in shas.values()}
    assert "model.safetensors" in needed and "config.json" in needed and "tokenizer.json" in needed
    # Deleted once scored: nothing left beside the results, nothing in the cache.
    downloads = tmp_path / ".tatblimp-downloads"
    assert [p for p in downloads.rglob("*") if p.is_file()] == []
    assert not list((tmp_path / "hf-cache").glob("models--*/snapshots/*"))
    for record, seed in zip(lines(hub_results()), (1, 2, 3)):
        assert_scores(record, expected[seed])


def test_a_series_in_the_cache_is_swept_offline_from_the_cache(hub, model_folders, expected, small_data, monkeypatch):
    from huggingface_hub import constants, snapshot_download

    shas = publish(hub, model_folders, {"step10": 1, "step20": 2, "step30": 3})
    for name in ("step10", "step30"):  # downloaded earlier, by name, as from_pretrained(revision=...) does
        snapshot_download(REPO, revision=name)
    hub.stop()
    asked = len(hub.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    report = sweep(REPO, options(small_data), revisions="step*")
    assert report.scored == ["step10", "step30"] and len(hub.requests) == asked  # the Hub was not asked
    written = lines(hub_results())
    assert [(r["checkpoint"], r["commit"]) for r in written] == [("step10", shas["step10"]), ("step30", shas["step30"])]
    assert_scores(written[0], expected[1])
    assert_scores(written[1], expected[3])
    # A revision the cache lacks is named as such when asked for by name.
    with pytest.raises(SweepError, match=r"no revision named 'step20'"):
        sweep(REPO, options(small_data), revisions="step20")
    # Offline, --keep-downloads no deletes each revision from the cache once it is scored.
    report = sweep(REPO, options(small_data, keep_downloads=False, results="again.jsonl"), revisions="step*")
    assert report.scored == ["step10", "step30"] and [r["acc_norm"] for r in lines(Path("again.jsonl"))] == [
        r["acc_norm"] for r in written
    ]
    assert not list(Path(constants.HF_HUB_CACHE).glob("models--*/snapshots/*"))


def test_the_hub_probe_asks_a_custom_endpoint_once_and_says_when_it_is_gone(hub, monkeypatch):
    import tatblimp_callback.reading.hub as probe

    assert probe.hub_unreachable(timeout=2) is None
    assert probe.hub_unreachable(timeout=2) is None
    assert [r for r in hub.requests if r == ("HEAD", "/")] == [("HEAD", "/")]  # asked once, the answer remembered
    hub.stop()
    monkeypatch.setattr(probe, "_last", None)
    started = time.monotonic()
    reason = probe.hub_unreachable(timeout=2)
    assert reason is not None and "Connect" in reason and time.monotonic() - started < 2
    with pytest.raises(SweepError, match=r"org/tiny-series: the Hub could not be reached .* holds none of its revisions"):
        from tatblimp_callback.commands.revisions import list_revisions

        list_revisions(REPO)


# -- in processes of their own --------------------------------------------------------------------

PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
BIN = Path(sys.executable).parent
TIMEOUT = 300


@pytest.fixture
def server():
    hub = FakeHub().start()
    yield hub
    for event in hub.held.values():
        event.set()
    hub.stop()


def environment(server: FakeHub, tmp_path: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("TRANSFORMERS_OFFLINE", "HF_HUB_OFFLINE")}
    env.update(
        HF_ENDPOINT=server.endpoint,
        HF_HUB_OFFLINE="0",
        HF_HUB_CACHE=str(tmp_path / "hf-cache"),
        PYTHONPATH=PACKAGE_ROOT,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    return env


def sweep_arguments(small_data: Path, *extra: str) -> list[str]:
    return ["sweep", REPO, "--revisions", "step*", "--data", str(small_data), "--allow-modified", "--no-progress", *extra]


@pytest.mark.slow
def test_ctrl_c_then_a_rerun_scores_each_commit_once(server, model_folders, expected, small_data, tmp_path):
    shas = publish(server, model_folders, {f"step{seed}": seed for seed in (1, 2, 3)})
    server.held[shas["step2"]] = threading.Event()  # step2's download hangs until the test lets it go
    # A shell without job control starts background jobs with SIGINT ignored: the child puts Python's handler back.
    start = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); from tatblimp_callback.cli import main"
    python = [sys.executable, "-c", f"{start}; sys.exit(main(sys.argv[1:]))"]
    env = environment(server, tmp_path)
    process = subprocess.Popen(
        [*python, *sweep_arguments(small_data)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    results = tmp_path / hub_results()
    deadline = time.monotonic() + TIMEOUT
    while process.poll() is None and time.monotonic() < deadline:
        if results.exists() and len(lines(results)) == 1 and ("step2", "model.safetensors") in server.files_fetched(REPO):
            break
        time.sleep(0.1)
    assert process.poll() is None, process.communicate()[1][-3000:]
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)  # not held up by the download thread
    assert process.returncode == 130 and "tatblimp: interrupted" in err, err[-3000:]
    assert [r["checkpoint"] for r in lines(results)] == ["step1"]

    server.held[shas["step2"]].set()
    done = subprocess.run(
        [sys.executable, "-m", "tatblimp_callback", *sweep_arguments(small_data)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 revision(s) scored, 1 already in" in done.stdout
    written = lines(results)
    assert [(r["checkpoint"], r["commit"]) for r in written] == [(f"step{s}", shas[f"step{s}"]) for s in (1, 2, 3)]
    for record, seed in zip(written, (1, 2, 3)):
        assert_scores(record, expected[seed])


@pytest.mark.slow
def test_two_torchrun_processes_each_fetch_only_the_revisions_they_score(server, model_folders, expected, small_data, tmp_path):
    shas = publish(server, model_folders, {f"step{seed}": seed for seed in (1, 2, 3, 4)})
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "tatblimp_callback"]
    done = subprocess.run(
        [*torchrun, *sweep_arguments(small_data, "--keep-downloads", "no")],
        cwd=tmp_path,
        env=environment(server, tmp_path),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("revision(s) scored") == 1 and "4 revision(s) scored" in done.stdout
    written = lines(tmp_path / hub_results())
    assert [(r["checkpoint"], r["commit"]) for r in written] == [(f"step{s}", shas[f"step{s}"]) for s in (1, 2, 3, 4)]
    for record, seed in zip(written, (1, 2, 3, 4)):
        assert_scores(record, expected[seed])
    # Each revision's weights fetched once (into the folder of the process that scored it), and none left.
    weights = [sha for sha, name in server.files_fetched(REPO) if name == "model.safetensors"]
    assert sorted(weights) == sorted(shas.values())
    assert [p for p in (tmp_path / ".tatblimp-downloads").rglob("*") if p.is_file()] == []


@pytest.mark.slow
def test_revisions_on_vllm_equal_the_default_backend(server, bpe_tokenizer, small_data, tmp_path):
    from test_vllm import save_model, vllm_env, vllm_python

    python = vllm_python()  # skipped without vLLM's environment (except in CI)
    folders = {name: save_model(tmp_path / name, bpe_tokenizer, seed=seed) for name, seed in (("step1", 1), ("step2", 2))}
    for name, folder in folders.items():
        server.point(REPO, name, server.commit(REPO, folder))
    env = {**vllm_env(), **environment(server, tmp_path)}
    arguments = [*sweep_arguments(small_data, "--backend", "vllm"), "--include-pairs"]
    done = subprocess.run(
        [python, "-m", "tatblimp_callback", *arguments], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    written = lines(tmp_path / hub_results())
    assert [r["checkpoint"] for r in written] == ["step1", "step2"] and all(r["backend"] == "vllm" for r in written)
    from transformers import AutoModelForCausalLM

    for record, folder in zip(written, folders.values()):
        reference = evaluate(AutoModelForCausalLM.from_pretrained(folder), bpe_tokenizer, small_data, allow_modified=True)
        assert record["outcomes"] == reference.to_dict()["outcomes"]
        assert (record["acc"], record["acc_norm"]) == (reference.to_dict()["acc"], reference.to_dict()["acc_norm"])
