"""``weights_label`` names every bit of a model's weights: two models that differ anywhere get different labels,
on the CPU path (sha256 of the bytes) and the accelerator path (``device_digest``, run here on the CPU), and the
in-loop monitor never reuses one set of weights' results for others."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_llama
from tatblimp_callback import Evaluator
from tatblimp_callback.engine import model_checks
from tatblimp_callback.engine.model_checks import FINGERPRINT_VALUES, device_digest, weights_label
from tatblimp_callback.tokenized.cache import build_cache


def unsampled_rows(weight: torch.Tensor, candidates: list[int]) -> list[int]:
    """The rows of ``weight`` holding none of the values ``weight_fingerprint`` samples (the old label's)."""
    stride = max(1, weight.numel() // FINGERPRINT_VALUES)
    sampled = {i // weight.shape[1] for i in range(0, weight.numel(), stride)[:FINGERPRINT_VALUES]}
    return [row for row in candidates if row not in sampled]


def swap_rows(weight: torch.Tensor, a: int, b: int) -> None:
    with torch.no_grad():
        weight[[a, b]] = weight[[b, a]].clone()


def flip_bit(tensor: torch.Tensor, index: int, bit: int = 0) -> None:
    with torch.no_grad():
        words = tensor.view(-1).view(torch.int32)
        words[index] ^= 1 << bit


def test_any_changed_bit_or_swapped_rows_change_the_label(bpe_tokenizer):
    model = tiny_llama(len(bpe_tokenizer))
    head = model.lm_head.weight
    a, b = unsampled_rows(head, list(range(100, 200)))[:2]
    before = weights_label(model)
    assert weights_label(tiny_llama(len(bpe_tokenizer))) == before  # the same weights, the same label
    swap_rows(head, a, b)  # the same values, the same sum: the old label missed this
    swapped = weights_label(model)
    assert swapped != before
    swap_rows(head, a, b)
    assert weights_label(model) == before
    labels = {before}
    for tensor, index in [(head, 5 * head.shape[1] + 3), (model.model.layers[1].mlp.up_proj.weight, 77)]:
        for bit in (0, 31):  # the lowest mantissa bit, the sign
            flip_bit(tensor, index, bit)
            labels.add(weights_label(model))
            flip_bit(tensor, index, bit)
    assert len(labels) == 5 and weights_label(model) == before
    buffer = next(model.buffers())  # the rotary frequencies: a buffer, not a parameter
    flip_bit(buffer, 1)
    assert weights_label(model) != before


def test_the_accelerator_digest_sees_every_word_and_every_swap():
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(3 * model_checks.DIGEST_CHUNK // 2 + 7, generator=generator).to(torch.bfloat16)
    words = weights.view(torch.int16)
    base = device_digest(words)
    assert base.shape == (2,)  # one sum per chunk of 4M words
    for index in [0, 1, 12345, model_checks.DIGEST_CHUNK - 1, model_checks.DIGEST_CHUNK, words.numel() - 1]:
        for bit in (0, 7, 15):
            changed = words.clone()
            changed[index] ^= 1 << bit if bit < 15 else -(1 << 15)
            assert not torch.equal(device_digest(changed), base), (index, bit)
    rows = words[: 2048 * 64].view(2048, 64)
    for a, b in [(0, 1), (10, 2000), (511, 512)]:
        swapped = words.clone()
        swapped[: 2048 * 64].view(2048, 64)[[a, b]] = rows[[b, a]]
        assert not torch.equal(device_digest(swapped), base), (a, b)
    assert torch.equal(device_digest(words.clone()), base)


def test_the_monitor_scores_weights_that_differ_only_in_two_swapped_head_rows(tmp_path, bpe_tokenizer, small_data):
    pytest.importorskip("lightning")
    import lightning as L

    from tatblimp_callback.lightning import TatBLiMPLightningCallback
    from test_lightning import Wrapped, fit

    cache = build_cache(bpe_tokenizer, small_data, allow_modified=True)
    frequent = torch.bincount(cache.token_ids[cache.token_ids != cache.prefix_token_id]).argsort(descending=True).tolist()
    module = Wrapped(len(bpe_tokenizer), lr=0.0)
    a, b = unsampled_rows(module.model.lm_head.weight, frequent)[:2]

    class Swap(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                swap_rows(pl_module.model.lm_head.weight, a, b)

    callback = TatBLiMPLightningCallback(tokenizer=bpe_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=1)
    fit(module, None, tmp_path, 1, bpe_tokenizer, callbacks=[Swap(), callback])
    assert [e["step"] for e in callback.history] == [0, 1]
    fresh = Evaluator(bpe_tokenizer, small_data, allow_modified=True)(module.model.eval())
    logprobs = [(p.good_logprob, p.bad_logprob) for p in callback.last_results.pairs]
    assert logprobs == [(p.good_logprob, p.bad_logprob) for p in fresh.pairs]  # step 1's own, not step 0's again
    assert callback.history[1]["tatblimp/acc_norm"] == fresh.acc_norm
    assert callback.last_results.run_info["weights"] == fresh.run_info["weights"] == weights_label(module.model)


@pytest.mark.parametrize("protocol", ["logprob", "both"])
def test_an_in_loop_evaluation_hashes_the_weights_once(tmp_path, chat_tokenizer, small_data, monkeypatch, protocol):
    """The monitor's label of the weights is the one the results carry: every weight is hashed once per evaluation,
    not again by each evaluator (it costs as much as a forward pass over the weights)."""
    pytest.importorskip("lightning")
    from tatblimp_callback.lightning import TatBLiMPLightningCallback
    from test_lightning import Wrapped, fit

    hashed = []
    original = model_checks.tensor_digest
    monkeypatch.setattr(model_checks, "tensor_digest", lambda tensor: hashed.append(tensor.numel()) or original(tensor))
    module = Wrapped(len(chat_tokenizer))
    module.model = tiny_llama(len(chat_tokenizer), max_position_embeddings=512).train()  # room for the chat prompts
    held = [t.numel() for _, t in [*module.model.named_parameters(), *module.model.named_buffers()] if t.numel()]
    callback = TatBLiMPLightningCallback(
        tokenizer=chat_tokenizer, data=small_data, allow_modified=True, eval_every_n_steps=1, protocol=protocol
    )
    fit(module, None, tmp_path, 2, chat_tokenizer, callbacks=[callback])
    assert [e["step"] for e in callback.history] == [0, 1, 2]
    assert hashed == held * 3  # steps 0, 1 and 2: each weight once
    labels = [json.loads(line)["weights"] for line in (tmp_path / "tatblimp_history.jsonl").read_text().splitlines()]
    assert len(set(labels)) == 3 and labels[-1] == callback.last_results.run_info["weights"] == weights_label(module.model)
    if protocol == "both":
        assert callback.last_fc_results.run_info["weights"] == labels[-1]
