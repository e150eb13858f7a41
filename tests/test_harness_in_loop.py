"""Harness tasks in the training loop (``lm_eval_tasks``): their requests built and encoded once, scored in
TatBLiMP's fused pass (one sweep of forward calls for both), the harness's own metrics from those log-likelihoods,
and under torchrun each process scoring its share only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import CORPUS, DATA, tiny_llama

pytest.importorskip("lm_eval")

from tatblimp_callback import TatBLiMPCallback
from tatblimp_callback.harness.in_training import HarnessTasks
from tatblimp_callback.harness.model import TatBLiMPLM

TASKS = ["local_mc", "local_blimp", "local_rolling", "tatblimp_binding"]
LIMIT = 12
BUDGET = 1 << 30  # a forward call's positions set by the rows, not by a budget the cache's size caps (each pass differs)


@pytest.fixture(autouse=True)
def tatblimp_data(monkeypatch):
    monkeypatch.setenv("TATBLIMP_DATA", str(DATA))


class ForwardCount:
    """Calls of the model's body (the tiled head's forward and the model's own both run it)."""

    def __init__(self, model):
        self.calls = 0
        model.model.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))


def nudge(model, scale: float = 1e-4) -> None:
    """New weights (a new label: scored again), too close to the old for the method check to be due."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + scale)


def monitor_forwards(model, tokenizer, small_data, **options) -> tuple[int, dict, object]:
    """Forward calls of an in-loop evaluation after the first (whose method check runs plain forwards), and its metrics."""
    callback = TatBLiMPCallback(data=small_data, allow_modified=True, memory_budget=BUDGET, **options)
    monitor = callback._monitor
    monitor.prepare(tokenizer, model)
    monitor.score(model, 0, lambda *_: None, main=True)
    nudge(model)
    count = ForwardCount(model)
    metrics = monitor.score(model, 1, lambda *_: None, main=True)
    return count.calls, metrics, monitor


def test_in_loop_harness_tasks_are_one_fused_sweep_and_encoded_once(bpe_tokenizer, small_data, local_tasks, monkeypatch):
    encodings = []
    original = TatBLiMPLM.tok_encode
    monkeypatch.setattr(TatBLiMPLM, "tok_encode", lambda self, *a, **k: encodings.append(1) or original(self, *a, **k))
    harness = dict(lm_eval_tasks=TASKS, lm_eval_include_path=str(local_tasks), lm_eval_limit=LIMIT)

    alone, tatblimp_metrics, _ = monitor_forwards(tiny_llama(len(bpe_tokenizer), seed=3), bpe_tokenizer, small_data)
    model = tiny_llama(len(bpe_tokenizer), seed=3)
    both, metrics, monitor = monitor_forwards(model, bpe_tokenizer, small_data, **harness)
    mine = list(monitor.evaluator.span_scores)
    encoded = len(encodings)
    spans = monitor.evaluator.spans
    assert encoded >= len(spans) > 0  # every request encoded at prepare (a pair: its context and its continuation)
    nudge(model)
    monitor.score(model, 2, lambda *_: None, main=True)
    assert len(encodings) == encoded  # nothing encoded again at the later evaluations

    # The harness in a pass of its own, on the same weights: its own layout and forward calls.
    tasks = HarnessTasks(TASKS, bpe_tokenizer, include_path=str(local_tasks), limit=LIMIT, memory_budget=BUDGET)
    check = tiny_llama(len(bpe_tokenizer), seed=3)
    nudge(check)
    tasks(check)  # the first call chooses its method (plain forwards)
    count = ForwardCount(check)
    own = tasks(check)
    harness_alone = count.calls
    assert both < alone + harness_alone, (both, alone, harness_alone)

    # The same numbers as TatBLiMP alone and as the harness alone.
    assert {k: v for k, v in metrics.items() if k.startswith("tatblimp/acc")} == {
        k: v for k, v in tatblimp_metrics.items() if k.startswith("tatblimp/acc")
    }
    assert sorted(k for k in metrics if k.startswith("lm_eval/")) == sorted(own)
    for name, value in own.items():
        assert metrics[name] == pytest.approx(value, rel=1e-6), name
    assert {"lm_eval/local_mc/acc_norm", "lm_eval/local_rolling/bits_per_byte", "lm_eval/tatblimp_binding/acc"} <= set(own)
    # Request by request: the fused pass's (log-prob, is_greedy) against the harness model's own pass.
    theirs = tasks._lm.request_scorer.score(tasks._requests, tasks._lm.prefix_token_id, tasks._lm.max_length)
    assert len(mine) == len(theirs) == len(spans)
    assert [g for _, g in mine] == [g for _, g in theirs]
    assert [lp for lp, _ in mine] == pytest.approx([lp for lp, _ in theirs], abs=1e-4)


def test_a_span_is_scored_on_its_continuation_only_with_greedy_flags(bpe_tokenizer, small_data):
    """A span's log-prob is its continuation's tokens' alone (its context's are never read), and it is greedy
    exactly when every continuation token is its position's argmax, as a plain forward of the model says."""
    from tatblimp_callback import Evaluator
    from tatblimp_callback.engine.scored_spans import Spans

    model = tiny_llama(len(bpe_tokenizer), seed=3)
    lines = [ids for ids in (bpe_tokenizer(line)["input_ids"] for line in CORPUS.read_text(encoding="utf-8").splitlines()[:200])]
    sequences = [[bpe_tokenizer.bos_token_id, *ids[:24]] for ids in lines if len(ids) >= 24][:6]
    with torch.no_grad():
        prompt = torch.tensor([sequences[0][:8]])
        sequences.append(model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)[0].tolist())
    scored = [1, 3, 5, 7, 24, 2, 3]
    evaluator = Evaluator(bpe_tokenizer, small_data, allow_modified=True, spans=Spans(sequences, scored))
    results = evaluator(model)
    assert len(results.pairs) == 48 and len(evaluator.span_scores) == 7
    for (logprob, is_greedy), ids, n in zip(evaluator.span_scores, sequences, scored, strict=True):
        with torch.no_grad():
            lp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
        wanted = range(len(ids) - n, len(ids))
        assert logprob == pytest.approx(sum(lp[i - 1, ids[i]].item() for i in wanted), abs=1e-4)
        assert is_greedy == all(lp[i - 1].argmax().item() == ids[i] for i in wanted)
    assert evaluator.span_scores[-1][1] is True  # the model's own greedy continuation
    assert not all(greedy for _, greedy in evaluator.span_scores[:5])  # corpus text is not the random model's argmax


@pytest.mark.slow
def test_torchrun_shards_the_harness_requests_and_both_log_one_process_numbers(bpe_tokenizer, small_data, local_tasks, tmp_path):
    """Two processes (gloo): each scores part of the harness's continuation tokens (counted per rank, none twice),
    and both log the lm_eval metrics of a one-process run of the same weights (within 1e-6)."""
    bpe_tokenizer.save_pretrained(tmp_path / "tokenizer")
    worker = Path(__file__).with_name("harness_distributed_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TATBLIMP_DATA": str(DATA)}
    done = subprocess.run(
        [*command, str(tmp_path), str(small_data), str(local_tasks)], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    ranks = [torch.load(tmp_path / f"harness-rank{r}.pt", weights_only=False) for r in (0, 1)]
    total = ranks[0]["continuation_tokens"]
    read = [rank["tokens_read"] for rank in ranks]
    assert all(0 < n < total for n in read) and sum(read) == total, (read, total)
    one = ranks[0]["one_process"]
    assert ranks[0]["one_process_tokens_read"] == total
    for rank in ranks:
        assert rank["world_size"] == 2
        assert sorted(rank["metrics"]) == sorted(one) and len(one) >= 6
        for name, value in one.items():
            assert rank["metrics"][name] == pytest.approx(value, rel=1e-6, abs=1e-6), name
    assert ranks[0]["metrics"] == ranks[1]["metrics"]
    # Request by request, the greedy flags too (added over the processes as the log-probs are).
    greedy = ranks[0]["one_process_greedy"]
    assert [g for _, g in greedy] == [True, False] * 8  # the model's own greedy tokens, then one changed
    for rank in ranks:
        for key, alone in (("span_scores", ranks[0]["one_process_scores"]), ("greedy", greedy)):
            assert [g for _, g in rank[key]] == [g for _, g in alone]
            assert [lp for lp, _ in rank[key]] == pytest.approx([lp for lp, _ in alone], abs=1e-6)
    assert ranks[0]["published"] == 1 and ranks[1]["published"] == 0  # rank 0 publishes, as today


def test_in_loop_rolling_metrics_equal_the_harness_scoring_the_same_documents_itself(bpe_tokenizer, small_data, local_tasks):
    """A rolling log-likelihood of a document longer than the context is the sum of its windows' spans in the fused
    pass: the in-loop metrics equal those the harness computes with ``--model tatblimp`` scoring the documents."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model = tiny_llama(len(bpe_tokenizer), seed=3)
    options = dict(lm_eval_tasks=["local_rolling"], lm_eval_include_path=str(local_tasks), lm_eval_limit=LIMIT)
    monitor = TatBLiMPCallback(data=small_data, allow_modified=True, memory_budget=BUDGET, **options)._monitor
    monitor.prepare(bpe_tokenizer, model)
    metrics = monitor.score(model, 0, lambda *_: None, main=True)
    assert len(monitor.evaluator.spans) > LIMIT  # some of the 12 documents roll over several windows

    out = simple_evaluate(
        model=TatBLiMPLM(pretrained=model, tokenizer=bpe_tokenizer),
        tasks=["local_rolling"],
        limit=LIMIT,
        task_manager=TaskManager(include_path=str(local_tasks), include_defaults=False),
        bootstrap_iters=0,
    )
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        expected = out["results"]["local_rolling"][f"{metric},none"]
        assert metrics[f"lm_eval/local_rolling/{metric}"] == pytest.approx(expected, rel=1e-6), metric


def test_in_the_fused_pass_a_questions_choices_share_one_row(bpe_tokenizer, small_data):
    """In TatBLiMP's pass the harness's requests come without the harness model's hint of which share a context list:
    the spans with one context are found in the cache, the rows widened to the largest such question of those at most
    twice the row length, and a row ends before a question it would split (``bench_harness_in_loop.py --tasks
    local_mc``, TatBLiMP beside 100 questions of 150-word contexts: 177 rows of 337 positions before, 161 of up to
    373 now)."""
    import random

    from tatblimp_callback import Evaluator
    from tatblimp_callback.engine.scored_spans import Spans

    model = tiny_llama(len(bpe_tokenizer), seed=3)
    rng = random.Random(5)
    lines = [bpe_tokenizer(line)["input_ids"] for line in CORPUS.read_text(encoding="utf-8").splitlines()[:400]]
    sequences, scored, trees = [], [], []
    # Questions longer than a row would be, and shorter ones that sort between sentences.
    for k, ids in enumerate([ids for ids in lines if len(ids) >= 40][:16]):
        context = [bpe_tokenizer.bos_token_id, *ids[: 40 if k < 6 else rng.randint(8, 30)]]
        endings = [[rng.randrange(3, len(bpe_tokenizer)) for _ in range(rng.randint(4, 8))] for _ in range(4)]
        sequences += [context + ending for ending in endings]
        scored += [len(ending) for ending in endings]
        trees.append(len(context) + sum(len(ending) - 1 for ending in endings))
    # BLiMP's requests share only the prefix token: a group too large for any row, which must not keep rows narrow.
    blimp = [[bpe_tokenizer.bos_token_id, *ids[:8]] for ids in lines if len(ids) >= 8][:40]
    sequences, scored = sequences + blimp, scored + [8] * len(blimp)
    evaluator = Evaluator(bpe_tokenizer, small_data, allow_modified=True, spans=Spans(sequences, scored), row_length=8)
    evaluator(model)
    scorer = evaluator._scorer
    longest = max(scorer.cache.lengths)
    assert longest < max(trees) <= 2 * longest  # each question is longer than a row would be without the widening
    assert 1 + 7 * len(blimp) > 2 * longest
    assert scorer.row_length == max(trees)
    first = scorer.spans.first
    rows_of_question = [
        {r for r, row in enumerate(scorer.layout().batches.rows.rows()) for s in row if s >= first and (s - first) // 4 == q}
        for q in range(len(trees))
    ]
    assert all(len(rows) == 1 for rows in rows_of_question)
    with torch.no_grad():
        for (logprob, _), ids, n in zip(evaluator.span_scores, sequences, scored, strict=True):
            lp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
            assert logprob == pytest.approx(sum(lp[i - 1, ids[i]].item() for i in range(len(ids) - n, len(ids))), abs=1e-4)
