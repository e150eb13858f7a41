"""Issue #51's defects of the in-loop harness tasks and of module modes, each as a user meets it:

- a task with few-shot examples is scored at every evaluation, on the prompts ``lm_eval`` itself draws (defect 1);
- ``generate_until`` tasks generate in eval mode, the training model back in its own modes after (defect 3);
- ``include_tokens`` leaves a frozen submodule frozen (defect 6);
- ``lm_eval_tasks`` leaves the user's tokenizer as it was: no pad token set, no token added (defect 8).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from conftest import DATA, tiny_llama

pytest.importorskip("lm_eval")

from tatblimp_callback import Evaluator, TatBLiMPCallback
from tatblimp_callback.harness.model import TatBLiMPLM

LIMIT = 8


@pytest.fixture(autouse=True)
def tatblimp_data(monkeypatch):
    monkeypatch.setenv("TATBLIMP_DATA", str(DATA))


def write_task(folder: Path, local_tasks: Path, name: str, body: str) -> Path:
    """A task YAML over the local multiple-choice questions (``harness_tasks.write_tasks``' ``mc.jsonl``)."""
    folder.mkdir(parents=True, exist_ok=True)
    head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {local_tasks / 'mc.jsonl'}\ntest_split: test\n"
    (folder / f"{name}.yaml").write_text(head + body)
    return folder


FEWSHOT = (
    "output_type: multiple_choice\nnum_fewshot: 3\n"
    'doc_to_text: "{{question}}"\ndoc_to_choice: "{{endings}}"\ndoc_to_target: "{{label}}"\n'
    "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
)
GENERATE = (
    "output_type: generate_until\n"
    'doc_to_text: "{{question}}"\ndoc_to_target: "{{endings[label]}}"\n'
    "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
    "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
)


def nudge(model, scale: float = 1e-3) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + scale)


def monitor_for(tokenizer, model, small_data, tasks: list[str], include_path: Path):
    callback = TatBLiMPCallback(
        data=small_data,
        allow_modified=True,
        lm_eval_tasks=tasks,
        lm_eval_include_path=str(include_path),
        lm_eval_limit=LIMIT,
        raise_on_error=True,  # a failure raises here, not only counted
    )
    monitor = callback._monitor
    monitor.prepare(tokenizer, model)
    return monitor


def test_fewshot_task_is_scored_at_every_evaluation_on_the_harness_own_prompts(bpe_tokenizer, small_data, local_tasks, tmp_path):
    """Defect 1: a YAML task with ``num_fewshot`` failed at every evaluation (its requests drawn again with other
    examples). Now three evaluations give its metric, and at the last weights it equals ``simple_evaluate`` of the
    same model with the harness's default few-shot seed (the prompts ``lm_eval --model hf`` builds)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    folder = write_task(tmp_path / "tasks", local_tasks, "local_mc_fewshot", FEWSHOT)
    model = tiny_llama(len(bpe_tokenizer), seed=3)
    monitor = monitor_for(bpe_tokenizer, model, small_data, ["local_mc_fewshot"], folder)
    values = []
    for step in range(3):
        metrics = monitor.score(model, step, lambda *_: None, main=True)
        values.append(metrics["lm_eval/local_mc_fewshot/acc"])
        nudge(model)
    assert all(0.0 <= value <= 1.0 for value in values), values
    model_now = copy.deepcopy(model)
    last = monitor.score(model, 3, lambda *_: None, main=True)["lm_eval/local_mc_fewshot/acc"]
    out = simple_evaluate(
        model=TatBLiMPLM(pretrained=model_now, tokenizer=copy.deepcopy(bpe_tokenizer)),
        tasks=["local_mc_fewshot"],
        limit=LIMIT,
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
    )
    assert last == pytest.approx(out["results"]["local_mc_fewshot"]["acc,none"], abs=1e-9)
    # The few-shot prompts are those of the harness's run: its contexts are the requests built at prepare.
    theirs = {args[0] for sample in out["samples"]["local_mc_fewshot"] for args in sample["arguments"]}
    ours = {args[0] for kind, args in monitor.harness._owners if kind == "loglikelihood"}
    assert theirs == ours and len(ours) == LIMIT
    assert all(context.count("\n\n") >= 3 for context in ours)  # three examples before each question


class ModeRecorder:
    """Each forward call's ``training`` flag of the top module, the dropout layers' included."""

    def __init__(self, model):
        self.modes: list[bool] = []
        model.model.register_forward_pre_hook(lambda module, *_: self.modes.append(module.training))


def test_generate_until_generates_in_eval_mode_and_the_modes_come_back(bpe_tokenizer, small_data, local_tasks, tmp_path):
    """Defect 3: in-loop ``generate_until`` generated in train mode (dropout on). Now every forward call of the
    generation sees eval mode, the answers are those of the model in eval mode, and after the evaluation the
    model is in train mode again with its frozen submodule still frozen."""
    folder = write_task(tmp_path / "tasks", local_tasks, "local_generate", GENERATE)
    model = tiny_llama(len(bpe_tokenizer), seed=3, attention_dropout=0.9)
    monitor = monitor_for(bpe_tokenizer, model, small_data, ["local_generate"], folder)
    model.train()
    model.model.layers[0].eval()  # the user froze one layer
    recorder = ModeRecorder(model)
    generated = []
    original = TatBLiMPLM.generate_until
    TatBLiMPLM.generate_until = lambda self, *a, **k: generated.extend(out := original(self, *a, **k)) or out
    try:
        metrics = monitor.score(model, 0, lambda *_: None, main=True)
    finally:
        TatBLiMPLM.generate_until = original
    assert "lm_eval/local_generate/exact_match" in metrics
    assert len(generated) == LIMIT
    assert recorder.modes and not any(recorder.modes), recorder.modes.count(True)
    assert model.training and model.model.layers[1].training and not model.model.layers[0].training
    assert not any(m.training for m in model.model.layers[0].modules())
    # The answers are the model's in eval mode: greedy, as ``HFLM`` generates them from the model in eval mode.
    frozen = copy.deepcopy(model).eval()
    expected = TatBLiMPLM(pretrained=frozen, tokenizer=copy.deepcopy(bpe_tokenizer)).generate_until(
        [request for task in monitor.harness.task_dict["tasks"].values() for request in task.instances], disable_tqdm=True
    )
    assert generated == expected


def test_include_tokens_leaves_a_frozen_submodule_frozen(bpe_tokenizer, small_data):
    """Defect 6: the region-surprisal pass of ``include_tokens`` put every submodule in the top module's mode."""
    model = tiny_llama(len(bpe_tokenizer), seed=3, attention_dropout=0.5)
    model.train()
    model.model.layers[0].eval()
    recorder = ModeRecorder(model)
    results = Evaluator(bpe_tokenizer, small_data, allow_modified=True, include_tokens=True)(model)
    assert any(record.critical_region_bits for record in results.pair_tokens)  # the region pass ran
    assert recorder.modes and not any(recorder.modes)  # every pass in eval mode
    assert model.training and model.model.layers[1].training
    assert not any(m.training for m in model.model.layers[0].modules())


@pytest.mark.parametrize("eos", [True, False], ids=["eos-as-pad", "pad-token-added"])
def test_lm_eval_tasks_leave_the_training_tokenizer_unchanged(bpe_tokenizer, small_data, local_tasks, eos):
    """Defect 8: the harness model set the tokenizer's pad token (to its eos), or added ``<|pad|>`` (one more token
    than the model's embeddings), on the training tokenizer itself."""
    tokenizer = copy.deepcopy(bpe_tokenizer)
    tokenizer.pad_token = None
    if not eos:
        tokenizer.eos_token = None
    before = (len(tokenizer), tokenizer.pad_token, tokenizer.pad_token_id, tokenizer.eos_token)
    model = tiny_llama(len(bpe_tokenizer), seed=3)
    monitor = monitor_for(tokenizer, model, small_data, ["local_mc"], local_tasks)
    metrics = monitor.score(model, 0, lambda *_: None, main=True)
    assert "lm_eval/local_mc/acc" in metrics
    assert (len(tokenizer), tokenizer.pad_token, tokenizer.pad_token_id, tokenizer.eos_token) == before
    assert before[1] is None and before[0] == len(bpe_tokenizer)
    assert monitor.harness._lm.tokenizer is not tokenizer and monitor.harness._lm.tokenizer.pad_token is not None


@pytest.mark.slow
def test_trainer_run_with_fewshot_and_generate_tasks_logs_the_harness_numbers(bpe_tokenizer, small_data, local_tasks, tmp_path):
    """A real Trainer run (dropout on while training) with a few-shot task and a generation task: each evaluation
    logs both, and at the last step the few-shot task's accuracy is the one ``lm_eval --model hf`` gives for the
    checkpoint saved there (its few-shot prompts). (The generations
    themselves are compared in ``test_generate_until_generates_in_eval_mode_and_the_modes_come_back``.)"""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from trainer_utils import checkpointed_trainer

    folder = write_task(tmp_path / "tasks", local_tasks, "local_mc_fewshot", FEWSHOT)
    write_task(folder, local_tasks, "local_generate", GENERATE)
    tokenizer = copy.deepcopy(bpe_tokenizer)
    model = tiny_llama(len(tokenizer), seed=5, attention_dropout=0.5)
    trainer = checkpointed_trainer(model, tokenizer, tmp_path / "run")
    tasks = ["local_mc_fewshot", "local_generate"]
    TatBLiMPCallback.attach(
        trainer,
        data=small_data,
        allow_modified=True,
        eval_steps=2,
        lm_eval_tasks=tasks,
        lm_eval_include_path=str(folder),
        lm_eval_limit=LIMIT,
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "lm_eval/local_mc_fewshot/acc" in entry]
    assert [entry["step"] for entry in logged] == [0, 2, 4]
    assert all("lm_eval/local_generate/exact_match" in entry for entry in logged)
    out = simple_evaluate(
        model="hf",
        model_args=f"pretrained={tmp_path / 'run' / 'checkpoint-4'},dtype=float32",
        tasks=tasks,
        limit=LIMIT,
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        device="cpu",
    )
    assert logged[-1]["lm_eval/local_mc_fewshot/acc"] == pytest.approx(out["results"]["local_mc_fewshot"]["acc,none"], abs=1e-12)
