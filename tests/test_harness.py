"""lm-evaluation-harness both ways, with the real harness (offline) and tiny models:

- the shipped TatBLiMP task run by the harness's own ``hf`` model equals ``tatblimp score``, overall, per phenomenon
  and pair by pair;
- ``--model tatblimp`` gives every request the log-prob of ``--model hf`` (within 1e-4 nats) and the same
  ``is_greedy``, on BLiMP, a multiple-choice task with shared contexts, rolling log-likelihoods, and hand-made
  requests whose continuations are the model's greedy tokens.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from conftest import CORPUS, DATA, tiny_llama

lm_eval = pytest.importorskip("lm_eval")
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from tatblimp_callback.harness import register, task_path  # noqa: E402

TatBLiMPLM = register()


@pytest.fixture(autouse=True)
def tatblimp_data(monkeypatch):
    monkeypatch.setenv("TATBLIMP_DATA", str(DATA))


def samples_by_task(out: dict) -> dict[str, list[dict]]:
    return {task: sorted(samples, key=lambda s: s["doc_id"]) for task, samples in out["samples"].items()}


@pytest.mark.slow
def test_harness_task_equals_tatblimp_score(model_dir, tmp_path):
    """``lm_eval --tasks tatblimp`` with ``--model hf`` gives ``tatblimp score``'s numbers, pair decisions included."""
    scored = tmp_path / "score.json"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    subprocess.run(
        [sys.executable, "-m", "tatblimp_callback", "score", str(model_dir), "--data", str(DATA), "--output", str(scored)],
        check=True,
        env=env,
        capture_output=True,
    )
    ours = json.loads(scored.read_text())
    out = simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir},dtype=float32",
        tasks=["tatblimp"],
        task_manager=TaskManager(include_path=str(task_path()), include_defaults=False),
        log_samples=True,
        device="cpu",
    )
    overall = out["results"]["tatblimp"]
    assert overall["acc,none"] == pytest.approx(ours["acc"], abs=1e-12)
    assert overall["acc_norm,none"] == pytest.approx(ours["acc_norm"], abs=1e-12)
    assert len(ours["phenomena"]) == 16
    decided = 0
    for name, group in ours["phenomena"].items():
        task = out["results"][f"tatblimp_{name}"]
        assert task["acc,none"] == pytest.approx(group["acc"], abs=1e-12), name
        assert task["acc_norm,none"] == pytest.approx(group["acc_norm"], abs=1e-12), name
        for sample in out["samples"][f"tatblimp_{name}"]:
            pair = ours["pairs"][sample["doc"]["pair"]]
            assert pair["phenomenon"] == name
            assert sample["acc"] == float(pair["passed"]) and sample["acc_norm"] == float(pair["passed_norm"])
            (good, _), (bad, _) = (r[0] for r in sample["resps"])
            # HFLM sums a continuation in float32: within 1e-4 + 1e-7 of the log-prob (-838 nats differed by 1.26e-4)
            assert float(good) == pytest.approx(pair["good_logprob"], abs=1e-4 + 1e-7 * abs(pair["good_logprob"]))
            assert float(bad) == pytest.approx(pair["bad_logprob"], abs=1e-4 + 1e-7 * abs(pair["bad_logprob"]))
            decided += 1
    assert decided == 1248


def test_tatblimp_task_strict_ties(tmp_path):
    """A tie fails acc (TatBLiMP's rule; the harness's argmax would pass it); acc_norm goes by the UTF-8 bytes."""
    sys.path.insert(0, str(task_path() / "tatblimp"))
    try:
        import utils
    finally:
        sys.path.pop(0)
    doc = {"good": "\u04d9\u04e9", "bad": "abc"}  # two Tatar letters, 4 bytes, against 3
    assert utils.process_results(doc, [(-6.0, False), (-6.0, False)]) == {"acc": 0.0, "acc_norm": 1.0}
    assert utils.process_results(doc, [(-8.0, False), (-6.0, False)]) == {"acc": 0.0, "acc_norm": 0.0}
    assert utils.process_results(doc, [(-5.0, False), (-6.0, False)]) == {"acc": 1.0, "acc_norm": 1.0}
    pairs = utils.load_pairs("binding", str(DATA))["test"]
    assert len(pairs) == 78 and {row["phenomenon"] for row in pairs} == {"binding"}
    with pytest.raises(ValueError, match="no phenomenon 'bindings'"):
        utils.load_pairs("bindings", str(DATA))


@pytest.fixture(scope="module")
def two_models(bpe_tokenizer):
    model = tiny_llama(len(bpe_tokenizer), seed=3)
    return HFLM(pretrained=model, tokenizer=bpe_tokenizer, batch_size=8), TatBLiMPLM(
        pretrained=model, tokenizer=bpe_tokenizer, memory_budget=64 << 20
    )


@pytest.mark.parametrize("task", ["local_blimp", "local_mc", "local_rolling"])
def test_tatblimp_model_equals_hf_request_by_request(two_models, local_tasks, task):
    hf, ours = two_models
    manager = TaskManager(include_path=str(local_tasks), include_defaults=False)
    limit = {"local_blimp": 24, "local_mc": None, "local_rolling": None}[task]
    runs = [
        samples_by_task(simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=True, limit=limit))[task]
        for lm in (hf, ours)
    ]
    requests = 0
    for theirs, mine in zip(*runs, strict=True):
        assert theirs["doc_id"] == mine["doc_id"]
        for a, b in zip(theirs["resps"], mine["resps"], strict=True):
            # HFLM adds a request's float32 log-probs in float32 (a relative 6e-8 each); ours are added in float64.
            if task == "local_rolling":
                assert b[0] == pytest.approx(a[0], abs=1e-4 + 1e-7 * abs(a[0]))
            else:
                (ll_a, greedy_a), (ll_b, greedy_b) = a[0], b[0]
                assert ll_b == pytest.approx(ll_a, abs=1e-4 + 1e-7 * abs(ll_a))
                assert greedy_b == greedy_a
            requests += 1
    assert requests == {"local_blimp": 48, "local_mc": 160, "local_rolling": 12}[task]
    if task == "local_rolling":  # some documents are longer than the context: several windows
        longest = max(len(hf.tok_encode(s["doc"]["text"])) for s in runs[0])
        assert longest > hf.max_length


def test_tatblimp_model_is_greedy_like_hf(two_models):
    """Continuations that are the model's own greedy tokens are greedy for both models; one changed token is not."""
    hf, ours = two_models
    lines = CORPUS.read_text(encoding="utf-8").splitlines()[:12]
    requests = []
    for k, line in enumerate(lines):
        context = [hf.prefix_token_id, *hf.tok_encode(" ".join(line.split()[:5]))]
        with torch.no_grad():
            ids = torch.tensor([context])
            greedy = hf.model.generate(ids, max_new_tokens=1 + k % 3, do_sample=False, pad_token_id=0)[0, len(context) :]
        greedy = greedy.tolist()
        changed = [*greedy[:-1], (greedy[-1] + 1) % hf.vocab_size]
        requests += [
            (("g", str(k)), context, greedy),
            (("c", str(k)), context, changed),
            (("p", str(k)), context[:1], context[1:]),
        ]
    theirs, mine = hf._loglikelihood_tokens(requests), ours._loglikelihood_tokens(requests)
    assert [g for _, g in mine] == [g for _, g in theirs]
    assert [g for _, g in theirs][::3] == [True] * 12 and not any([g for _, g in theirs][1::3])
    assert [ll for ll, _ in mine] == pytest.approx([ll for ll, _ in theirs], abs=1e-4)


@pytest.mark.slow
def test_trainer_logs_harness_metrics_equal_to_a_harness_run(bpe_tokenizer, local_tasks, tmp_path):
    """A real Trainer run with ``lm_eval_tasks`` logs ``lm_eval/<task>/<metric>``: at the last step, the numbers
    ``lm_eval --model hf`` gives for the checkpoint saved there."""
    from tatblimp_callback import TatBLiMPCallback
    from trainer_utils import checkpointed_trainer

    model = tiny_llama(len(bpe_tokenizer), seed=5)
    trainer = checkpointed_trainer(model, bpe_tokenizer, tmp_path / "run")
    tasks = ["local_mc", "tatblimp_binding"]
    callback = TatBLiMPCallback.attach(
        trainer, data=DATA, eval_steps=2, lm_eval_tasks=tasks, lm_eval_include_path=str(local_tasks)
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "lm_eval/local_mc/acc" in entry]
    assert [entry["step"] for entry in logged] == [0, 2, 4]
    assert len({entry["lm_eval/local_mc/acc_norm"] for entry in logged} | {0}) >= 2  # numbers, not a constant
    out = simple_evaluate(
        model="hf",
        model_args=f"pretrained={tmp_path / 'run' / 'checkpoint-4'},dtype=float32",
        tasks=tasks,
        task_manager=TaskManager(include_path=[str(task_path()), str(local_tasks)], include_defaults=False),
        device="cpu",
    )
    last = logged[-1]
    for task in tasks:
        for metric in ("acc", "acc_norm"):
            assert last[f"lm_eval/{task}/{metric}"] == pytest.approx(out["results"][task][f"{metric},none"], abs=1e-12)
    assert callback.history[-1]["lm_eval/tatblimp_binding/acc"] == last["lm_eval/tatblimp_binding/acc"]
    # And in the history file, under lm_eval, as the docs say (it had none of them).
    lines = [json.loads(line) for line in (tmp_path / "run" / "tatblimp_history.jsonl").read_text().splitlines()]
    harness = [{key.split("/", 1)[1]: v for key, v in entry.items() if key.startswith("lm_eval/")} for entry in logged]
    assert [line["step"] for line in lines] == [0, 2, 4] and [line["lm_eval"] for line in lines] == harness


def test_lm_eval_path_prints_the_task_folder(capsys):
    from tatblimp_callback.cli import main

    assert main(["lm-eval-path"]) == 0
    folder = capsys.readouterr().out.strip()
    names = sorted(p.name for p in (task_path() / "tatblimp").glob("tatblimp_*.yaml"))
    assert folder == str(task_path()) and len(names) == 16 and (task_path() / "tatblimp" / "_tatblimp.yaml").exists()


@pytest.mark.slow
def test_tatblimp_lm_eval_runs_the_harness_with_the_model_registered(model_dir, tmp_path):
    """``tatblimp lm-eval --model tatblimp ...``: the harness's own command line, our model and tasks found."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "TATBLIMP_DATA": str(DATA)}
    command = [sys.executable, "-m", "tatblimp_callback", "lm-eval", "--model", "tatblimp", "--model_args"]
    command += [f"pretrained={model_dir},dtype=float32", "--tasks", "tatblimp_binding", "--device", "cpu"]
    subprocess.run([*command, "--output_path", str(out)], check=True, env=env, capture_output=True)
    written = json.loads(next(out.rglob("results_*.json")).read_text())
    assert written["config"]["model"] == "tatblimp"
    assert 0 <= written["results"]["tatblimp_binding"]["acc,none"] <= 1
    assert written["n-samples"]["tatblimp_binding"]["effective"] == 78


def test_loading_the_task_logs_no_custom_dataset_warning(caplog):
    """The 16 subtasks load their 1,248 pairs without the harness's "Custom kwargs" warning (was once per subtask)."""
    with caplog.at_level(logging.DEBUG):
        loaded = TaskManager(include_path=str(task_path()), include_defaults=False).load(["tatblimp"])
    tasks = loaded["tasks"]
    assert len(tasks) == 16 and sum(len(task.test_docs()) for task in tasks.values()) == 1248
    assert [r.getMessage() for r in caplog.records if "Custom kwargs" in r.getMessage()] == []


@pytest.mark.slow
def test_the_harness_runs_the_task_without_its_custom_dataset_warning(model_dir, tmp_path, monkeypatch):
    """``lm_eval --tasks tatblimp`` warned "Custom kwargs can be passed to `--metadata`" once per subtask (16 lines
    a run) while the task read its pairs through ``custom_dataset``; ``--metadata``'s data_path still reaches them."""
    monkeypatch.delenv("TATBLIMP_DATA")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model_dir},dtype=float32"]
    command += ["--tasks", "tatblimp", "--include_path", str(task_path()), "--device", "cpu", "--limit", "2"]
    command += ["--metadata", json.dumps({"data_path": str(DATA)}), "--output_path", str(out)]
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (run.stdout + run.stderr).count("Custom kwargs") == 0
    written = json.loads(next(out.rglob("results_*.json")).read_text())
    subtasks = [name for name in written["n-samples"] if name.startswith("tatblimp_")]
    assert len(subtasks) == 16 and {written["n-samples"][name]["effective"] for name in subtasks} == {2}
    assert 0 <= written["results"]["tatblimp"]["acc_norm,none"] <= 1
