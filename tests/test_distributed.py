"""Two processes (torchrun, gloo, CPU): sharded scoring equals one process, failures end on both, no hang.

The heavy lifting is in ``distributed_worker.py``; each scenario is one torchrun launch with a
timeout, and these tests check what the two ranks wrote.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tatblimp_callback.engine.distributed import assign, shard

WORKER = Path(__file__).with_name("distributed_worker.py")
LAUNCH_TIMEOUT = 300  # seconds; a hang fails the test instead of the suite


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, bpe_tokenizer, small_data) -> Path:
    path = tmp_path_factory.mktemp("distributed")
    bpe_tokenizer.save_pretrained(path / "tokenizer")
    shutil.copy(small_data, path / "small.jsonl")
    return path


def launch(scenario: str, workdir: Path) -> tuple[list[dict], str]:
    """Run ``scenario`` on two processes; each rank's output and the launch's combined log."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    try:
        done = subprocess.run(
            [*command, str(WORKER), scenario, str(workdir)],
            capture_output=True,
            text=True,
            timeout=LAUNCH_TIMEOUT,
            env=env,
            cwd=workdir,
        )
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"{scenario}: the two processes hung for {LAUNCH_TIMEOUT} s\n{(timeout.stderr or b'')[-3000:]}")
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"{scenario} failed:\n{log[-5000:]}"
    return [torch.load(workdir / f"{scenario}-rank{r}.pt", weights_only=False) for r in (0, 1)], log


@pytest.fixture(scope="module")
def scorer_run(workdir):
    return launch("scorer", workdir)


@pytest.fixture(scope="module")
def fsdp_exact_run(workdir):
    return launch("fsdp_exact", workdir)


@pytest.fixture(scope="module")
def zero3_exact_run(workdir):
    pytest.importorskip("deepspeed")
    return launch("zero3_exact", workdir)


@pytest.fixture(scope="module")
def trainer_run(workdir):
    return launch("trainer", workdir)


# -- the assignment, in this process -------------------------------------------------------------


def test_assignment_balances_tokens_and_covers_every_batch_once():
    costs = [300, 20, 300, 20, 100, 100]
    shares = assign(costs, 2)
    assert sorted(i for share in shares for i in share) == list(range(len(costs)))
    assert shares == [[0, 1, 4], [2, 3, 5]]
    assert [sum(costs[i] for i in share) for share in shares] == [420, 420]  # round robin: 700/140
    assert shares == assign(costs, 2)  # the same on every process
    assert all(share == sorted(share) for share in shares)
    # Fewer batches than ranks: the extra ranks get none.
    assert assign([5, 5], 3) == [[0], [1], []]


def test_one_process_runs_every_batch_without_collectives():
    batches = ["a", "b", "c"]
    assert list(shard(batches, lockstep=True)) == [("a", False), ("b", False), ("c", False)]  # no fillers


# -- the scorer on two processes -----------------------------------------------------------------


@pytest.mark.slow
def test_sharded_scores_equal_one_process_bitwise(scorer_run):
    ranks, _ = scorer_run
    for out in ranks:
        one = out["one_process"]
        assert one.shape == (96,) and torch.isfinite(one).all()
        for key in ("sharded", "sharded_again", "after_failure", "after_oom"):
            assert torch.equal(out[key], one), key
    assert torch.equal(ranks[0]["one_process"], ranks[1]["one_process"])
    assert torch.equal(ranks[0]["alone"], ranks[0]["one_process"])  # this_process_only: no collectives
    assert ranks[0]["method"] == ranks[1]["method"] == "tree rows, tiled head"
    # Every batch runs exactly once, on the rank the token-balanced assignment gives it.
    sizes = ranks[0]["batch_sizes"]
    assert len(sizes) == 9
    shares = assign(sizes, 2)
    assert [out["forwards"] for out in ranks] == [len(share) for share in shares] == [5, 4]


@pytest.mark.slow
def test_exact_decisions_rescore_the_same_pairs_on_both_ranks_as_one_process(scorer_run):
    ranks, _ = scorer_run
    one = ranks[0]["bf16_one_process"]
    assert one["record"]["rescored_pairs"] == sum(one["rescored"]) > 0
    assert all(out["bf16_sharded"] == out["bf16_one_process"] == one for out in ranks)


@pytest.mark.slow
def test_forced_choice_is_sharded_and_equals_one_process_bitwise(scorer_run):
    ranks, _ = scorer_run
    for out in ranks:
        assert out["fc_one_process"].shape == (96, 2) and torch.isfinite(out["fc_one_process"]).all()
        assert torch.equal(out["fc_sharded"], out["fc_one_process"])
    # Every batch runs once, on the rank the token-balanced assignment gives it.
    shares = assign(ranks[0]["fc_batch_sizes"], 2)
    assert len(ranks[0]["fc_batch_sizes"]) >= 2
    assert [out["fc_forwards"] for out in ranks] == [len(share) for share in shares]


@pytest.mark.slow
def test_short_shards_repeat_a_batch_only_in_lockstep(scorer_run):
    ranks, _ = scorer_run
    # Batches of 30, 20 and 10 tokens: rank 0 takes the 30, rank 1 the 20 and the 10; in
    # lockstep rank 0 repeats its batch as a filler (is_filler=True), whose result is dropped.
    assert ranks[0]["lockstep"] == [("a", False), ("a", True)]
    assert ranks[1]["lockstep"] == [("b", False), ("c", False)]
    assert ranks[0]["no_lockstep"] == [("a", False)]


@pytest.mark.slow
def test_a_failure_on_one_rank_ends_the_evaluation_on_both(scorer_run):
    ranks, _ = scorer_run
    # Inside scoring (rank 1's second batch) and before it (rank 1's prepare).
    assert ranks[1]["failure_inside"] == "Injected: injected failure on rank 1"
    assert ranks[0]["failure_inside"] == "PeerFailure: tatblimp: scoring failed on process 1; see its log"
    assert ranks[1]["failure_before"] == "Injected: prepare failed on rank 1"
    assert ranks[0]["failure_before"].startswith("PeerFailure")
    # Forced choice prepares inside the same agreement: rank 0 ends too, rather than wait in a collective.
    assert ranks[1]["fc_failure_before"] == "Injected: forced-choice prepare failed on rank 1"
    assert ranks[0]["fc_failure_before"] == "PeerFailure: tatblimp: scoring failed on process 1; see its log"
    # Both stayed in step: the next evaluations give the one-process numbers (checked above) ...
    for out in ranks:
        assert out["evaluator_after_failure"] == out["one_process_evaluator"]
        assert out["fc_evaluator_after_failure"] == out["fc_one_process_evaluator"]
        # ... and out of memory on rank 0 made both retry once with the same halved budget.
        assert (out["oom_retries"], out["oom_budget"]) == (1, 2**20)


@pytest.mark.slow
def test_processes_holding_different_benchmarks_are_told_so(scorer_run):
    """Rank 1 read a file one pair short: the collectives of other sizes aborted the job (gloo, SIGABRT)."""
    ranks, _ = scorer_run
    for out, sentences in zip(ranks, (96, 94)):
        assert out["different_data"] == (
            "ValueError: the processes hold different benchmarks or tokenizers (this one's: "
            f"{sentences} sentences, {out['tokenizer_name']}): give every process the same"
        )


@pytest.mark.slow
def test_include_tokens_gives_the_critical_region_on_every_process(scorer_run):
    """Under torch.distributed every pair's critical_region_tokens and _bits were None, with no word."""
    ranks, _ = scorer_run
    assert sum(bits is not None for bits in ranks[0]["regions_one_process"]) > 0
    for out in ranks:
        assert out["regions_sharded"] == out["regions_one_process"]


@pytest.mark.slow
def test_a_failure_on_one_rank_in_the_first_method_check_keeps_both_in_step(scorer_run):
    """Before, the failing rank took its error for the method's and went on to the next method alone, the other
    stayed in the readout's collectives: gloo aborted the job (SIGABRT) at the first evaluation."""
    ranks, _ = scorer_run
    fastest = ranks[0]["method"]  # what the same model is scored with where nothing fails
    assert ranks[0]["readout_failure_method"] == ranks[1]["readout_failure_method"] != fastest  # ruled out on both
    for out in ranks:
        assert torch.allclose(out["readout_failure_scores"], out["one_process"], rtol=1e-5, atol=1e-4)
    assert ranks[1]["plain_forward_failure"] == "Injected: plain forward failed on rank 1"
    assert ranks[0]["plain_forward_failure"] == "PeerFailure: tatblimp: scoring failed on process 1; see its log"
    for out in ranks:  # in step after it: the next evaluation is one process's, bit for bit
        assert torch.equal(out["after_plain_forward_failure"], out["one_process"])


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["sentences", "forced_choice"])
def test_fsdp2_model_is_scored_with_its_own_forward_in_lockstep(scorer_run, protocol):
    ranks, _ = scorer_run
    name, one_process = ("fsdp", "one_process_logits") if protocol == "sentences" else ("fc_fsdp", "fc_one_process_logits")
    for out in ranks:
        assert isinstance(out[name], torch.Tensor), out[name]
        assert out[f"{name}_method"] == "tree rows, full logits"
        assert torch.equal(out[name], out[one_process])
    # The batches are dealt out, and a rank with fewer repeats one: both run the busier rank's forward calls.
    shares = assign(ranks[0][f"{name}_batch_sizes"], 2)
    if protocol == "sentences":
        assert sorted(len(share) for share in shares) == [4, 5]  # 9 batches: one rank repeats one
    assert ranks[0][f"{name}_forwards"] == ranks[1][f"{name}_forwards"] == max(len(share) for share in shares) >= 2


def assert_float32_decisions(exact, truth: dict, float32: list) -> None:
    """One rank's exact decisions of a sharded bf16 model: float32's, pair by pair, the rescored pairs named."""
    assert isinstance(exact, dict), exact
    # The rescored sentences' log-probs are float32's (the sharded model's own logits: float32 rounding only).
    rescored = exact["float32_logprobs"]
    error = max(abs(a - b) for i in rescored for a, b in zip(rescored[i], float32[i], strict=True))
    assert error < 1e-4, error
    assert exact["outcomes"] == truth  # every pair decided as float32 decides it
    assert exact["record"]["precision"] == "bfloat16"
    assert exact["record"]["rescored_pairs"] == sum(exact["rescored"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["fsdp_bf16_weights", "fsdp_mixed_precision", "fsdp1_bf16_weights", "fsdp1_mixed_precision"])
def test_fsdp_bf16_decisions_equal_one_process_float32_of_the_same_weights(fsdp_exact_run, weights):
    """FSDP2 (``fully_shard``) and FSDP1 (``FullyShardedDataParallel``): bf16 weights, and float32 ones gathered in
    bf16 by a mixed-precision policy (FSDP1's casting each layer's inputs to bf16 too, kept in float32 here)."""
    ranks, _ = fsdp_exact_run
    truth, one = ranks[0]["float32_truth"], ranks[0]["bf16_one_process"]
    assert ranks[0]["bf16_fast"]["acc"] != truth["acc"]  # in bf16 some decisions are rounding: what is corrected
    assert one["outcomes"] == truth
    float32 = ranks[0]["float32_logprobs"]
    if weights.endswith("mixed_precision"):  # the float32 weights gathered in bf16; the buffers stay float32
        truth, float32 = ranks[0]["float32_truth_mixed"], ranks[0]["float32_logprobs_mixed"]
    for out in ranks:
        assert_float32_decisions(out[weights], truth, float32)
    assert ranks[0][weights]["rescored"] == ranks[1][weights]["rescored"]
    fsdp = "fsdp1_" if weights.startswith("fsdp1") else ""
    assert ranks[0][f"{fsdp}forwards"] == ranks[1][f"{fsdp}forwards"]  # the same forward calls on both: in lockstep
    assert ranks[0][f"{fsdp}weights_kept"] == ranks[1][f"{fsdp}weights_kept"] == [True, True]  # upcast for the forwards only


@pytest.mark.slow
def test_zero3_bf16_decisions_equal_one_process_float32_of_the_same_weights(zero3_exact_run):
    ranks, _ = zero3_exact_run
    truth, float32 = ranks[0]["float32_truth"], ranks[0]["float32_logprobs"]
    assert ranks[0]["bf16_fast"]["acc"] != truth["acc"]  # in bf16 some decisions are rounding: what is corrected
    for out in ranks:
        assert out["partitioned"]  # every weight split over the two processes: each forward gathers them
        assert out["precision"] == "bfloat16"
        assert_float32_decisions(out["zero3"], truth, float32)  # DeepSpeed's gathered weights upcast in each call
        # Upcast for the forwards only: still partitioned, in bf16, bit for bit; and training goes on.
        assert out["partitioned_after"] and out["weights_kept"]
        assert out["loss_after"] > 0
    assert ranks[0]["zero3"]["rescored"] == ranks[1]["zero3"]["rescored"]
    assert ranks[0]["forwards"] == ranks[1]["forwards"] > 0  # in lockstep


# -- an HF Trainer under DDP ---------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_under_ddp_matches_one_process_and_logs_once(trainer_run):
    ranks, _ = trainer_run
    assert [(out["world_size"], out["backend"]) for out in ranks] == [(2, "gloo"), (2, "gloo")]
    one = ranks[0]["one_process"]  # rank 0 scored the saved weights alone after training
    assert sorted(one) == [0, 2, 6]
    for out in ranks:
        assert sorted(out["scores"]) == [0, 2, 6]
        for step, scores in out["scores"].items():
            assert torch.equal(scores, one[step]), step
    assert not torch.equal(one[0], one[6])  # training changed the weights
    metrics = [[{k: v for k, v in e.items() if k != "tatblimp/eval_seconds"} for e in out["history"]] for out in ranks]
    assert metrics[0] == metrics[1]  # every rank has the same results (for its failure policy)
    # Only the main process logs: one entry per evaluation in log_history and at the reporters.
    assert [entry["step"] for entry in ranks[0]["log_history"]] == [0, 2, 4, 6]
    assert ranks[0]["logged"] == [0, 2, 4, 6]
    assert ranks[1]["log_history"] == [] and ranks[1]["logged"] == []


@pytest.mark.slow
def test_trainer_failure_on_one_rank_is_counted_on_both_and_training_goes_on(trainer_run):
    ranks, log = trainer_run
    for out in ranks:
        assert out["global_step"] == 6
        assert out["failures"] == 1
        assert [entry["step"] for entry in out["history"]] == [0, 2, 6]
    assert ranks[0]["log_history"][2] == {"tatblimp/failures": 1.0, "step": 4}
    assert ranks[0]["history"][-1]["tatblimp/failures"] == 1.0
    assert "Injected: injected failure on rank 1" in log
    assert "PeerFailure: tatblimp: scoring failed on process 1" in log
