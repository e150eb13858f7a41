"""A model that is not a transformers model, scored through ``CallableLM``: a nanoGPT-style model written here
(plain PyTorch, its own attention), scored exactly, with the layouts it declares and the method check on them."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from tatblimp_callback import Evaluator, ScoringError
from tatblimp_callback.engine.callable_model import CallableLM
from tatblimp_callback.engine.scoring_method import ScoringMethod
from tatblimp_callback.tokenized.cache import build_cache


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))

    def forward(self, x, allowed):
        rows, length, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(rows, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~allowed, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(rows, length, width)
        x = x + self.proj(y)
        return x + self.mlp(self.ln_2(x))


class NanoGPT(torch.nn.Module):
    """Learned positions, pre-norm blocks, an untied head. ``packs``: each run of position ids from 0 is a
    sequence of its own (block-diagonal attention); without it, one causal attention over the whole row."""

    def __init__(self, vocab: int, context: int = 256, width: int = 32, layers: int = 2, heads: int = 4, packs: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = torch.nn.Embedding(vocab, width), torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)
        self.lm_head = torch.nn.Linear(width, vocab, bias=False)
        self.packs = packs
        with torch.no_grad():  # larger weights than the default: log-probs that differ clearly between tokens
            for p in self.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.3)

    def hidden(self, idx, pos, attention_mask=None):
        length = idx.shape[1]
        if attention_mask is not None:  # prefix-tree rows: the engine's boolean 4D mask
            allowed = attention_mask
        else:
            allowed = torch.ones(length, length, dtype=torch.bool, device=idx.device).tril()[None, None]
            if self.packs:
                doc = (pos == 0).cumsum(1)
                allowed = allowed & (doc[:, None, :, None] == doc[:, None, None, :])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x, allowed)
        return self.ln_f(x)

    def forward(self, idx, pos, attention_mask=None):
        return self.lm_head(self.hidden(idx, pos, attention_mask))


def reference(model: NanoGPT, sentences: list[list[int]]) -> torch.Tensor:
    """The definition, plainly: one sentence at a time, positions 0..n-1, full log-softmax in float64."""
    values = []
    with torch.no_grad():
        for ids in sentences:
            x = torch.tensor([ids])
            logits = model(x, torch.arange(len(ids))[None])[0, :-1].double()
            values.append(float(logits.log_softmax(-1).gather(-1, x[0, 1:, None]).sum()))
    return torch.tensor(values, dtype=torch.float64)


@pytest.fixture(scope="module")
def cache(bpe_tokenizer, small_data):
    return build_cache(bpe_tokenizer, small_data, allow_modified=True)


def logprobs(results) -> torch.Tensor:
    return torch.tensor([v for p in results.pairs for v in (p.good_logprob, p.bad_logprob)], dtype=torch.float64)


@pytest.mark.parametrize(
    ("layouts", "head", "method"),
    [
        (("tree", "packed"), "tiled", "tree rows, tiled head"),
        (("packed",), "tiled", "packed rows, tiled head"),
        ((), "logits", "padded rows, full logits"),
        (("tree",), "logits", "tree rows, full logits"),
    ],
)
def test_a_nanogpt_is_scored_exactly_with_the_layouts_it_declares(bpe_tokenizer, small_data, cache, layouts, head, method):
    gpt = NanoGPT(len(bpe_tokenizer))
    if head == "tiled":
        lm = CallableLM(
            vocab_size=len(bpe_tokenizer),
            context_length=256,
            layouts=layouts,
            hidden_states=gpt.hidden,
            output_embedding=gpt.lm_head,
        )
    else:
        lm = CallableLM(gpt.forward, vocab_size=len(bpe_tokenizer), context_length=256, layouts=layouts)
    gpt.train()
    results = Evaluator(bpe_tokenizer, small_data, allow_modified=True)(lm)
    assert results.run_info["scoring_method"] == method
    expected = reference(gpt, [cache.sentence(s) for s in range(cache.num_sentences)])
    assert (logprobs(results) - expected).abs().max().item() < 1e-4
    assert [p.good_logprob > p.bad_logprob for p in results.pairs] == (expected[0::2] > expected[1::2]).tolist()
    assert gpt.training  # put back in the mode it was in


def test_a_declared_layout_the_attention_gets_wrong_is_caught_by_the_method_check(bpe_tokenizer, small_data, cache):
    # Declares packed rows, but attends across the sequences of a row: the check against one-at-a-time calls
    # of the same callable rejects packed rows, and padded rows score it exactly.
    gpt = NanoGPT(len(bpe_tokenizer), packs=False)
    lm = CallableLM(gpt.forward, vocab_size=len(bpe_tokenizer), context_length=256, layouts=("packed",))
    results = Evaluator(bpe_tokenizer, small_data, allow_modified=True)(lm)
    assert results.run_info["scoring_method"] == "padded rows, full logits"
    expected = reference(gpt, [cache.sentence(s) for s in range(cache.num_sentences)])
    assert (logprobs(results) - expected).abs().max().item() < 1e-4


def test_what_the_caller_declares_is_checked(bpe_tokenizer, small_data):
    gpt = NanoGPT(len(bpe_tokenizer))
    too_small = CallableLM(gpt.forward, vocab_size=100, context_length=256)
    with pytest.raises(ScoringError, match="only 100 rows"):
        Evaluator(bpe_tokenizer, small_data, allow_modified=True)(too_small)
    short = CallableLM(gpt.forward, vocab_size=len(bpe_tokenizer), context_length=8)
    with pytest.raises(ScoringError, match="context of 8"):
        Evaluator(bpe_tokenizer, small_data, allow_modified=True)(short)
    with pytest.raises(ValueError, match="module="):
        CallableLM(lambda ids, pos: F.one_hot(ids, 800).float(), vocab_size=800, context_length=256)
    with pytest.raises(ValueError, match="unknown layouts"):
        CallableLM(gpt.forward, vocab_size=800, context_length=256, layouts=("flash",))
    with pytest.raises(ValueError, match="hidden_states= with output_embedding="):
        CallableLM(vocab_size=800, context_length=256, hidden_states=gpt.hidden)


def test_what_the_callable_returns_and_its_declarations_are_checked(bpe_tokenizer, cache):
    """A forward that returned ``(logits, loss)`` (nanoGPT's), logits one position short, integer logits or a numpy
    array failed inside the method check with torch's indexing errors; the declarations failed later, or not at all."""
    gpt, vocab = NanoGPT(len(bpe_tokenizer)), len(bpe_tokenizer)
    returned = {  # what came back, as the error says it, given the input's [rows, length]
        lambda ids, pos: (gpt(ids, pos), None): lambda rows, length: "a tuple of 2 (return the logits alone",
        lambda ids, pos: gpt(ids, pos)[:, :-1]: lambda rows, length: f"a float32 tensor of shape [{rows}, {length - 1}, {vocab}]",
        lambda ids, pos: gpt(ids, pos).long(): lambda rows, length: f"a int64 tensor of shape [{rows}, {length}, {vocab}]",
        lambda ids, pos: gpt(ids, pos).detach().numpy(): lambda rows, length: "a ndarray",
    }
    for forward, got in returned.items():
        lm = CallableLM(forward, vocab_size=vocab, context_length=256, module=gpt)
        with pytest.raises(ValueError, match=r"^CallableLM: forward must return a float tensor \[rows, length, vocab\]") as error:
            Evaluator(cache=cache)(lm)
        rows, length = map(int, re.search(r"for input_ids of shape \[(\d+), (\d+)\]", str(error.value)).groups())
        assert f"; got {got(rows, length)}" in str(error.value)
    narrow = CallableLM(
        hidden_states=lambda ids, pos: gpt.hidden(ids, pos)[..., :16],
        output_embedding=gpt.lm_head,
        vocab_size=vocab,
        context_length=256,
        module=gpt,
    )
    with pytest.raises(ValueError, match=r"hidden_states must return a float tensor \[rows, length, hidden\] = \[\d+, \d+, 32\]"):
        Evaluator(cache=cache)(narrow)
    declared = {
        "vocab_size must be a positive whole number, got None": dict(vocab_size=None),
        "vocab_size must be a positive whole number, got '800'": dict(vocab_size="800"),
        "context_length must be a positive whole number, got 0": dict(context_length=0),
        "layouts= takes names, e.g. ('tree',); got the string 'tree'": dict(layouts="tree"),
    }
    for message, options in declared.items():
        with pytest.raises(ValueError, match=f"^CallableLM: {re.escape(message)}$"):
            CallableLM(gpt.forward, **{"vocab_size": vocab, "context_length": 256, **options})
    with pytest.raises(ValueError, match=r"^CallableLM: output_embedding must be the LM head, a torch\.nn\.Linear"):
        CallableLM(hidden_states=gpt.hidden, output_embedding=gpt.lm_head.weight, vocab_size=vocab, context_length=256)


def test_a_forced_method_outside_the_declared_layouts_is_refused(bpe_tokenizer, small_data, cache):
    """Forcing ``method="tree"`` on a model that declared padded rows only scored its rows with a mask its forward
    never reads, with no warning (acc_norm 0.5625 against 0.4375 on 16 pairs): now refused, naming the layouts."""
    gpt = NanoGPT(len(bpe_tokenizer))
    padded_only = CallableLM(gpt.forward, vocab_size=len(bpe_tokenizer), context_length=256, layouts=())
    for method in ("tree", ScoringMethod("packed", "full_logits")):
        with pytest.raises(ValueError, match=r"the model declares the layouts \('padded',\) only"):
            Evaluator(cache=cache, method=method)(padded_only)
    for method, message in ((3, "method must be a layout name"), ("tree2", "unknown scoring method 'tree2'")):
        with pytest.raises(ValueError, match=message):
            Evaluator(cache=cache, method=method)(padded_only)
    forced = Evaluator(cache=cache, method="padded")(padded_only)  # a declared layout is taken as forced
    assert forced.run_info["scoring_method"] == "padded rows, full logits"


def test_an_olmo_core_transformer_through_the_callable_route(bpe_tokenizer, small_data, cache):
    # ai2-olmo-core is not a dependency: its requirements would downgrade huggingface_hub and rich beside
    # transformers 5. Run with it on PYTHONPATH (pip install --no-deps --target DIR ai2-olmo-core ...).
    transformer = pytest.importorskip("olmo_core.nn.transformer")
    torch.manual_seed(0)
    model = transformer.TransformerConfig.olmo2_1M(vocab_size=len(bpe_tokenizer)).build(init_device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    # Its forward makes its own positions 0, 1, 2, ... along a row: padded rows only.
    lm = CallableLM(lambda ids, pos: model(ids), module=model, vocab_size=len(bpe_tokenizer), context_length=256)
    results = Evaluator(bpe_tokenizer, small_data, allow_modified=True)(lm)
    assert results.run_info["scoring_method"] == "padded rows, full logits"
    expected = []
    with torch.no_grad():
        for s in range(cache.num_sentences):
            x = torch.tensor([cache.sentence(s)])
            expected.append(float(model(x)[0, :-1].double().log_softmax(-1).gather(-1, x[0, 1:, None]).sum()))
    assert (logprobs(results) - torch.tensor(expected, dtype=torch.float64)).abs().max().item() < 1e-4


def test_one_callable_lm_is_scored_again_at_its_second_evaluation(bpe_tokenizer, small_data, cache):
    model = NanoGPT(len(bpe_tokenizer))
    lm = CallableLM(model.forward, vocab_size=len(bpe_tokenizer), context_length=256, layouts=("packed",))
    evaluator = Evaluator(bpe_tokenizer, small_data, allow_modified=True)
    first = evaluator(lm)
    scorer = evaluator._scorer
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # trained a little between the two
    second = evaluator(lm)
    assert evaluator._scorer is scorer  # the same scorer, its method kept
    sentences = [cache.sentence(s) for s in range(cache.num_sentences)]
    assert (logprobs(second) - reference(model, sentences)).abs().max().item() < 1e-4
    assert not torch.allclose(logprobs(second), logprobs(first))


class TiedNanoGPT(NanoGPT):
    """nanoGPT's tied head, written as nanoGPT's users often do: the embedding's weight used outside its call."""

    def forward(self, idx, pos, attention_mask=None):
        return F.linear(self.hidden(idx, pos, attention_mask), self.wte.weight)


def test_a_bf16_model_using_a_weight_outside_its_module_is_scored_with_float32_decisions(bpe_tokenizer, small_data):
    """The float32 truth of the method check upcast a module's weights during its own call only, so the tied head's
    bf16 weight met float32 activations: "expected m1 and m2 to have the same dtype" at the first evaluation."""
    model = TiedNanoGPT(len(bpe_tokenizer)).to(torch.bfloat16)
    lm = CallableLM(model.forward, vocab_size=len(bpe_tokenizer), context_length=256, layouts=("packed",))
    results = Evaluator(bpe_tokenizer, small_data, allow_modified=True)(lm)
    assert results.run_info["precision"] == "bfloat16" and all(p.dtype == torch.bfloat16 for p in model.parameters())
    upcast = TiedNanoGPT(len(bpe_tokenizer))
    upcast.load_state_dict({name: value.float() for name, value in model.state_dict().items()})
    truth = Evaluator(bpe_tokenizer, small_data, allow_modified=True)(
        CallableLM(upcast.forward, vocab_size=len(bpe_tokenizer), context_length=256)
    )
    assert [p.passed_norm for p in results.pairs] == [p.passed_norm for p in truth.pairs]
    assert [p.passed for p in results.pairs] == [p.passed for p in truth.pairs]
