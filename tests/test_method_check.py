"""The scoring method stays right once the model has trained: a forward that drops or misreads
position ids is caught at initialisation, or at the re-check after the weights have moved."""

from __future__ import annotations

import pytest
import torch

from conftest import CORPUS, reference_logprobs
from tatblimp_callback import Scorer, ScoringMethod, build_cache
from tatblimp_callback.engine import scoring
from tatblimp_callback.engine.model_checks import weight_fingerprint
from tatblimp_callback.engine.scoring_method import MOVED, RECHECK_EVERY, RecheckSchedule

# bf16 rounding: padded rows and a one-sentence-at-a-time bf16 forward differ by at most 0.03 nats
# here; tree rows of a forward that drops position ids, by a median of about 0.5 (up to 4).
BF16_ROUNDING = 0.1


@pytest.fixture(scope="module")
def cache(bpe_tokenizer, small_data):
    return build_cache(bpe_tokenizer, small_data, allow_modified=True)


def llama(vocab_size: int, hidden: int = 64):
    """A small Llama at its own (transformers') initialisation, where positions barely change the log-probs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def trained_weights(bpe_tokenizer) -> dict[str, torch.Tensor]:
    """The weights of ``llama`` after a few seconds of training on the Tatar corpus: positions matter in them."""
    model = llama(len(bpe_tokenizer)).train()
    lines = [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()][:3000]
    ids = [t for line in lines for t in [bpe_tokenizer.bos_token_id, *bpe_tokenizer(line, add_special_tokens=False)["input_ids"]]]
    blocks = torch.tensor(ids[: len(ids) // 64 * 64]).view(-1, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        batch = blocks[torch.randint(0, len(blocks), (16,), generator=generator)]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def drop_position_ids(model) -> None:
    """Make the model's base forward ignore ``position_ids`` (it then counts 0, 1, 2, ... along each row)."""
    model.model.register_forward_pre_hook(lambda module, args, kwargs: (args, {**kwargs, "position_ids": None}), with_kwargs=True)


def blind_attention(model) -> None:
    """Zero query weights: every position attends uniformly to what it may see, so positions do not matter."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()


def one_at_a_time(model, cache) -> torch.Tensor:
    return torch.tensor(reference_logprobs(model, [cache.sentence(s) for s in range(cache.num_sentences)]), dtype=torch.float64)


def assert_within_rounding(scores: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    difference = (scores - reference).abs().max().item()
    assert difference < (1e-4 if dtype == torch.float32 else BF16_ROUNDING), difference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_a_forward_that_drops_position_ids_is_caught_at_initialisation(bpe_tokenizer, cache, trained_weights, dtype):
    model = llama(len(bpe_tokenizer)).to(dtype)
    drop_position_ids(model)
    scorer = Scorer(model, cache)
    scorer.score()
    # Doubled position ids give bit-identical outputs: tree and packed rows are ruled out, whatever the weights.
    assert scorer.method.layout == "padded"
    model.load_state_dict(trained_weights)
    assert_within_rounding(scorer.score(), one_at_a_time(model, cache), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_a_method_that_goes_wrong_as_the_model_trains_is_replaced(
    bpe_tokenizer, cache, trained_weights, dtype, monkeypatch, caplog
):
    model = llama(len(bpe_tokenizer)).to(dtype)
    drop_position_ids(model)
    # Suppose the check at initialisation misses it: the probe says positions are read, and
    # attention is blind to them (zero query weights), so every layout agrees with a plain forward.
    monkeypatch.setattr(scoring, "forward_reads_position_ids", lambda *args: True)
    blind_attention(model)
    scorer = Scorer(model, cache)
    scorer.score()
    assert scorer.method == ScoringMethod("tree", "tiled")
    model.load_state_dict(trained_weights)
    wrong = Scorer(model, cache, method=ScoringMethod("tree", "tiled")).score()
    reference = one_at_a_time(model, cache)
    assert (wrong - reference).abs().median().item() > 0.2  # tree rows are now wrong by far more than rounding
    # The weights moved: the next evaluation checks the method again, replaces it, and scores on the new one.
    scores = scorer.score()
    assert_within_rounding(scores, reference, dtype)
    assert scorer.method.layout == "padded" and scorer.method_replacements == 1
    assert "tree rows, tiled head no longer matches a plain forward" in caplog.text


def test_layouts_ruled_out_by_position_blind_weights_are_tried_again_once_the_weights_move(bpe_tokenizer, cache, trained_weights):
    model = llama(len(bpe_tokenizer))
    blind_attention(model)  # doubled position ids change nothing
    scorer = Scorer(model, cache)
    scorer.score()
    # Tree rows are ruled out; packed rows pass (doubled ids also move where packed sequences start).
    assert scorer.method.layout == "packed"
    model.load_state_dict(trained_weights)
    scores = scorer.score()
    assert scorer.method == ScoringMethod("tree", "tiled") and scorer.method_replacements == 0
    assert_within_rounding(scores, one_at_a_time(model, cache), torch.float32)


def test_recheck_schedule_after_the_weights_move_then_every_tenth_evaluation_never_on_frozen_weights(bpe_tokenizer):
    model = llama(len(bpe_tokenizer))
    reads = []

    def fingerprint():  # the weights' fingerprint, counting its reads
        reads.append(1)
        return weight_fingerprint(model)

    schedule = RecheckSchedule()
    schedule.checked(fingerprint)
    # The weights it was checked on, bit for bit: a check would find what the last one found.
    assert not any(schedule.due(fingerprint) for _ in range(3 * RECHECK_EVERY))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + MOVED / 2)  # not yet appreciable, but no longer the weights it was checked on
    assert schedule.due(fingerprint)  # more than 10 evaluations since the check
    schedule.checked(fingerprint)
    assert not any(schedule.due(fingerprint) for _ in range(RECHECK_EVERY - 1))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + MOVED / 2)
    assert schedule.due(fingerprint)  # the 10th evaluation since the check, on weights that moved a little
    schedule.checked(fingerprint)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + MOVED / 2)
    assert not schedule.due(fingerprint)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + 2 * MOVED)
    assert schedule.due(fingerprint)  # moved by more than 1%: checked at once
    assert len(reads) == 3 * RECHECK_EVERY + RECHECK_EVERY + 6  # while the first move was awaited: one read a call
    schedule.checked(fingerprint)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + 2 * MOVED)
    assert not any(schedule.due(fingerprint) for _ in range(RECHECK_EVERY - 1))  # after that, every 10th only
    assert schedule.due(fingerprint)
    assert len(reads) == 3 * RECHECK_EVERY + RECHECK_EVERY + 6  # and the weights are not read again


def test_once_the_weights_have_moved_an_evaluation_reads_no_fingerprint(bpe_tokenizer, cache, monkeypatch):
    """The fingerprint serves only the wait for the first move: a training run's later evaluations skip reading
    the weights (on a GPU, a copy to the host at every evaluation)."""
    from tatblimp_callback.engine import method_check

    reads = []
    monkeypatch.setattr(method_check, "weight_fingerprint", lambda lm: reads.append(1) or weight_fingerprint(lm))
    model = llama(len(bpe_tokenizer))
    scorer = Scorer(model, cache)
    scorer.score()
    scorer.score()  # the weights as checked: one read to see that
    assert len(reads) == 2

    def train():
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1 + 2 * MOVED)

    train()
    scorer.score()  # moved: checked again at once
    assert len(reads) == 3  # the read that saw the move (nothing is kept at that check: no move is awaited)
    for _ in range(RECHECK_EVERY + 2):  # the schedule counts evaluations only from now on
        train()
        scorer.score()
    assert len(reads) == 3
    assert scorer.check.recheck.since_check == 2  # the tenth evaluation after the move was checked again


def test_frozen_weights_are_not_checked_again_however_many_calls(bpe_tokenizer, monkeypatch):
    """The harness model's calls to ``lm_eval`` score a model whose weights never move: the method is checked once,
    at the first call, not at every tenth (each check is a plain forward of the whole sample, one sequence a row)."""
    from tatblimp_callback.engine import method_check
    from tatblimp_callback.harness.fused import RequestScorer

    checks = []
    original = method_check.MethodCheck._reference
    monkeypatch.setattr(method_check.MethodCheck, "_reference", lambda self: checks.append(1) or original(self))
    model = llama(len(bpe_tokenizer))
    scorer = RequestScorer(model)
    questions = [bpe_tokenizer.encode(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()[:6]]
    requests = [(context, context[:k]) for context in questions for k in (1, 2)]
    first = scorer.score(requests, 0, 256)
    for _ in range(2 * RECHECK_EVERY + 1):
        assert scorer.score(requests, 0, 256) == first
    assert len(checks) == 1
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + 2 * MOVED)
    scorer.score(requests, 0, 256)
    assert len(checks) == 2  # moved: checked at once
