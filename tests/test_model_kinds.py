"""Models as users bring them: LoRA on the LM head, models that are not causal LMs, a model moved after
scoring, float32 scoring under TF32 set through torch's new precision API."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_llama
from tatblimp_callback import Evaluator, evaluate
from tatblimp_callback.engine.scoring import ScoringError, ScoringMethod
from tatblimp_callback.engine.scoring_method import RELATIVE_TOLERANCE, TF32_TOLERANCE, relative_tolerance

PLAIN = ScoringMethod("padded", "full_logits")  # one sequence per row through the model's own forward: the definition


def good_logprobs(results) -> torch.Tensor:
    return torch.tensor([p.good_logprob for p in results.pairs], dtype=torch.float64)


def test_lora_on_the_lm_head_is_scored_through_the_adapter(bpe_tokenizer, small_data):
    from peft import LoraConfig, get_peft_model

    from tatblimp_callback.engine.model_checks import relative_change, unwrap_model, weight_fingerprint
    from tatblimp_callback.engine.scoring_method import MOVED

    model = get_peft_model(tiny_llama(len(bpe_tokenizer)), LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"]))
    evaluator = Evaluator(bpe_tokenizer, small_data, allow_modified=True)
    evaluator(model)  # the adapter starts at zero: the frozen head alone gives the same numbers
    before = weight_fingerprint(unwrap_model(model))
    with torch.no_grad():  # training moves the adapter; the frozen weights, most of the fingerprint, stay
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    assert relative_change(weight_fingerprint(unwrap_model(model)), before) < MOVED  # no re-check of the method is due
    trained = evaluator(model)
    reference = evaluate(model, bpe_tokenizer, small_data, allow_modified=True, method=PLAIN)
    assert trained.run_info["scoring_method"].endswith("full logits")
    assert (good_logprobs(trained) - good_logprobs(reference)).abs().max() < 1e-3
    # The adapter matters: the base model alone scores these sentences differently.
    base = copy.deepcopy(model).unload()
    base_logprobs = good_logprobs(evaluate(base, bpe_tokenizer, small_data, allow_modified=True))
    assert (base_logprobs - good_logprobs(reference)).abs().max() > 0.05


def test_a_hooked_lm_head_is_scored_through_the_models_forward(bpe_tokenizer, small_data):
    model = tiny_llama(len(bpe_tokenizer))
    evaluator = Evaluator(bpe_tokenizer, small_data, allow_modified=True)
    evaluator(model)
    model.lm_head.register_forward_hook(lambda module, inputs, output: output * 0.5)  # as accelerate's hooks wrap a head
    hooked = evaluator(model)
    reference = evaluate(model, bpe_tokenizer, small_data, allow_modified=True, method=PLAIN)
    assert (good_logprobs(hooked) - good_logprobs(reference)).abs().max() < 1e-3


@pytest.mark.parametrize("kind", ["bert", "t5"])
def test_a_model_that_is_not_a_causal_lm_is_named_up_front(bpe_tokenizer, small_data, kind):
    from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

    size = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    if kind == "bert":
        model = BertForMaskedLM(BertConfig(vocab_size=len(bpe_tokenizer), max_position_embeddings=256, **size))
    else:
        model = T5ForConditionalGeneration(
            T5Config(vocab_size=len(bpe_tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
        )
    with pytest.raises(ScoringError, match=f"{type(model).__name__} is not a causal language model"):
        evaluate(model.eval(), bpe_tokenizer, small_data, allow_modified=True)


def test_a_model_moved_after_an_evaluator_call_is_scored_where_it_is_now(bpe_tokenizer, small_data):
    weights = tiny_llama(len(bpe_tokenizer)).state_dict()
    with torch.device("meta"):
        model = tiny_llama(len(bpe_tokenizer))
    evaluator = Evaluator(bpe_tokenizer, small_data, allow_modified=True)
    with pytest.raises(ScoringError, match="meta device"):
        evaluator(model)
    model.to_empty(device="cpu")
    model.load_state_dict(weights)
    model.model.rotary_emb.inv_freq = tiny_llama(len(bpe_tokenizer)).model.rotary_emb.inv_freq  # not a saved weight
    loaded = evaluator(model)
    assert (
        good_logprobs(loaded).tolist() == good_logprobs(evaluate(model, bpe_tokenizer, small_data, allow_modified=True)).tolist()
    )

    eager = tiny_llama(len(bpe_tokenizer), attn_implementation="eager")
    evaluator = Evaluator(bpe_tokenizer, small_data, allow_modified=True)
    evaluator(eager)
    eager.to(torch.bfloat16)  # the additive masks of the eager attention are in the weights' dtype
    moved = evaluator(eager)
    fresh = evaluate(eager, bpe_tokenizer, small_data, allow_modified=True)
    assert good_logprobs(moved).tolist() == good_logprobs(fresh).tolist()
    assert evaluator._scorer.cache.device == torch.device("cpu") and evaluator._scorer.serves(eager)


@pytest.fixture
def tf32_through_the_new_api():
    saved = torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision
    torch.backends.fp32_precision = "tf32"  # as transformers' enable_tf32 does for TrainingArguments(tf32=True)
    yield
    torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision = saved


def test_float32_on_a_gpu_that_allows_tf32_through_the_new_api(bpe_tokenizer, small_data, tf32_through_the_new_api):
    with pytest.raises(RuntimeError):
        torch.get_float32_matmul_precision()  # the legacy reader refuses after the new API was used
    assert relative_tolerance(torch.float32, torch.device("cuda")) == TF32_TOLERANCE
    assert relative_tolerance(torch.float32, torch.device("cpu")) == RELATIVE_TOLERANCE[torch.float32]
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    assert relative_tolerance(torch.float32, torch.device("cuda")) == RELATIVE_TOLERANCE[torch.float32]
    assert evaluate(tiny_llama(len(bpe_tokenizer)), bpe_tokenizer, small_data, allow_modified=True).acc_norm > 0


@pytest.mark.parametrize("kind", ["bert", "t5"])
def test_tatblimp_score_names_a_model_folder_that_is_not_a_causal_lm(bpe_tokenizer, small_data, tmp_path, capsys, kind):
    from transformers import BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

    from tatblimp_callback.cli import main

    if kind == "bert":
        size = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
        model = BertForMaskedLM(BertConfig(vocab_size=len(bpe_tokenizer), max_position_embeddings=256, **size))
    else:
        model = T5ForConditionalGeneration(
            T5Config(vocab_size=len(bpe_tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
        )
    model.save_pretrained(tmp_path / kind)
    bpe_tokenizer.save_pretrained(tmp_path / kind)
    assert main(["score", str(tmp_path / kind), "--data", str(small_data), "--allow-modified", "--device", "cpu"]) == 1
    assert f"holds {type(model).__name__}, not a causal language model" in capsys.readouterr().err
