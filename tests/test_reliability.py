"""Reliability: bad inputs, faults and long runs each end in a clear message or a counted fallback.

Too-long sentences, non-finite log-probs, out of memory, meta weights, a foreign tokenizer, wandb
without a login, no network, hundreds of evaluations in a row, and Ctrl-C in the middle of one.
"""

from __future__ import annotations

import gc
import json
import os
import re
import socket
import subprocess
import sys
import weakref
from types import SimpleNamespace

import psutil
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerControl, TrainerState

from conftest import REPO, tiny_llama, write_pairs
from tatblimp_callback import (
    Scorer,
    ScoringMethod,
    TatBLiMPCallback,
    build_cache,
    evaluate,
)
from tatblimp_callback.engine import memory_budget, scoring_method
from trainer_utils import make_trainer, tatblimp_entries

PAIRS = 48  # small_data: three pairs of each of the 16 phenomena


@pytest.fixture(scope="module")
def cache(bpe_tokenizer, small_data):
    return build_cache(bpe_tokenizer, small_data, allow_modified=True)


@pytest.fixture(scope="module")
def model(bpe_tokenizer):
    return tiny_llama(len(bpe_tokenizer))


@pytest.fixture(scope="module")
def one_each(records, tmp_path_factory):
    """One pair of each phenomenon (16 pairs), for the tests that score many times."""
    return write_pairs(tmp_path_factory.mktemp("data") / "one_each.jsonl", list({r["phenomenon"]: r for r in records}.values()))


def callback(data, **options) -> TatBLiMPCallback:
    return TatBLiMPCallback(data=data, allow_modified=True, **options)


def events(cb: TatBLiMPCallback, model, tokenizer, steps: int) -> TrainerState:
    """Drive the callback through a training run's events, without a Trainer."""
    args, state, control = SimpleNamespace(report_to=[]), TrainerState(max_steps=10**9), TrainerControl()
    cb.on_train_begin(args, state, control, model=model, processing_class=tokenizer)
    for _ in range(steps):
        state.global_step += 1
        cb.on_step_end(args, state, control, model=model)
    return state


# -- 2. a sentence longer than the model's context ---------------------------------------------


def test_too_long_sentence_through_the_callback_fails_or_is_counted(bpe_tokenizer, small_data, cache, tmp_path, caplog):
    context = 32  # the training blocks are 32 tokens; some benchmark sentences are longer
    too_long = sum(n > context for n in cache.lengths)
    assert too_long > 0

    cb = callback(small_data, eval_steps=2)
    trainer = make_trainer(
        tiny_llama(len(bpe_tokenizer), max_position_embeddings=context), bpe_tokenizer, tmp_path / "a", [cb], max_steps=4
    )
    trainer.train()
    assert trainer.state.global_step == 4 and cb.history == []
    assert cb.failures == 3  # steps 0, 2 and 4 (preparing is said once, not counted)
    assert re.search(
        rf"{too_long} of 96 sentences have more tokens than the model's context of {context} \(the longest, pair \d+'s "
        r"(good|bad) sentence, has \d+\); pass truncate=True \(tatblimp: --truncate\)",
        caplog.text,
    )

    cb = callback(small_data, eval_steps=2, truncate=True)
    state = events(cb, tiny_llama(len(bpe_tokenizer), max_position_embeddings=context), bpe_tokenizer, steps=4)
    assert cb.failures == 0 and [h["step"] for h in cb.history] == [0, 2, 4]
    assert cb.last_results.truncated_sentences == too_long
    assert [e["tatblimp/truncated_sentences"] for e in state.log_history] == [too_long] * 3
    assert f"{too_long} sentences were cut to the model's context" in cb.last_results.format_table()


# -- 3. non-finite log-probs -------------------------------------------------------------------


def poisoned(tokenizer, cache, count: int = 3):
    """A tiny Llama whose embedding is NaN for ``count`` tokens that each occur in one benchmark
    sentence only; returns the model and those sentences."""
    users: dict[int, set[int]] = {}
    for s in range(cache.num_sentences):
        for token in cache.sentence(s)[1:]:
            users.setdefault(token, set()).add(s)
    tokens = [t for t in sorted(users) if len(users[t]) == 1][:count]
    model = tiny_llama(len(tokenizer))
    with torch.no_grad():
        model.model.embed_tokens.weight[tokens] = float("nan")
    return model, sorted(s for t in tokens for s in users[t])


def test_a_nan_sentence_does_not_spread_through_its_row(bpe_tokenizer, cache):
    model, sentences = poisoned(bpe_tokenizer, cache)
    # One sentence a row: what a plain forward gives (test_scoring checks padded rows against one).
    reference = Scorer(model, cache, method=ScoringMethod("padded", "tiled")).score()
    assert (~torch.isfinite(reference)).nonzero().flatten().tolist() == sentences
    scorer = Scorer(model, cache)
    scores = scorer.score()
    # The fast method still agrees with a plain forward: no silent fallback to padded rows.
    assert str(scorer.method) == "tree rows, tiled head"
    assert (~torch.isfinite(scores)).nonzero().flatten().tolist() == sentences
    finite = torch.isfinite(reference)
    assert (scores[finite] - reference[finite]).abs().max().item() < 1e-4


def test_the_method_check_compares_which_sentences_are_non_finite():
    nan = float("nan")
    reference = torch.tensor([-5.0, nan, -7.0], dtype=torch.float64)
    tokens, rtol = (
        torch.full((3,), 4.0, dtype=torch.float64),
        scoring_method.relative_tolerance(torch.float32, torch.device("cpu")),
    )
    assert scoring_method.agree(reference.clone(), reference, tokens, rtol)
    assert not scoring_method.agree(torch.tensor([-5.0, -6.0, -7.0], dtype=torch.float64), reference, tokens, rtol)
    assert not scoring_method.agree(torch.tensor([nan, nan, -7.0], dtype=torch.float64), reference, tokens, rtol)


def test_a_diverged_model_is_scored_and_the_method_checked_once_it_recovers(bpe_tokenizer, cache, monkeypatch, caplog):
    model = tiny_llama(len(bpe_tokenizer))
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    with torch.no_grad():
        model.lm_head.weight.fill_(float("inf"))  # every log-softmax is NaN
    checks = []
    from tatblimp_callback.engine.method_check import MethodCheck

    original = MethodCheck.choose
    monkeypatch.setattr(MethodCheck, "choose", lambda self, *args: checks.append(1) or original(self, *args))
    scorer = Scorer(model, cache)
    assert not torch.isfinite(scorer.score()).any()
    assert "scoring method unchecked" in caplog.text
    model.load_state_dict(weights)
    recovered = scorer.score()
    scorer.score()
    assert len(checks) == 2  # unchecked while diverged, checked once it was not, then kept
    assert torch.isfinite(recovered).all()


def test_nan_log_probs_are_counted_flagged_and_training_goes_on(bpe_tokenizer, small_data, cache, tmp_path, caplog):
    model, sentences = poisoned(bpe_tokenizer, cache)
    pairs = sorted({s // 2 for s in sentences})
    phenomena = {cache.phenomena[int(cache.phenomenon_index[p])] for p in pairs}
    expected = evaluate(poisoned(bpe_tokenizer, cache)[0], cache=cache)

    # The results: counts, per phenomenon, and metrics over the other pairs, flagged.
    assert expected.partial and expected.non_finite_pairs == len(pairs) and expected.non_finite_sentences == len(sentences)
    assert {name for name, g in expected.phenomena.items() if g.non_finite} == phenomena
    kept = [p for i, p in enumerate(expected.pairs) if i not in pairs]
    assert expected.overall.n == PAIRS - len(pairs) == len(kept)
    assert expected.acc == sum(p.passed for p in kept) / len(kept)
    as_dict = expected.to_dict()
    assert as_dict["partial"] is True and as_dict["non_finite_sentences"] == len(sentences)
    # Standard JSON: a non-finite log-prob is null (it was NaN, which jq and JSON.parse refuse); the outcome says "-"
    json.dumps(as_dict["pairs"], allow_nan=False)
    nulls = {i for i, p in enumerate(as_dict["pairs"]) if p["good_logprob"] is None or p["bad_logprob"] is None}
    assert nulls == set(pairs) and all(as_dict["outcomes"]["acc"][i] == "-" for i in pairs)
    assert f"WARNING: {len(pairs)} pairs ({len(sentences)} sentences) had non-finite" in expected.format_table()

    # Through the callback: logged and flagged at step 0; training (which spreads the NaN) goes on.
    cb = callback(small_data, eval_steps=100)
    trainer = make_trainer(model, bpe_tokenizer, tmp_path, [cb], max_steps=2)
    trainer.train()
    assert trainer.state.global_step == 2 and cb.failures == 0
    first, last = tatblimp_entries(trainer)
    assert first["step"] == 0 and first["tatblimp/acc"] == expected.acc and first["tatblimp/partial"] == 1.0
    assert first["tatblimp/non_finite_pairs"] == len(pairs) and first["tatblimp/non_finite_sentences"] == len(sentences)
    assert {k.split("/")[1] for k in first if re.fullmatch(r"tatblimp/\w+/non_finite_pairs", k)} == phenomena
    assert "non-finite log-probs and are left out of the metrics" in caplog.text
    assert last["step"] == 2 and last["tatblimp/partial"] == 1.0 and last["tatblimp/non_finite_pairs"] >= len(pairs)


# -- 4. out of memory --------------------------------------------------------------------------


class OutOfMemoryAbove:
    """Makes every forward of more than ``limit`` positions raise ``torch.OutOfMemoryError``, after
    allocating a stand-in for the activations it had computed; keeps weak references to those."""

    def __init__(self, monkeypatch, limit: int):
        self.limit, self.failed, self.refs = limit, 0, []
        original = Scorer._batch_logprobs

        def forward(scorer, batch, head, spans=None):
            if batch.num_positions > self.limit:
                activations = torch.empty(batch.num_positions, 64)
                self.refs += [weakref.ref(activations), weakref.ref(batch.input_ids)]
                self.failed += 1
                raise torch.OutOfMemoryError(f"test: {batch.num_positions} positions do not fit")
            return original(scorer, batch, head, spans)

        monkeypatch.setattr(Scorer, "_batch_logprobs", forward)

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.refs)


def test_out_of_memory_halves_the_budget_after_freeing_the_failed_attempt(model, cache, monkeypatch):
    expected = Scorer(model, cache, method="packed").score()
    monkeypatch.setattr(memory_budget, "MIN_MEMORY_BUDGET", 2**20)
    oom = OutOfMemoryAbove(monkeypatch, limit=1024)
    alive_when_emptying = []
    monkeypatch.setattr(memory_budget, "empty_device_cache", lambda device: alive_when_emptying.append(oom.alive()))
    start = 16 * 2**20
    scorer = Scorer(model, cache, memory_budget=start, method="packed")
    scores = scorer.score()
    assert scorer.oom_retries == oom.failed >= 1 and scorer.memory_budget == start >> scorer.oom_retries
    # Each failed attempt's tensors and layout were gone before the device cache was emptied.
    assert alive_when_emptying == [0] * scorer.oom_retries
    assert list(scorer._layouts) == [("packed", scorer.row_length, scorer.tokens_per_batch)]
    assert max(b.num_positions for b in scorer.layout().batches) <= 1024
    assert (scores - expected).abs().max().item() < 1e-5
    # The results say so.
    assert evaluate(model, cache=cache, memory_budget=start, method="packed").run_info["oom_retries"] == scorer.oom_retries


def test_out_of_memory_at_the_floor_is_a_callback_failure_and_training_goes_on(
    bpe_tokenizer, small_data, tmp_path, monkeypatch, caplog
):
    oom = OutOfMemoryAbove(monkeypatch, limit=0)  # nothing fits, not even the method check
    floor = memory_budget.MIN_MEMORY_BUDGET
    cb = callback(small_data, eval_steps=2, memory_budget=4 * floor)
    trainer = make_trainer(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [cb], max_steps=2)
    trainer.train()
    assert trainer.state.global_step == 2 and cb.failures == 2 and cb.history == []
    assert [e["tatblimp/failures"] for e in tatblimp_entries(trainer, "tatblimp/failures")] == [1.0, 2.0]
    # 4x the floor, 2x, the floor, then reported; the next evaluation starts at the floor.
    assert caplog.text.count("out of memory while scoring; retrying") == 2
    assert cb._evaluator._scorer.memory_budget == floor and cb._evaluator._scorer.oom_retries == 2
    assert "OutOfMemoryError: test:" in caplog.text
    assert oom.failed == 4 and oom.alive() == 0  # nothing of the failed evaluations is left


# -- 5. meta weights and a foreign tokenizer, through the callback -----------------------------


def forward_calls(model) -> list:
    calls = []
    for module in (model, model.model):
        module.register_forward_pre_hook(lambda *args: calls.append(1))
    return calls


def test_foreign_tokenizer_and_meta_weights_fail_in_the_callback_before_any_forward(bpe_tokenizer, small_data, caplog):
    small = tiny_llama(100)
    calls = forward_calls(small)
    cb = callback(small_data, eval_steps=1)
    events(cb, small, bpe_tokenizer, steps=2)
    assert cb.failures == 3 and cb.history == [] and calls == []  # steps 0, 1 and 2 (preparing is not counted)
    assert re.search(r"produces token id \d+, but the model's embedding has only 100 rows", caplog.text)

    with torch.device("meta"):
        meta = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(bpe_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
            )
        )
    calls = forward_calls(meta)
    cb = callback(small_data, eval_steps=1)
    events(cb, meta, bpe_tokenizer, steps=1)
    assert cb.failures == 2 and calls == []  # steps 0 and 1
    assert "the model has weights on the meta device" in caplog.text


# -- 6. wandb without a login, and no network --------------------------------------------------

WANDB_SCRIPT = r"""
import json, os, socket, sys
sys.path[:0] = [os.environ["TESTS_DIR"]]
attempts = []
real_connect = socket.socket.connect

def connect(self, address):
    # wandb talks to its own service process on this machine; anything else is refused.
    if self.family == socket.AF_UNIX or address[0] in ("127.0.0.1", "::1", "localhost"):
        return real_connect(self, address)
    attempts.append(repr(address))
    raise OSError("test: network access refused")

socket.socket.connect = connect
import torch
import wandb
torch.set_num_threads(1)
from conftest import train_bpe, tiny_llama
from trainer_utils import make_trainer
from tatblimp_callback import TatBLiMPCallback

tokenizer = train_bpe(lines=1500)
report = {}
for name, mode, report_to in [("not logged in, report_to none", None, "none"), ("disabled", "disabled", "wandb"),
                              ("offline", "offline", "wandb"), ("not logged in, report_to wandb", None, "wandb")]:
    os.environ.pop("WANDB_MODE", None)
    if mode:
        os.environ["WANDB_MODE"] = mode
    wandb.teardown()
    cb = TatBLiMPCallback(data=os.environ["DATA"], allow_modified=True, eval_steps=1)
    trainer = make_trainer(tiny_llama(len(tokenizer)), tokenizer, os.environ["OUT"] + "/" + str(len(report)), [cb], max_steps=2, report_to=report_to)
    try:
        trainer.train()
        error = None
    except Exception as err:
        error = f"{type(err).__module__}.{type(err).__name__}: {err}"
    report[name] = {"error": error, "evaluations": len(cb.history), "failures": cb.failures, "run": type(wandb.run).__name__}
    if wandb.run is not None:
        wandb.finish()
report["network"] = attempts
print("REPORT " + json.dumps(report))
"""


@pytest.mark.slow
def test_wandb_offline_disabled_or_not_logged_in_never_fails_or_asks(one_each, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        HOME=str(home),
        WANDB_DIR=str(tmp_path),
        WANDB_SILENT="true",
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TESTS_DIR=str(REPO / "tests"),
        DATA=str(one_each),
        OUT=str(tmp_path / "runs"),
    )
    done = subprocess.run(
        [sys.executable, "-c", WANDB_SCRIPT],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.split("REPORT ", 1)[1])
    for name in ("not logged in, report_to none", "disabled", "offline"):
        assert report[name]["error"] is None and report[name]["failures"] == 0, report[name]
        assert report[name]["evaluations"] == 3, report[name]  # steps 0, 1 and 2
    assert report["not logged in, report_to none"]["run"] == "NoneType"  # no run was started
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    # Asking Trainer to report to wandb without a login: wandb's own error at the start, no prompt.
    refused = report["not logged in, report_to wandb"]
    assert refused["error"].startswith("wandb.errors") and "API key" in refused["error"] and refused["evaluations"] == 0
    assert report["network"] == []


@pytest.fixture
def no_network(monkeypatch):
    """Every socket connection and name lookup raises; the attempts are listed."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[1:] if args and isinstance(args[0], socket.socket) else args)
        raise OSError("test: network access refused")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return attempts


def test_no_network_access_with_a_local_data_path(no_network, bpe_tokenizer, small_data, tmp_path):
    from tatblimp_callback.cli import main

    with pytest.raises(OSError, match="network access refused"):
        socket.create_connection(("192.0.2.1", 80), timeout=1)
    no_network.clear()
    model = tiny_llama(len(bpe_tokenizer))
    results = evaluate(model, bpe_tokenizer, small_data, allow_modified=True)
    model.save_pretrained(tmp_path / "model")
    bpe_tokenizer.save_pretrained(tmp_path / "model")
    output = tmp_path / "results.json"
    status = main(
        [
            "score",
            str(tmp_path / "model"),
            "--data",
            str(small_data),
            "--allow-modified",
            "--device",
            "cpu",
            "--output",
            str(output),
        ]
    )
    assert status == 0 and results.overall.n == PAIRS
    assert json.loads(output.read_text())["acc"] == results.acc
    assert no_network == []


# -- 7. long runs ------------------------------------------------------------------------------


def live_tensors() -> int:
    return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())


@pytest.mark.slow
def test_hundreds_of_evaluations_leave_memory_flat(bpe_tokenizer, one_each):
    model = tiny_llama(len(bpe_tokenizer), hidden=16, layers=1)
    cb = callback(one_each, eval_steps=1)
    state = events(cb, model, bpe_tokenizer, steps=40)  # warm-up: lazy imports, allocator pools, the method check
    args, control = SimpleNamespace(report_to=[]), TrainerControl()
    process = psutil.Process()

    def evaluate_times(count: int) -> int:
        for _ in range(count):
            state.global_step += 1
            with torch.no_grad():  # a training step: weights the callback has not scored yet
                model.lm_head.weight[0, 0] += 1e-3
            cb.on_step_end(args, state, control, model=model)
        gc.collect()
        return process.memory_info().rss

    gc.collect()
    start, tensors = process.memory_info().rss, live_tensors()
    previous = weakref.ref(cb.last_results)
    middle = evaluate_times(100)
    end = evaluate_times(150)
    assert cb.failures == 0 and len(cb.history) == 41 + 250 == len(state.log_history)
    # One small dict per evaluation and nothing else: the last results are replaced, not kept.
    assert {len(h) for h in cb.history} == {1 + 2 + 4 + 2 * 16 + 1}  # step, overall and its intervals, per phenomenon, seconds
    assert previous() is None and live_tensors() == tensors
    # Measured on the 2-core box: 3-5 MiB in all; the slope, about 4 KiB an evaluation, is the two
    # history dicts (ours and the Trainer's log_history).
    slope = (end - middle) / 150
    print(f"RSS: +{(end - start) / 2**20:.2f} MiB over 250 evaluations, {slope / 2**10:.1f} KiB each over the last 150")
    assert end - start < 12 * 2**20 and slope < 16 * 2**10


# -- 8. Ctrl-C during an evaluation ------------------------------------------------------------


def test_ctrl_c_during_an_evaluation_leaves_train_mode_and_a_savable_trainer(bpe_tokenizer, small_data, tmp_path, monkeypatch):
    original = Scorer._batch_logprobs
    seen = {}

    def forward(scorer, batch, head, spans=None):
        if trainer.state.global_step == 2:
            seen["training"] = scorer.model.training
            seen["rng"] = torch.get_rng_state()
            torch.rand(8)  # the interrupted evaluation had drawn random numbers
            raise KeyboardInterrupt
        return original(scorer, batch, head, spans)

    monkeypatch.setattr(Scorer, "_batch_logprobs", forward)
    model = tiny_llama(len(bpe_tokenizer))
    trainer = make_trainer(model, bpe_tokenizer, tmp_path / "run", [callback(small_data, eval_steps=2)], max_steps=4)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.state.global_step == 2 and seen["training"] is False
    assert model.training and torch.equal(torch.get_rng_state(), seen["rng"])

    trainer.save_model(str(tmp_path / "saved"))
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "saved")
    assert all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), reloaded.state_dict().values()))
    trainer._save_checkpoint(trainer.model, trial=None)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= {p.name for p in checkpoint.iterdir()}
