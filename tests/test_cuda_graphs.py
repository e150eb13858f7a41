"""The plan replayed as CUDA graphs (``engine/cuda_graphs.py``): capture, replay, invalidation, fallback reasons.

A CUDA graph cannot run here, so its CUDA parts are emulated (``EmulatedGraphs``): a capture records the call and
leaves its output as garbage (a real capture computes nothing), a replay recomputes the call into that same output
tensor (a real replay rewrites its static output from the memory it reads). Everything else is the real scorer.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from conftest import tiny_llama
from tatblimp_callback import Scorer, ScoringMethod
from tatblimp_callback.engine import packing
from tatblimp_callback.engine.cuda_graphs import CudaGraphs, GraphBatch, TorchGraphs, model_structure, placement_reason

VOCAB = 16


class Emulated(TorchGraphs):
    """CUDA's part emulated on the CPU. ``sync``: the warm-up finds a host synchronisation; ``drift``: replays add it;
    ``out_of_memory``: captures that run out of memory before one succeeds."""

    def __init__(self, sync: bool = False, drift: float = 0.0, out_of_memory: int = 0):
        self.sync, self.drift, self.out_of_memory = sync, drift, out_of_memory
        self.warmed = 0
        self.forbidding = False  # inside a warm-up: a host synchronisation is an error

    def supports(self, device):
        return True

    def pool(self):
        return object()

    def warm(self, fn):
        self.warmed += 1
        if self.sync:
            raise RuntimeError("called a synchronizing CUDA operation")
        self.forbidding = True
        try:
            return fn()
        finally:
            self.forbidding = False

    def capture(self, fn, pool):
        if self.out_of_memory:
            self.out_of_memory -= 1
            raise torch.OutOfMemoryError("emulated: out of memory while capturing")
        output = fn().clone().fill_(float("nan"))  # a capture records kernels; it leaves the output unwritten
        return (fn, output), output

    def replay(self, graph):
        fn, output = graph
        output.copy_(fn() + self.drift)


def sentences(seed: int = 11, count: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    out: list[list[int]] = []
    for _ in range(count):
        start = rng.choice(out)[: rng.randint(1, 4)] if out and rng.random() < 0.5 else [1]
        out.append(start + [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 8))])
    return out


@pytest.fixture
def cache():
    from test_packing import cache_of

    return cache_of(sentences())


def scorer_with(model, cache, graphs=None, **options):
    options = {"memory_budget": 2**16, "row_length": 24, **options}
    scorer = Scorer(model, cache, **options)
    if graphs is not None:
        scorer.graphs.graph_factory = graphs
    return scorer


def test_replays_equal_the_eager_evaluation_bit_for_bit_and_each_batch_is_captured_once(cache):
    model = tiny_llama(VOCAB)
    eager = scorer_with(model, cache, cuda_graphs=False)
    graphed = scorer_with(model, cache, Emulated())
    batches = None
    for evaluation in range(4):
        expected, got = eager.score(), graphed.score()
        assert torch.equal(got, expected), evaluation
        batches = len(graphed.layout().batches)
        assert batches >= 3
        # Captured at the plan's second evaluation (a one-off evaluation pays for no capture), replayed from the third.
        assert graphed.graphs.captures == (batches if evaluation else 0)
        assert graphed.graphs.replays == batches * max(evaluation - 1, 0)
    assert graphed.graphs.reason is None and eager.graphs.reason == "cuda_graphs=False"


def test_a_first_evaluation_that_times_the_head_counts_as_the_plans_first(cache, monkeypatch):
    from tatblimp_callback.engine import head_choice

    monkeypatch.setattr(head_choice, "MIN_CHOICE_FLOPS", 0)  # the head timed at the first evaluation, as on a GPU
    model = tiny_llama(VOCAB)
    graphed = scorer_with(model, cache, Emulated())
    expected = scorer_with(model, cache, cuda_graphs=False, head_method="tiles").score()
    first = graphed.score()
    assert graphed.head_choice["chosen_by"] == "timing" and graphed.graphs.reason.startswith("the LM head's method")
    graphed.head.method = head_choice.TILES  # whatever the timing chose on this loaded machine: the same numbers below
    second = graphed.score()
    assert graphed.graphs.captures == len(graphed.layout().batches)  # captured at the second evaluation
    assert torch.allclose(first, expected, rtol=1e-6) and torch.equal(second, expected)


def test_weights_updated_in_place_are_replayed_without_a_capture(cache):
    model = tiny_llama(VOCAB)
    graphed = scorer_with(model, cache, Emulated())
    graphed.score(), graphed.score()
    captures = graphed.graphs.captures
    assert captures > 0
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(0.9)  # an optimizer step: the same storage, new values
    got = graphed.score()
    assert graphed.graphs.captures == captures
    assert torch.equal(got, scorer_with(model, cache, cuda_graphs=False).score())


def test_a_replaced_parameter_storage_a_new_method_and_a_new_plan_capture_again(cache, caplog):
    model = tiny_llama(VOCAB)
    graphed = scorer_with(model, cache, Emulated())
    graphed.score(), graphed.score()
    batches = len(graphed.layout().batches)
    assert graphed.graphs.captures == batches
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.data = model.model.layers[0].mlp.up_proj.weight.data * 1.1
    with caplog.at_level(logging.INFO, logger="tatblimp_callback.engine.cuda_graphs"):
        got = graphed.score()  # the same plan: captured again at once
    assert graphed.graphs.captures == 2 * batches
    assert "captured again" in caplog.text
    assert torch.equal(got, scorer_with(model, cache, cuda_graphs=False).score())
    graphed.method = ScoringMethod("packed", "tiled")
    graphed.score(), graphed.score()  # a new plan (packed rows): captured at its second evaluation
    assert graphed.graphs.captures == 2 * batches + len(graphed.layout().batches)
    before = graphed.graphs.captures
    graphed._set_budget(2**17, retrying=False)  # a new budget: a new plan
    graphed.score(), graphed.score()
    assert graphed.graphs.captures == before + len(graphed.layout().batches)


def test_merging_a_lora_adapter_captures_again(cache):
    peft = pytest.importorskip("peft")
    model = tiny_llama(VOCAB)
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(model, config).eval()
    graphed = scorer_with(lora, cache, Emulated())
    graphed.score(), graphed.score()
    structure = model_structure(graphed.lm)
    captures = graphed.graphs.captures
    lora.merge_adapter()  # the delta goes into the base weights in place; the adapters are skipped from now on
    assert model_structure(graphed.lm) != structure
    got = graphed.score()
    assert graphed.graphs.captures == 2 * captures
    assert torch.equal(got, scorer_with(lora, cache, cuda_graphs=False).score())


def test_the_structure_changes_with_storage_hooks_modules_and_adapters_not_with_an_in_place_step():
    peft = pytest.importorskip("peft")
    model = tiny_llama(VOCAB)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    structure = model_structure(lora)
    with torch.no_grad():
        for parameter in lora.parameters():
            parameter.add_(0.5)  # an optimizer's step: the graphs read the new values
    assert model_structure(lora) == structure
    layer = model.model.layers[0]
    handle = layer.mlp.register_forward_hook(lambda module, inputs, output: output)
    assert model_structure(lora) != structure
    handle.remove()
    assert model_structure(lora) == structure
    lora.base_model.disable_adapter_layers()
    assert model_structure(lora) != structure
    lora.base_model.enable_adapter_layers()
    assert model_structure(lora) == structure
    original = layer.mlp.act_fn
    layer.mlp.act_fn = torch.nn.GELU()  # another module, no parameter changed
    assert model_structure(lora) != structure
    layer.mlp.act_fn = original
    assert model_structure(lora) == structure
    weight = layer.mlp.up_proj.weight
    weight.data = weight.data[:, :-1]  # the same storage (data_ptr), another shape
    assert model_structure(lora) != structure
    # A method named like adapter state (transformers' ``active_adapters()``) is no state of the model's.
    assert all(adapters is None for *_, adapters in model_structure(tiny_llama(VOCAB)))


def test_a_forward_that_synchronises_with_the_host_falls_back_with_the_reason_logged_once(cache, caplog):
    model = tiny_llama(VOCAB)
    emulated = Emulated(sync=True)
    graphed = scorer_with(model, cache, emulated)
    with caplog.at_level(logging.INFO, logger="tatblimp_callback.engine.cuda_graphs"):
        scores = [graphed.score() for _ in range(4)]
    expected = scorer_with(model, cache, cuda_graphs=False).score()
    assert all(torch.equal(s, expected) for s in scores)
    assert graphed.graphs.captures == 0 and emulated.warmed == 2  # the whole call, the body: not tried again
    assert caplog.text.count("synchronises with the host") == 1
    assert graphed.graphs.reason is None or "synchronises" in caplog.text


def test_where_the_head_synchronises_the_body_alone_is_replayed_and_the_head_run_after_it(cache, monkeypatch):
    from tatblimp_callback.engine import head_choice

    emulated = Emulated()
    original = head_choice.method_logprobs

    def reads_back(*args, **kwargs):  # as the one-tile head's ``bool(nan.any())`` does on a GPU
        if emulated.forbidding:
            raise RuntimeError("called a synchronizing CUDA operation")
        return original(*args, **kwargs)

    monkeypatch.setattr(head_choice, "method_logprobs", reads_back)
    model = tiny_llama(VOCAB)
    graphed = scorer_with(model, cache, emulated)
    eager = scorer_with(model, cache, cuda_graphs=False)
    for evaluation in range(3):
        assert torch.equal(graphed.score(), eager.score()), evaluation
    batches = len(graphed.layout().batches)
    assert graphed.graphs.captures == batches and graphed.graphs.replays == batches
    assert graphed.graphs.body_only.startswith("the head synchronises with the host")
    assert all(c.kept is not None for c in graphed.graphs._graphs.values())


def test_a_replay_that_differs_from_eager_drops_the_graphs(cache, caplog):
    model = tiny_llama(VOCAB)
    graphed = scorer_with(model, cache, Emulated(drift=1e-6))
    with caplog.at_level(logging.WARNING, logger="tatblimp_callback.engine.cuda_graphs"):
        first, second, third = graphed.score(), graphed.score(), graphed.score()
    expected = scorer_with(model, cache, cuda_graphs=False).score()
    assert all(torch.equal(s, expected) for s in (first, second, third))
    assert graphed.graphs.captures == 0 and graphed.graphs.replays == 0
    assert caplog.text.count("differs from the eager forward") == 1


def test_out_of_memory_while_capturing_halves_the_budget_and_captures_the_new_plan(cache):
    model = tiny_llama(VOCAB)
    graphed = scorer_with(model, cache, Emulated(out_of_memory=1), memory_budget=2**26)
    graphed.score()
    got = graphed.score()  # the capture runs out of memory: the budget halved, a new plan (eager), then captured
    assert graphed.graphs.captures == 0
    got = graphed.score()
    assert graphed.oom_retries == 1 and graphed.memory_budget == 2**25
    assert graphed.graphs.captures == len(graphed.layout().batches)
    assert torch.equal(got, scorer_with(model, cache, cuda_graphs=False).score())


def test_no_graphs_where_they_cannot_hold_each_with_its_reason(cache, monkeypatch):
    model = tiny_llama(VOCAB)
    cpu = scorer_with(model, cache)  # the real CUDA parts, on a CPU
    cpu.score()
    assert cpu.graphs.reason == "not a CUDA device (cpu)" and cpu.graphs.captures == 0
    device = torch.device("cpu")
    assert placement_reason(model, device, sharded=True, tensor_parallel=False).startswith("the weights are sharded")
    assert "tensor parallelism" in placement_reason(model, device, sharded=False, tensor_parallel=True)
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers": 1, "lm_head": 1}
    assert placement_reason(model, device, False, False) == "a device map across several devices"
    model.hf_device_map = {"model": 0, "lm_head": "cpu"}
    assert "offloaded" in placement_reason(model, device, False, False)
    del model.hf_device_map
    assert placement_reason(model, torch.device("cuda"), False, False) == "weights on cpu, scored on cuda"
    assert placement_reason(model, device, False, False) is None
    # A plan larger than its share of the budget is built per forward call: nothing static to replay.
    monkeypatch.setattr(packing, "PLAN_BYTES_PER_POSITION", 2**40)
    unplanned = scorer_with(model, cache, Emulated())
    unplanned.score()
    assert torch.equal(unplanned.score(), scorer_with(model, cache, cuda_graphs=False).score())
    assert unplanned.graphs.reason.startswith("the plan is not kept on the device") and unplanned.graphs.captures == 0


def test_the_method_checks_sample_and_the_rescoring_never_touch_the_graphs(cache):
    model = tiny_llama(VOCAB)
    graphed = scorer_with(model, cache, Emulated())
    graphed.score(), graphed.score()
    captured = dict(graphed.graphs._graphs)
    graphed.check.readout(graphed.method, graphed.check.sample)  # the check's sample: its own small layout
    assert graphed.graphs._graphs == captured
    assert all(isinstance(GraphBatch(i, graphed.layout().batches, graphed.graphs).score_slots, torch.Tensor) for i in captured)


def test_graphs_off_by_the_option_log_nothing(cache, caplog):
    graphs = CudaGraphs(tiny_llama(VOCAB), enabled=False)
    assert graphs.enabled is False
    with caplog.at_level(logging.INFO, logger="tatblimp_callback.engine.cuda_graphs"):
        scorer_with(tiny_llama(VOCAB), cache, cuda_graphs=False).score()
    assert "scoring without CUDA graphs" in caplog.text  # once, at INFO: the option's own reason


def test_one_forward_call_where_a_quarter_of_free_gpu_memory_holds_every_position(cache, monkeypatch):
    from types import SimpleNamespace

    from tatblimp_callback.engine import memory_budget

    model = tiny_llama(VOCAB)
    per_position = memory_budget.activation_bytes_per_position(model.config, torch.float32, 24)
    needed = sum(cache.lengths) * per_position
    on_gpu = SimpleNamespace(device=torch.device("cuda"), lengths=cache.lengths)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * needed, 8 * needed))
    assert memory_budget.one_call_budget(2**16, on_gpu, model, 24) == needed
    assert memory_budget.one_call_budget(2 * needed, on_gpu, model, 24) == 2 * needed  # never below the budget
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * needed - 4, 8 * needed))
    assert memory_budget.one_call_budget(2**16, on_gpu, model, 24) is None  # a quarter of what is free is too little
    assert memory_budget.one_call_budget(2**16, cache, model, 24) is None  # a CPU: no free memory to size it from
    # The scorer's forward calls are sized by it: one call instead of several, the same numbers; after an
    # out-of-memory, by the halved budget again.
    several = scorer_with(model, cache, cuda_graphs=False)
    expected = several.score()
    assert len(several.layout().batches) > 1
    one = scorer_with(model, cache, cuda_graphs=False)
    one.call_budget = needed
    assert torch.allclose(one.score(), expected, rtol=1e-6, atol=1e-6) and len(one.layout().batches) == 1
    one._set_budget(2**15, retrying=True)
    assert one.call_budget is None


def test_float32_scoring_of_bf16_weights_runs_without_graphs_with_its_reason(cache):
    """precision='float32' on bf16 weights upcasts them a module at a time in Python hooks, which a replay would skip."""
    model = tiny_llama(VOCAB).to(torch.bfloat16)
    upcast = scorer_with(model, cache, Emulated(), precision="float32")
    upcast.score(), upcast.score()
    assert upcast.graphs.reason.startswith("the weights are upcast to float32") and upcast.graphs.captures == 0
    own = scorer_with(model, cache, Emulated(), precision="bfloat16", method=upcast.method)
    own.score(), own.score()
    assert own.graphs.reason is None and own.graphs.captures > 0
