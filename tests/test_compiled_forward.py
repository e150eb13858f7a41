"""``compile=True`` (``engine/compiled_forward.py``): the scoring forward compiled for the plan's shapes, checked
against the plain forward by the method check, the model itself untouched, a compiler failure falling back."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import tiny_llama
from tatblimp_callback import Scorer, ScoringMethod
from tatblimp_callback.engine.compiled_forward import CompiledForward
from test_cuda_graphs import VOCAB, Emulated, cache  # noqa: F401 - the fixture

OPTIONS = {"memory_budget": 2**20, "row_length": 24}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo's compiled code and recompile counts are per code object, shared by every model of a class: each test
    starts without the previous one's."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_compiled_forward_matches_eager_within_the_method_checks_tolerance_and_replays_as_graphs(cache):  # noqa: F811
    model = tiny_llama(VOCAB, layers=1)
    forward = model.model.forward
    eager = Scorer(model, cache, cuda_graphs=False, **OPTIONS).score()
    compiled = Scorer(model, cache, compile=True, **OPTIONS)
    compiled.graphs.graph_factory = Emulated()
    scores = [compiled.score() for _ in range(3)]
    assert compiled.compiled.reason is None and compiled.compiled.calls > 0
    # Inductor fuses the body's elementwise work, so the rounding differs from eager's: within float32's.
    assert torch.allclose(scores[0], eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(scores[1], scores[0]) and torch.equal(scores[2], scores[0])
    assert compiled.graphs.captures == len(compiled.layout().batches)  # the compiled forward captured as graphs
    # The model, as training runs it, is not compiled: the same forward, the same numbers.
    assert model.model.forward == forward and not hasattr(model.model, "_orig_mod")
    assert type(model.model).__name__ == "LlamaModel"


def test_the_method_check_compares_the_compiled_readout_with_the_plain_forward(cache):  # noqa: F811
    model = tiny_llama(VOCAB, layers=1)
    seen = []

    def doubled(gm, inputs):  # a "compiler" whose code is wrong: the hidden states doubled
        def run(*args):
            seen.append(1)
            return tuple(o * 2.0 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in gm(*args))

        return run

    wrong = Scorer(model, cache, compile=True, **OPTIONS)
    wrong.compiled.backend = doubled
    plain = Scorer(model, cache, **OPTIONS)
    tree = ScoringMethod("tree", "tiled")
    reference = plain.check.reference(plain.check.sample)  # the plain forward, one sequence at a time
    assert torch.equal(wrong.check.reference(wrong.check.sample), reference)  # never through the compiled copy
    assert plain.check.matches(tree, reference)
    assert not seen
    assert not wrong.check.matches(tree, reference)  # the compiled readout, compared with it
    assert seen


def test_a_compiler_failure_falls_back_to_the_plain_forward_with_the_reason_logged_once(cache, caplog):  # noqa: F811
    model = tiny_llama(VOCAB, layers=1)

    def broken(gm, inputs):
        raise RuntimeError("no C compiler here")

    scorer = Scorer(model, cache, compile=True, **OPTIONS)
    scorer.compiled.backend = broken
    with caplog.at_level(logging.WARNING, logger="tatblimp_callback.engine.compiled_forward"):
        scores = [scorer.score() for _ in range(2)]
    expected = Scorer(model, cache, **OPTIONS).score()
    assert all(torch.equal(s, expected) for s in scores)
    assert "no C compiler here" in scorer.compiled.reason
    assert caplog.text.count("not compiled") == 1


def test_compile_is_off_by_default_and_never_used_for_a_sharded_model():
    assert CompiledForward().enabled is False
    sharded = CompiledForward(enabled=True, sharded=True)
    fn = torch.nn.Identity()
    assert sharded(fn) is fn and "sharded" in sharded.reason
    assert CompiledForward(enabled=False)(fn) is fn
