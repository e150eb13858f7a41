"""Below float32 the method check judges methods against the float32 truth of the same weights: a bf16 model
whose rounding changes with the batch's shape (as GPU kernels do) is scored, not refused."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_llama
from tatblimp_callback import Scorer, build_cache
from tatblimp_callback.engine.model_checks import ScoringError
from tatblimp_callback.engine.precision import upcast_weights

NOISE = 0.05  # relative, on the final hidden states: more than bf16's own rounding on a CPU, as on an H200 at init 0.1


@pytest.fixture(scope="module")
def cache(bpe_tokenizer, small_data):
    return build_cache(bpe_tokenizer, small_data, allow_modified=True)


def shape_noise(model, scale: float = NOISE) -> None:
    """Rounding that depends on the batch's shape: the body's output times (1 + scale x noise), the noise drawn
    from a generator seeded by the tensor's shape, in bf16 only (the float32 truth has none), as a GPU's
    kernels, chosen by shape, round the same numbers differently."""

    def hook(module, args, output):
        if output.dtype != torch.bfloat16:
            return output
        generator = torch.Generator().manual_seed(hash(tuple(output.shape)) % 2**31)
        noise = torch.randn(output.shape, generator=generator).to(output.dtype)
        return output * (1 + scale * noise)

    model.model.norm.register_forward_hook(hook)


def noisy_bf16_model(vocab: int):
    model = tiny_llama(vocab, hidden=64, initializer_range=0.2).to(torch.bfloat16)
    shape_noise(model)
    return model


def test_todays_check_refuses_the_noisy_model_and_the_float32_truth_accepts_the_fastest_method(bpe_tokenizer, cache):
    refused = Scorer(noisy_bf16_model(len(bpe_tokenizer)), cache)
    refused.check.truth = None  # the check as it was: methods against the plain bf16 forward only
    with pytest.raises(ScoringError, match="no scoring method matches"):
        refused.score()
    scorer = Scorer(noisy_bf16_model(len(bpe_tokenizer)), cache)
    logprobs = scorer.score()
    assert str(scorer.method) == "tree rows, tiled head"  # the fastest
    assert torch.isfinite(logprobs).all()
    # The noise really is beyond today's allowance: tree rows and the plain forward differ by nats.
    sample = scorer.check.sample
    plain = scorer.check.reference(sample)
    assert (logprobs[sample] - plain.cpu()).abs().max() > 1.0
    # The kept per-token error against the float32 truth: the rounding exact_decisions bounds margins with.
    assert scorer.check.rounding is not None and scorer.check.rounding.max() > 0.01


def test_a_method_that_drops_position_ids_is_still_refused_below_float32(bpe_tokenizer, cache):
    from test_method_check import drop_position_ids

    model = noisy_bf16_model(len(bpe_tokenizer))
    drop_position_ids(model)
    scorer = Scorer(model, cache)
    scorer.score()
    assert scorer.method.layout == "padded"


def test_the_callback_scores_the_noisy_bf16_model(bpe_tokenizer, small_data, tmp_path):
    from tatblimp_callback import TatBLiMPCallback
    from trainer_utils import make_trainer, tatblimp_entries

    callback = TatBLiMPCallback(data=small_data, allow_modified=True, eval_steps=2, raise_on_error=True)
    trainer = make_trainer(noisy_bf16_model(len(bpe_tokenizer)), bpe_tokenizer, tmp_path, [callback], max_steps=2)
    trainer.train()
    assert [entry["step"] for entry in tatblimp_entries(trainer)] == [0, 2]
    assert callback.failures == 0


def test_upcast_weights_computes_in_float32_a_module_at_a_time_and_puts_the_weights_back(bpe_tokenizer, cache):
    model = tiny_llama(len(bpe_tokenizer)).to(torch.bfloat16)
    float32 = copy.deepcopy(model).float()  # the same weights and buffers (the rotary frequencies, in bf16 too)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([cache.sentence(0)])
    seen = []
    model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: seen.append(m.up_proj.weight.dtype))
    with torch.no_grad(), upcast_weights(model):
        upcast = model(input_ids=ids).logits
    with torch.no_grad():
        expected = float32(input_ids=ids).logits
    assert upcast.dtype == torch.float32 and torch.equal(upcast, expected)
    assert seen == [torch.bfloat16]  # back to bf16 once its own call returned
    after = model.state_dict()
    assert all(after[k].dtype == torch.bfloat16 and torch.equal(after[k], before[k]) for k in before)
