"""One process of a two-process (gloo) run for ``test_distributed.py``, started by torchrun.

    python -m torch.distributed.run --nproc_per_node 2 distributed_worker.py SCENARIO WORKDIR

WORKDIR holds ``tokenizer/`` and ``small.jsonl`` from the test; each rank writes
``SCENARIO-rank{r}.pt`` there. Scenarios:

- ``scorer``: the sharded scorer against a one-process score made before the process group
  exists; failures injected on one rank (inside scoring, before scoring, out of memory); FSDP2;
  forced choice (the same engine on prompts), sharded, under FSDP2, and with a failure while
  preparing on one rank.
- ``fsdp_exact``: exact decisions of FSDP2 models that compute in bf16 (bf16 weights; float32 weights under a
  bf16 ``MixedPrecisionPolicy``), and of FSDP1 ones (bf16 weights flattened; float32 weights under a bf16
  ``MixedPrecision``), against one process's float32 evaluation of the same bf16 weights.
- ``zero3_exact``: exact decisions of a DeepSpeed ZeRO-3 model in bf16 (its weights partitioned over the two
  processes, gathered by DeepSpeed's hooks layer by layer) against one process's float32 evaluation of the same bf16
  weights, and a training step after the evaluation.
- ``trainer``: an HF Trainer under DDP with ``TatBLiMPCallback``; the evaluation at step 4 fails
  on rank 1 only. Afterwards rank 0 scores the saved weights of every evaluation on one process.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from transformers import PreTrainedTokenizerFast, TrainerCallback

from conftest import CHAT_TEMPLATE, tiny_llama
from tatblimp_callback import (
    Evaluator,
    ForcedChoiceEvaluator,
    Scorer,
    ScoringMethod,
    TatBLiMPCallback,
    build_cache,
)
from tatblimp_callback.chat.forced_choice import DEFAULT_ROW_LENGTH as FC_ROW
from tatblimp_callback.chat.forced_choice import build_prompt_cache
from tatblimp_callback.engine import distributed as tdist
from tatblimp_callback.engine import memory_budget

BUDGET = 2**20  # small, so that the 96 sentences make several batches
ROW = 160  # 9 rows, one a batch: an odd count, so FSDP needs a repeated batch on one rank
FAIL_STEP = 4


class Injected(RuntimeError):
    pass


def fail_on(rank: int, call: int, error=Injected):
    """Patch the batch scorer to raise ``error`` on ``rank`` at its ``call``-th batch, once."""
    original = Scorer._batch_logprobs
    calls = [0]

    def patched(self, *args, **kwargs):
        calls[0] += 1
        if tdist.world()[0] == rank and calls[0] == call:
            raise error(f"injected failure on rank {rank}")
        return original(self, *args, **kwargs)

    Scorer._batch_logprobs = patched
    return lambda: setattr(Scorer, "_batch_logprobs", original)


def failing_prepare(evaluator, what: str):
    """``evaluator``, whose next ``prepare`` raises on rank 1 (once), before any scoring."""
    prepare = evaluator.prepare

    def fail_once(model):
        evaluator.prepare = prepare
        if dist.get_rank() == 1:
            raise Injected(f"{what} failed on rank 1")
        return prepare(model)

    evaluator.prepare = fail_once
    return evaluator


def outcome(function):
    """``function()``'s result, or the name and message of what it raised."""
    try:
        return function()
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def count_forwards(model):
    """A counter of forward calls of the model's body (both heads of the scorer run it)."""
    counter = [0]
    model._counter_hook = model.model.register_forward_pre_hook(lambda module, args: counter.__setitem__(0, counter[0] + 1))
    return counter


def remove_counter(model):
    model._counter_hook.remove()


def exact_decisions(results) -> dict:
    """What ``exact_decisions`` did to an evaluation: the outcomes, the rescored pairs, the record (less its seconds)."""
    record = {k: v for k, v in results.run_info["exact_decisions"].items() if k != "seconds"}
    return {"outcomes": results.outcomes(), "rescored": [p.rescored for p in results.pairs], "record": record}


def chat_tokenizer(tokenizer):
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHAT_TEMPLATE
    return chat


class FakeBatch:
    def __init__(self, name: str, num_positions: int):
        self.name, self.num_positions = name, num_positions


def scorer_scenario(workdir: Path, tokenizer, cache) -> dict:
    model = tiny_llama(len(tokenizer))
    out = {"one_process": Scorer(model, cache, row_length=ROW, memory_budget=BUDGET).score()}
    # What FSDP will use: the model's own logits (same budget, so the same batches).
    out["one_process_logits"] = Scorer(
        model, cache, row_length=ROW, memory_budget=BUDGET, method=ScoringMethod("tree", "full_logits")
    ).score()
    out["one_process_evaluator"] = [p.good_logprob for p in Evaluator(cache=cache, memory_budget=BUDGET)(model).pairs]
    prompts = build_prompt_cache(chat_tokenizer(tokenizer), workdir / "small.jsonl", allow_modified=True)
    out["fc_one_process"] = Scorer(model, prompts, memory_budget=BUDGET, row_length=FC_ROW).score()
    fc_logits = ScoringMethod("tree", "full_logits")
    out["fc_one_process_logits"] = Scorer(model, prompts, memory_budget=BUDGET, row_length=FC_ROW, method=fc_logits).score()
    out["fc_one_process_evaluator"] = [
        i.logprob_a for i in ForcedChoiceEvaluator(cache=prompts, memory_budget=BUDGET)(model).items
    ]
    bf16 = tiny_llama(len(tokenizer)).to(torch.bfloat16)
    out["bf16_one_process"] = exact_decisions(Evaluator(cache=cache, memory_budget=BUDGET)(bf16))
    small = workdir / "small.jsonl"
    with_tokens = dict(allow_modified=True, include_tokens=True, memory_budget=BUDGET)
    out["regions_one_process"] = [p.critical_region_bits for p in Evaluator(tokenizer, small, **with_tokens)(model).pair_tokens]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    out["regions_sharded"] = [p.critical_region_bits for p in Evaluator(tokenizer, small, **with_tokens)(model).pair_tokens]
    # A file of its own on each process (rank 1's one pair short): said so on both, not a gloo abort.
    own = workdir / f"own-rank{dist.get_rank()}.jsonl"
    lines = small.read_text(encoding="utf-8").splitlines(keepends=True)
    own.write_text("".join(lines[: len(lines) - dist.get_rank()]), encoding="utf-8")
    out["different_data"] = outcome(lambda: Evaluator(tokenizer, own, allow_modified=True, memory_budget=BUDGET)(model))
    out["tokenizer_name"] = cache.tokenizer_name
    # Exact decisions under DDP: the same close pairs on both ranks, rescored in lockstep.
    out["bf16_sharded"] = exact_decisions(Evaluator(cache=cache, memory_budget=BUDGET)(bf16))

    fc_scorer = Scorer(model, prompts, memory_budget=BUDGET, row_length=FC_ROW)
    fc_scorer.score()  # the method check: every process runs all of its sample
    forwards = count_forwards(model)
    out["fc_sharded"] = fc_scorer.score()
    out["fc_forwards"] = forwards[0]
    out["fc_batch_sizes"] = [b.num_positions for b in fc_scorer.layout().batches]
    remove_counter(model)

    fc_evaluator = ForcedChoiceEvaluator(cache=prompts, memory_budget=BUDGET)
    out["fc_failure_before"] = outcome(lambda: failing_prepare(fc_evaluator, "forced-choice prepare")(model))
    out["fc_evaluator_after_failure"] = [i.logprob_a for i in fc_evaluator(model).items]

    scorer = Scorer(model, cache, row_length=ROW, memory_budget=BUDGET)
    out["sharded"] = scorer.score()
    out["method"] = str(scorer.method)
    forwards = count_forwards(model)
    out["sharded_again"] = scorer.score()
    out["forwards"] = forwards[0]
    remove_counter(model)
    out["batch_sizes"] = [b.num_positions for b in scorer.layout().batches]

    batches = [FakeBatch("a", 30), FakeBatch("b", 20), FakeBatch("c", 10)]
    out["lockstep"] = [(b.name, keep) for b, keep in tdist.shard(batches, lockstep=True)]
    out["no_lockstep"] = [(b.name, keep) for b, keep in tdist.shard(batches)]

    restore = fail_on(rank=1, call=2)
    out["failure_inside"] = outcome(scorer.score)
    restore()
    out["after_failure"] = scorer.score()

    evaluator = Evaluator(cache=cache, memory_budget=BUDGET)
    out["failure_before"] = outcome(lambda: failing_prepare(evaluator, "prepare")(model))
    out["evaluator_after_failure"] = [p.good_logprob for p in evaluator(model).pairs]

    # A first evaluation's method check: a failure in one method's readout on rank 1 (its first batch) rules that
    # method out on both ranks, which go on in step to the next; one in rank 1's plain forward ends it on both.
    restore = fail_on(rank=1, call=1)
    checked = Scorer(model, cache, row_length=ROW, memory_budget=BUDGET)
    out["readout_failure_scores"] = outcome(checked.score)
    out["readout_failure_method"] = str(checked.method)
    restore()
    once = [dist.get_rank() == 1]

    def plain_forward_fails(module, args, kwargs):
        if once[0]:
            once[0] = False
            raise Injected("plain forward failed on rank 1")

    hook = model.register_forward_pre_hook(plain_forward_fails, with_kwargs=True)
    out["plain_forward_failure"] = outcome(Scorer(model, cache, row_length=ROW, memory_budget=BUDGET).score)
    hook.remove()
    out["after_plain_forward_failure"] = Scorer(model, cache, row_length=ROW, memory_budget=BUDGET).score()

    memory_budget.MIN_MEMORY_BUDGET = BUDGET // 4  # let the retry go below the library's floor
    restore = fail_on(rank=0, call=3, error=torch.OutOfMemoryError)
    oom_scorer = Scorer(model, cache, row_length=ROW, memory_budget=2 * BUDGET, method=scorer.method)
    out["after_oom"] = oom_scorer.score()
    out["oom_retries"] = oom_scorer.oom_retries
    out["oom_budget"] = oom_scorer.memory_budget
    restore()

    if dist.get_rank() == 0:  # scored by rank 0 alone while rank 1 waits at the barrier
        with tdist.this_process_only():
            out["alone"] = Scorer(model, cache, row_length=ROW, memory_budget=BUDGET).score()
    dist.barrier()

    out["fsdp"] = outcome(lambda: fsdp_scores(model, cache, out, "fsdp", row_length=ROW))
    out["fc_fsdp"] = outcome(lambda: fsdp_scores(model, prompts, out, "fc_fsdp", row_length=FC_ROW))
    return out


def fsdp_scores(model, cache, out: dict, name: str, row_length: int) -> torch.Tensor:
    """Scores of ``cache`` by an FSDP2 (``fully_shard``) copy of ``model``; its method and forward counts go in ``out``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sharded = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    scorer = Scorer(sharded, cache, row_length=row_length, memory_budget=BUDGET)
    scorer.score()  # the method check: every process runs all of its sample
    forwards = count_forwards(sharded)
    scores = scorer.score()
    out[f"{name}_method"] = str(scorer.method)
    out[f"{name}_forwards"] = forwards[0]
    out[f"{name}_batch_sizes"] = [b.num_positions for b in scorer.layout().batches]
    return scores


def fully_sharded(model, **options):
    """An FSDP2 (``fully_shard``) copy of ``model``: the embedding (a module with a weight of its own), each decoder
    layer, then the rest."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sharded = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in (sharded.model.embed_tokens, *sharded.model.layers):
        fully_shard(module, mesh=mesh, **options)
    fully_shard(sharded, mesh=mesh, **options)
    return sharded


def fsdp_exact_scenario(workdir: Path, tokenizer, cache) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = tiny_llama(len(tokenizer))
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    # What a bf16 MixedPrecisionPolicy computes with: the weights in bf16, the buffers (RoPE's inv_freq) as they are.
    bf16_weights = copy.deepcopy(model)
    for parameter in bf16_weights.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    float32 = Evaluator(cache=cache, memory_budget=BUDGET, precision="float32")
    truth, truth_mixed = float32(bf16), float32(bf16_weights)
    out = {
        "float32_truth": truth.outcomes(),
        "float32_truth_mixed": truth_mixed.outcomes(),
        "float32_logprobs": [(p.good_logprob, p.bad_logprob) for p in truth.pairs],
        "float32_logprobs_mixed": [(p.good_logprob, p.bad_logprob) for p in truth_mixed.pairs],
        "bf16_fast": Evaluator(cache=cache, memory_budget=BUDGET, exact_decisions=False)(bf16).outcomes(),
        "bf16_one_process": exact_decisions(Evaluator(cache=cache, memory_budget=BUDGET)(bf16)),
    }
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    forwards, kept = [], []

    def evaluate(sharded):
        from torch.distributed.tensor import DTensor

        before = {name: p.full_tensor() for name, p in sharded.named_parameters()}
        counter = count_forwards(sharded)
        results = Evaluator(cache=cache, memory_budget=BUDGET)(sharded)
        forwards.append(counter[0])
        result = exact_decisions(results)
        result["float32_logprobs"] = {
            i: (p.float32_good_logprob, p.float32_bad_logprob) for i, p in enumerate(results.pairs) if p.rescored
        }
        # Every weight as it was: sharded, or gathered in bf16 where FSDP keeps the root's gathered after a forward
        # (none left upcast to float32).
        after = {name: p.full_tensor() if isinstance(p, DTensor) else p.detach() for name, p in sharded.named_parameters()}
        expected = {
            name: weight if isinstance(p, DTensor) else weight.to(torch.bfloat16)
            for (name, weight), p in zip(before.items(), sharded.parameters(), strict=True)
        }
        kept.append(all(after[n].dtype == w.dtype and torch.equal(after[n], w) for n, w in expected.items()))
        return result

    out["fsdp_bf16_weights"] = outcome(lambda: evaluate(fully_sharded(bf16)))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    out["fsdp_mixed_precision"] = outcome(lambda: evaluate(fully_sharded(model, mp_policy=policy)))
    out["forwards"], out["weights_kept"] = forwards, kept
    out.update(fsdp1_exact(model, bf16, cache))
    return out


def fsdp1_exact(model, bf16, cache) -> dict:
    """Exact decisions under FSDP1 (``FullyShardedDataParallel``, each decoder layer wrapped as accelerate wraps
    them): bf16 weights flattened (``use_orig_params=False``), and float32 weights under a bf16 ``MixedPrecision`` that
    also casts each layer's inputs (``use_orig_params=True``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    out, forwards, kept = {}, [], []

    def evaluate(weights, **options):
        sharded = FullyShardedDataParallel(
            copy.deepcopy(weights),
            device_id=torch.device("cpu"),
            auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
            **options,
        )
        before = [p.detach().clone() for p in sharded.parameters()]  # this process's shards
        counter = count_forwards(sharded.module)
        results = Evaluator(cache=cache, memory_budget=BUDGET)(sharded)
        forwards.append(counter[0])
        result = exact_decisions(results)
        result["float32_logprobs"] = {
            i: (p.float32_good_logprob, p.float32_bad_logprob) for i, p in enumerate(results.pairs) if p.rescored
        }
        kept.append(all(p.dtype == w.dtype and torch.equal(p, w) for p, w in zip(sharded.parameters(), before, strict=True)))
        return result

    out["fsdp1_bf16_weights"] = outcome(lambda: evaluate(bf16))
    mixed = MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    out["fsdp1_mixed_precision"] = outcome(lambda: evaluate(model, mixed_precision=mixed, use_orig_params=True))
    out["fsdp1_forwards"], out["fsdp1_weights_kept"] = forwards, kept
    return out


ZERO3 = {
    "train_micro_batch_size_per_gpu": 1,
    # Every weight partitioned, however small (the default keeps parameters under 100K elements whole on each process).
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}


def zero3_exact_scenario(workdir: Path, tokenizer, cache) -> dict:
    import deepspeed

    model = tiny_llama(len(tokenizer))
    bf16 = copy.deepcopy(model)  # what DeepSpeed's bf16 makes of the model: its weights in bf16, its buffers as they are
    for parameter in bf16.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    truth = Evaluator(cache=cache, memory_budget=BUDGET, precision="float32")(bf16)
    out = {
        "float32_truth": truth.outcomes(),
        "float32_logprobs": [(p.good_logprob, p.bad_logprob) for p in truth.pairs],
        "bf16_fast": Evaluator(cache=cache, memory_budget=BUDGET, exact_decisions=False)(bf16).outcomes(),
    }
    deepspeed.init_distributed("gloo")
    engine, *_ = deepspeed.initialize(model=model, config=ZERO3)
    sharded = engine.module  # what a Trainer's callbacks are given
    out["partitioned"] = all(p.numel() == 0 and p.ds_numel > 0 for p in sharded.parameters())
    counter = count_forwards(sharded)
    results = outcome(lambda: Evaluator(cache=cache, memory_budget=BUDGET)(sharded))
    out["forwards"] = counter[0]
    # What exact decisions did: a KeyError where none were made.
    out["zero3"] = results if isinstance(results, str) else outcome(lambda: exact_decisions(results))
    if isinstance(out["zero3"], dict):
        out["zero3"]["float32_logprobs"] = {
            i: (p.float32_good_logprob, p.float32_bad_logprob) for i, p in enumerate(results.pairs) if p.rescored
        }
        out["precision"] = results.run_info.get("precision")
    # The weights as they were: still partitioned, in bf16, the same values (gathered here to compare).
    out["partitioned_after"] = all(p.numel() == 0 and p.dtype == torch.bfloat16 for p in sharded.parameters())
    with deepspeed.zero.GatheredParameters(list(sharded.parameters())):
        out["weights_kept"] = all(torch.equal(p.data, w) for p, w in zip(sharded.parameters(), bf16.parameters(), strict=True))
    # Training goes on after the evaluation.
    batch = torch.tensor([cache.sentence(0)])
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    out["loss_after"] = float(loss)
    return out


class Recorder(TrainerCallback):
    """Records every score by step and saves the weights it was made with (rank 0); counts tatblimp
    logs reaching other reporters; makes the evaluation at ``FAIL_STEP`` fail on rank 1.

    Added before ``TatBLiMPCallback``, so each of its events runs just before the callback's.
    """

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.step = 0
        self.scores: dict[int, torch.Tensor] = {}
        self.logged: list[int] = []
        self.restore = None
        original = Scorer.score

        def recording_score(scorer):
            self.scores[self.step] = original(scorer)
            return self.scores[self.step]

        Scorer.score = recording_score

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.save(state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.restore:
            self.restore = self.restore()
        self.save(state, model)
        if state.global_step == FAIL_STEP:
            self.restore = fail_on(rank=1, call=1)

    def save(self, state, model):
        self.step = state.global_step
        if state.is_world_process_zero and state.global_step % 2 == 0:
            torch.save(model.state_dict(), self.workdir / f"weights-{state.global_step}.pt")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if any(key.startswith("tatblimp/") for key in logs or {}):
            self.logged.append(state.global_step)


def trainer_scenario(workdir: Path, tokenizer, cache) -> dict:
    from trainer_utils import make_trainer

    recorder = Recorder(workdir)
    callback = TatBLiMPCallback(eval_steps=2, data=workdir / "small.jsonl", allow_modified=True, memory_budget=BUDGET)
    trainer = make_trainer(
        tiny_llama(len(tokenizer)),
        tokenizer,
        workdir / f"trainer-{os.environ['RANK']}",
        [recorder, callback],
        max_steps=6,
        per_device_train_batch_size=2,
        ddp_backend="gloo",
        ddp_timeout=60,
        attach=True,
    )
    trainer.train()
    out = {
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "global_step": trainer.state.global_step,
        "failures": callback.failures,
        "history": callback.history,
        "log_history": [e for e in trainer.state.log_history if any(k.startswith("tatblimp/") for k in e)],
        "logged": recorder.logged,
        "scores": recorder.scores,
    }
    dist.barrier()
    dist.destroy_process_group()
    if int(os.environ["RANK"]) == 0:  # the same weights, scored by one process
        out["one_process"] = {}
        for step in recorder.scores:
            model = tiny_llama(len(tokenizer))
            model.load_state_dict(torch.load(workdir / f"weights-{step}.pt"))
            out["one_process"][step] = Scorer(model, cache, memory_budget=BUDGET).score()
    return out


def main() -> None:
    scenario, workdir = sys.argv[1], Path(sys.argv[2])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(workdir / "tokenizer")
    cache = build_cache(tokenizer, workdir / "small.jsonl", allow_modified=True)
    run = {
        "scorer": scorer_scenario,
        "fsdp_exact": fsdp_exact_scenario,
        "zero3_exact": zero3_exact_scenario,
        "trainer": trainer_scenario,
    }[scenario]
    out = run(workdir, tokenizer, cache)
    torch.save(out, workdir / f"{scenario}-rank{os.environ['RANK']}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
