"""The one greedy reader of harness requests (``engine/greedy_head.py``, ``tiled_head.logprobs_and_greedy``):
``is_greedy`` is ``torch.argmax``'s first index of the maximum, ties included, in every tiling; the hidden states go
to the head's device; the harness model, scored by the engine's ``Scorer`` (``harness/fused.py``), scores a model whose
weights a device map keeps off its input device, retries out of memory and checks its method again."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from tatblimp_callback.engine.greedy_head import greedy_logprobs
from tatblimp_callback.engine.tiled_head import first_max, logprobs_and_greedy


def tied_head(vocab: int = 12, hidden: int = 4, seed: int = 0):
    """Hidden states and a head whose columns 2, 5 and 9 are the same row, the largest logit of every context."""
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(6, hidden, generator=generator).abs() + 0.5
    weight = torch.randn(vocab, hidden, generator=generator) * 0.1
    weight[[2, 5, 9]] = 3.0
    return states, weight


@pytest.mark.parametrize("tile", [(64, 64), (64, 4), (2, 4), (2, 3), (64, 1)])
@pytest.mark.parametrize("as_logits", [False, True])
def test_greedy_is_the_first_index_of_the_maximum_on_tied_logits(tile, as_logits):
    states, weight = tied_head()
    logits = torch.nn.functional.linear(states, weight)
    assert (logits[:, 2] == logits[:, 5]).all() and (logits.argmax(-1) == 2).all()
    contexts = torch.arange(6).repeat_interleave(4)
    targets = torch.tensor([2, 5, 9, 0] * 6)
    if as_logits:
        logprobs, greedy = logprobs_and_greedy(logits, None, None, None, contexts, targets, tile)
    else:
        logprobs, greedy = logprobs_and_greedy(states, weight, None, None, contexts, targets, tile)
    assert greedy.tolist() == [True, False, False, False] * 6  # the tied later columns are not the argmax
    assert greedy.tolist() == (logits.argmax(-1)[contexts] == targets).tolist()
    expected = logits.float().log_softmax(-1)[contexts, targets]
    torch.testing.assert_close(logprobs, expected, rtol=1e-6, atol=1e-6)


def test_greedy_flags_equal_argmax_on_random_logits_with_many_ties():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 40, (40, 50), generator=generator).float()  # ties at the top of many rows
    contexts = torch.arange(40).repeat_interleave(5)
    targets = torch.randint(0, 50, (200,), generator=generator)
    targets[::5] = logits.argmax(-1)  # the first maximum of each row: greedy
    targets[1::5] = 49 - logits.flip(-1).argmax(-1)  # its last maximum: greedy only where the maximum is alone
    for tile in [(64, 64), (7, 8), (3, 13)]:
        _, greedy = logprobs_and_greedy(logits, None, None, None, contexts, targets, tile)
        assert greedy.tolist() == (logits.argmax(-1)[contexts] == targets).tolist(), tile
    assert 0 < int(greedy[1::5].sum()) < 40


@pytest.mark.parametrize("columns", [128, 300, 1000, 90])
def test_first_max_is_torch_max_by_blocks_ties_nan_and_infinities_included(columns):
    generator = torch.Generator().manual_seed(columns)
    logits = torch.randint(0, 30, (50, columns), generator=generator).float()  # many tied maxima, across blocks
    logits[3] = float("-inf")
    logits[4, 7] = logits[5, columns - 1] = float("nan")  # in a block; in the last columns (or a block)
    logits[6, columns // 2] = logits[6, columns - 2] = float("inf")
    logits[7, :] = 29.0  # every column the maximum: the first
    top, first = first_max(logits)
    expected_top, expected_first = logits.max(-1)
    assert torch.equal(first, expected_first), (first - expected_first).nonzero()
    assert torch.equal(top.nan_to_num(), expected_top.nan_to_num())
    assert first[7] == 0 and first[4] == 7 and first[5] == columns - 1


def test_greedy_flags_equal_argmax_on_a_wide_vocabulary_with_ties_across_blocks():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randint(0, 60, (30, 700), generator=generator).float()
    contexts = torch.arange(30).repeat_interleave(3)
    targets = torch.randint(0, 700, (90,), generator=generator)
    targets[::3] = logits.argmax(-1)
    targets[1::3] = 699 - logits.flip(-1).argmax(-1)  # the last maximum: another block than the first, mostly
    for tile in [(64, 700), (64, 256), (8, 300)]:
        _, greedy = logprobs_and_greedy(logits, None, None, None, contexts, targets, tile)
        assert greedy.tolist() == (logits.argmax(-1)[contexts] == targets).tolist(), tile
    assert int(greedy[::3].sum()) == 30 and int(greedy[1::3].sum()) < 30


def test_the_greedy_reader_computes_on_the_heads_device():
    """Under a device map the last layer's hidden states and the cache's indices are not on the head's device: the
    reader moves them there (the head here on ``meta``, the states and indices on the CPU)."""
    model = tiny_llama(40, seed=2)
    model.lm_head.to("meta")
    hidden = torch.randn(3, model.config.hidden_size)
    contexts, targets = torch.tensor([0, 1, 2, 2]), torch.tensor([1, 2, 3, 4])
    logprobs, greedy = greedy_logprobs(model, hidden, contexts, targets, "tiled", 1 << 20)
    assert logprobs.device.type == "meta" and greedy.device.type == "meta"
    assert logprobs.shape == (4,) and greedy.shape == (4,)


def test_the_harness_model_scores_a_model_whose_device_map_leaves_its_first_weight_on_meta():
    """accelerate's ``cpu_offload`` (as a ``device_map`` with offload) keeps every weight on the meta device until its
    layer runs: the requests go on the device the model takes its input on, and score as without the offload."""
    accelerate = pytest.importorskip("accelerate")
    from tatblimp_callback.harness.fused import RequestScorer

    model = tiny_llama(50, seed=1)
    requests = [([1, 5, 7], [9, 3]), ([1, 5, 7], [4]), ([2, 8], [11, 12, 13]), ([2, 8, 11], [12])]
    plain = RequestScorer(model).score(requests, 0, 64)
    accelerate.cpu_offload(model, execution_device="cpu")
    assert next(model.parameters()).device.type == "meta"
    offloaded = RequestScorer(model).score(requests, 0, 64)
    assert [ll for ll, _ in offloaded] == pytest.approx([ll for ll, _ in plain], abs=1e-5)
    assert [g for _, g in offloaded] == [g for _, g in plain]


def test_the_harness_model_scores_through_the_scorers_retry_and_method_recheck(monkeypatch):
    """``RequestScorer`` is the engine's ``Scorer`` on spans: an out-of-memory forward is retried at half the budget
    with the same answers, the method is checked again once the weights have moved (it was chosen once for life),
    and the same requests again reuse the scorer and its plan."""
    import tatblimp_callback.engine.batch_forward as batch_forward
    from tatblimp_callback.harness.fused import RequestScorer

    model = tiny_llama(50, seed=6)
    requests = [([1, 5, 7, 2], [9, 3]), ([1, 5, 7, 2], [4]), ([2, 8], [11, 12, 13]), ([6], [7, 8])]
    expected = RequestScorer(model, memory_budget=64 << 20).score(requests, 0, 64)

    scorer = RequestScorer(model, memory_budget=64 << 20)
    failures = iter([True])
    original = batch_forward.model_output

    def once_out_of_memory(*args, **kwargs):
        if next(failures, False):
            raise torch.OutOfMemoryError("emulated")
        return original(*args, **kwargs)

    monkeypatch.setattr(batch_forward, "model_output", once_out_of_memory)
    assert scorer.score(requests, 0, 64) == expected
    assert scorer._scorer.oom_retries == 1 and scorer._scorer.memory_budget == 32 << 20

    first = scorer._scorer
    assert scorer.score(requests, 0, 64) == expected and scorer._scorer is first  # the same requests: the same plan
    checks = []
    check = scorer._checker.check
    reference = check.reference
    monkeypatch.setattr(check, "reference", lambda sequences: checks.append(sequences) or reference(sequences))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)
    moved = scorer.score(requests[:3], 0, 64)
    assert checks, "the method was not checked again after the weights moved"
    assert moved != expected[:3]


def test_the_harness_model_reads_the_models_own_logits_as_the_heads_tiles():
    """A head that is not a plain linear layer (a forward hook here) is read from the model's own logits: the same
    log-probs and greedy flags as the tiled head's."""
    from tatblimp_callback.harness.fused import RequestScorer

    model = tiny_llama(50, seed=7)
    context = [1, 5, 7, 2]
    with torch.no_grad():
        greedy = model(torch.tensor([context])).logits[0, -1].argmax().item()
    requests = [(context, [greedy]), (context, [(greedy + 1) % 50]), ([2, 8], [11, 12, 13]), ([6], [7, 8])]
    tiled = RequestScorer(model).score(requests, 0, 64)
    model.lm_head.register_forward_hook(lambda module, args, output: None)
    scorer = RequestScorer(model)
    own = scorer.score(requests, 0, 64)
    assert scorer.method.head == "full_logits"
    assert [ll for ll, _ in own] == pytest.approx([ll for ll, _ in tiled], abs=1e-5)
    assert [g for _, g in own] == [g for _, g in tiled] and own[0][1] and not own[1][1]


def test_a_softcapped_models_own_logits_are_not_capped_again():
    """Gemma 2 caps its logits (``final_logit_softcapping``) in its own forward: read from those logits, the log-probs
    are the plain forward's, not capped a second time."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from tatblimp_callback.harness.fused import RequestScorer

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=60,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        final_logit_softcapping=1.5,
    )
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 1.0)
    model.lm_head.register_forward_hook(lambda module, args, output: None)  # read from the model's own logits
    requests = [([1, 5, 7, 2], [9, 3]), ([2, 8], [11, 12, 13])]
    scorer = RequestScorer(model)
    answers = scorer.score(requests, 0, 64)
    assert scorer.method.head == "full_logits"
    for (context, continuation), (logprob, _) in zip(requests, answers, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([context + continuation])).logits[0].float().log_softmax(-1)
        expected = sum(logits[len(context) - 1 + i, t].item() for i, t in enumerate(continuation))
        assert logprob == pytest.approx(expected, abs=1e-5)


PROCESS_REQUESTS = [
    [([1, 5, 7, 2], [9, 3]), ([1, 5, 7, 2], [4]), ([2, 8], [11, 12, 13])],
    [([6], [7, 8]), ([3, 3, 9], [1]), ([3, 3, 9], [2, 5]), ([4, 1], [10]), ([4, 2], [10])],
]


def _score_own_requests(rank: int, init_file: str, out_dir: str) -> None:
    """One of two processes of the harness's data parallelism: requests of its own, scored alone."""
    import datetime
    import json

    import torch.distributed as dist

    from tatblimp_callback.harness.fused import RequestScorer

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    try:
        answers = RequestScorer(tiny_llama(50, seed=8), each_process_its_own=True).score(PROCESS_REQUESTS[rank], 0, 64)
        with open(f"{out_dir}/{rank}.json", "w") as f:
            json.dump(answers, f)
    finally:
        dist.destroy_process_group()


def test_each_process_scores_its_own_requests_alone(tmp_path):
    """``--model tatblimp`` in the harness's data-parallel mode: each process gets other requests (different counts),
    and scores them alone, with no collective over them; each gets what one process alone gives."""
    import json

    import torch.multiprocessing as mp

    from tatblimp_callback.harness.fused import RequestScorer

    mp.spawn(_score_own_requests, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        alone = RequestScorer(tiny_llama(50, seed=8)).score(PROCESS_REQUESTS[rank], 0, 64)
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert [tuple(answer) for answer in got] == alone
