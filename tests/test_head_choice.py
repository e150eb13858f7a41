"""The LM head's method chosen by timing at the first evaluation (engine/head_choice.py)."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_llama
from tatblimp_callback import Scorer
from tatblimp_callback.engine import head_choice, tiled_head
from tatblimp_callback.engine.head_choice import HeadMethod, candidates
from tatblimp_callback.engine.scoring_method import ScoringMethod, agree
from tatblimp_callback.evaluation import timed_score
from test_packing import cache_of
from test_plan import random_sentences

RTOL = 2e-6  # the method check's float32 tolerance


@pytest.fixture(scope="module")
def cache():
    return cache_of(random_sentences(random.Random(5), 3000, 500))


@pytest.fixture(scope="module")
def model():
    return tiny_llama(500, hidden=32).eval()


def _close(a: torch.Tensor, b: torch.Tensor, tokens) -> bool:
    return agree(a.double(), b.double(), tokens, RTOL)


def test_whole_vocabulary_chunks_give_the_tiled_heads_log_probs_also_where_logits_are_not_finite():
    model = tiny_llama(16, hidden=8)
    hidden = torch.randn(9, 8)
    with torch.no_grad():
        weight = model.get_output_embeddings().weight
        weight[:, :4] = 0
        weight[7, 0] = 1e30  # a logit of inf at token 7 for a context with hidden[:, 0] > 0
        weight[3, 3] = 1e30
    hidden[:, :4] = 0
    hidden[1, 0], hidden[6, 3], hidden[8, 2] = 1e30, -1e30, float("nan")
    contexts = torch.tensor([8, 0, 6, 1, 1, 2, 3, 4, 4, 5, 6, 7, 1])  # unsorted, as tree rows read them
    targets = torch.tensor([2, 7, 3, 7, 2, 3, 5, 5, 3, 9, 1, 0, 15])
    tiled = tiled_head.head_logprobs(model, hidden, contexts, targets, (2, 6))
    for rows in (1, 2, 4, 9, 50):
        chunks = tiled_head.chunked_logprobs(model, hidden, contexts, targets, rows)
        assert torch.equal(torch.isnan(chunks), torch.isnan(tiled)), rows
        assert torch.equal(chunks == float("-inf"), tiled == float("-inf")), rows
        assert torch.isnan(chunks).sum() == 2 and (chunks == float("-inf")).sum() == 3  # inf - inf, NaN; -inf x 3
        finite = torch.isfinite(tiled)
        assert torch.allclose(chunks[finite], tiled[finite], rtol=RTOL, atol=0), rows


def test_the_first_evaluation_times_every_candidate_keeps_their_output_and_stays_within_its_bound(cache, model, monkeypatch):
    monkeypatch.setattr(head_choice, "MIN_CHOICE_FLOPS", 0)
    scorer = Scorer(model, cache, method=ScoringMethod("tree", "tiled"), row_length=128)
    calls, checking = [], []  # (method, contexts, made by a comparison) of each head call
    original = head_choice.method_logprobs
    monkeypatch.setattr(
        head_choice,
        "method_logprobs",
        lambda lm, m, *a: calls.append((str(m), a[0].shape[0], bool(checking))) or original(lm, m, *a),
    )
    original_check = head_choice.HeadChoice._check

    def check(self, *args):  # a candidate's comparison with today's tiles: its calls are not output
        checking.append(True)
        try:
            return original_check(self, *args)
        finally:
            checking.pop()

    monkeypatch.setattr(head_choice.HeadChoice, "_check", check)
    scores = scorer.score()
    record = scorer.head_choice
    assert record["chosen_by"] == "timing" and str(scorer.head_method) == record["head_method"]
    names = [str(m) for m in candidates(torch.device("cpu"), 500, torch.float32, scorer.memory_budget, 10**9)]
    assert names == ["tiles", "chunks:256", "chunks:512", "chunks:1024"]
    timed = {name: t for name, t in record["candidates"].items() if t["pieces"]}
    assert "tiles" in timed and len(timed) >= 2 and all(t["exact"] for t in timed.values())
    assert 0 <= record["timing_added_seconds"] <= 1.5 * record["timing_bound_seconds"]
    # Every context is scored once as output (the pieces and the rest), plus the few each candidate is compared on.
    contexts = sum(b.score_positions.numel() for b in scorer.layout().batches)
    compared = [(name, n) for name, n, made_by_comparison in calls if made_by_comparison]
    assert compared and all(name == "tiles" and n <= head_choice.CHECKED_CONTEXTS for name, n in compared)
    assert sum(n for _, n, made_by_comparison in calls if not made_by_comparison) == contexts
    forced = Scorer(model, cache, method=ScoringMethod("tree", "tiled"), row_length=128, head_method="tiles")
    expected = forced.score()
    tokens = torch.tensor(cache.lengths, dtype=torch.float64) - 1
    assert _close(scores, expected, tokens) and not torch.equal(scores, torch.zeros_like(scores))
    # Later evaluations use the chosen method alone, and the results say what it was and how it was chosen.
    calls.clear()
    logprobs, info = timed_score(scorer)
    assert {name for name, *_ in calls} == {record["head_method"]} and _close(logprobs, expected, tokens)
    assert info["head_method"] == record["head_method"] and info["head_choice"] is record
    assert forced.head_choice == {"head_method": "tiles", "chosen_by": "given"}


def test_a_candidate_that_disagrees_is_never_used_and_its_piece_is_scored_again(cache, model, monkeypatch):
    monkeypatch.setattr(head_choice, "MIN_CHOICE_FLOPS", 0)
    original = head_choice.chunked_logprobs
    monkeypatch.setattr(head_choice, "chunked_logprobs", lambda *a: original(*a) + 1e-3)  # off by far more than rounding
    scorer = Scorer(model, cache, method=ScoringMethod("tree", "tiled"), row_length=128)
    scores = scorer.score()
    assert str(scorer.head_method) == "tiles"
    assert all(t["exact"] is False for name, t in scorer.head_choice["candidates"].items() if name != "tiles" and t["pieces"])
    expected = Scorer(model, cache, method=ScoringMethod("tree", "tiled"), row_length=128, head_method="tiles").score()
    assert _close(scores, expected, torch.tensor(cache.lengths, dtype=torch.float64) - 1)


def test_a_forced_head_method_is_used_untimed_and_a_small_head_is_not_timed(cache, model, monkeypatch):
    rows = []
    original = tiled_head.chunked_logprobs
    monkeypatch.setattr(head_choice, "chunked_logprobs", lambda lm, h, c, t, r: rows.append(r) or original(lm, h, c, t, r))
    forced = Scorer(model, cache, head_method="chunks:7")
    scores = forced.score()
    assert set(rows) == {7} and forced.head_choice == {"head_method": "chunks:7", "chosen_by": "given"}
    small = Scorer(model, cache)  # 500 x 32 head on a few thousand contexts: below MIN_CHOICE_FLOPS
    rows.clear()
    assert _close(small.score(), scores, torch.tensor(cache.lengths, dtype=torch.float64) - 1)
    assert rows == [] and small.head_choice == {"head_method": "tiles", "chosen_by": "head work too small to time"}


@pytest.mark.parametrize("name", ["tile", "chunks", "chunks:0", "chunks:x", "tiles:3"])
def test_an_unknown_head_method_names_the_choices(name, cache, model):
    with pytest.raises(ValueError, match=r"unknown head method .*'tiles' or 'chunks:N'"):
        Scorer(model, cache, head_method=name)


def test_chunks_are_cut_to_the_memory_budget_and_to_a_forward_calls_contexts():
    cpu = torch.device("cpu")
    # 48K float32: 8 bytes a logit; 512 MiB holds 1,398 rows, so 256, 512 and 1024 all fit.
    assert [str(m) for m in candidates(cpu, 48000, torch.float32, 512 * 2**20, 10**6)] == [
        "tiles",
        "chunks:256",
        "chunks:512",
        "chunks:1024",
    ]
    # 256K: 256 rows fit; every larger size is cut to it, and the same size is one candidate.
    assert candidates(cpu, 262144, torch.float32, 512 * 2**20, 10**6) == [HeadMethod("tiles"), HeadMethod("chunks", 256)]
    assert candidates(cpu, 4096, torch.float32, 512 * 2**20, 300) == [
        HeadMethod("tiles"),
        HeadMethod("chunks", 256),
        HeadMethod("chunks", 300),
    ]


def test_the_score_command_forces_the_head_method_and_writes_it_and_names_a_wrong_one(model_dir, tmp_path, capsys):
    import json

    from conftest import DATA
    from tatblimp_callback.cli import main

    out = tmp_path / "results.json"
    args = ["score", str(model_dir), "--data", str(DATA), "--limit", "2", "--device", "cpu", "--output", str(out)]
    assert main([*args, "--head-method", "chunks:5", "--row-length", "64"]) == 0
    results = json.loads(out.read_text())
    assert results["head_method"] == "chunks:5" and results["head_choice"] == {"head_method": "chunks:5", "chosen_by": "given"}
    with pytest.raises(SystemExit) as refused:  # by the parser, before the model loads
        main([*args, "--head-method", "chunk:5"])
    assert refused.value.code == 2
    assert "argument --head-method: unknown head method 'chunk:5': expected 'tiles' or 'chunks:N'" in capsys.readouterr().err


def test_a_candidate_timed_on_one_piece_only_is_not_kept_however_fast_it_looked():
    chunks = HeadMethod("chunks", 256)
    for pieces, kept in ((1, "tiles"), (head_choice.ROUNDS, "chunks:256")):
        choice = head_choice.HeadChoice()
        choice.start([head_choice.TILES, chunks], 10_000, 20_000, 0.0, RTOL, lambda: None)
        for method, rate, n in ((head_choice.TILES, 4e-3, 2), (chunks, 1.5e-3, pieces)):
            timing = choice._plan["timings"][method]
            timing.pieces, timing.best_rate, timing.contexts, timing.exact = n, rate, 256 * n, True
            timing.seconds = rate * timing.contexts
        choice._plan["body_rate"] = 1e-4
        choice.finish()
        assert str(choice.method) == kept and choice.record["head_method"] == kept, pieces


def test_the_head_is_timed_on_its_own_gpu(monkeypatch):
    """With the head on another GPU than the current one (a device map), the clock waits for that GPU's work:
    ``torch.cuda.synchronize(device)``, not the current device's (CUDA stubbed: a weight that reports cuda:1)."""
    from types import SimpleNamespace

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    weight = SimpleNamespace(shape=(48_000, 1280), device=torch.device("cuda", 1), dtype=torch.bfloat16)
    batch = SimpleNamespace(score_positions=torch.zeros(4096, dtype=torch.long))
    layout = SimpleNamespace(batches=[batch], total_positions=40_000, padded_positions=0)
    choice = head_choice.HeadChoice()
    choice.begin(layout, False, weight, torch.bfloat16, 1 << 30, 0.5)
    assert choice.choosing
    choice._plan["sync"]()
    assert waited == [torch.device("cuda", 1)]
    hidden, contexts, targets = torch.zeros(2, 3), torch.tensor([0, 1]), torch.tensor([0, 0])
    choice.forward_logprobs(lambda: (hidden, contexts, targets, 8), lambda *a: torch.zeros(2), torch.device("cuda", 1))
    assert waited[1:3] == [torch.device("cuda", 1)] * 2  # before and after the body
