"""Where users train besides the HF Trainer: TRL's SFTTrainer with a LoRA adapter, a plain accelerate loop (one and
two processes) and Lightning Fabric, each scoring with this library's own parts, and its scores equal to a fresh evaluate."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import CORPUS, tiny_llama
from tatblimp_callback import Evaluator, TatBLiMPCallback, evaluate
from tatblimp_callback.engine.model_checks import unwrap_model
from trainer_utils import corpus_blocks

WORKER = Path(__file__).with_name("accelerate_worker.py")


def test_trl_sft_trainer_with_lora_on_attention_and_the_callback(tmp_path, bpe_tokenizer, small_data):
    pytest.importorskip("trl")
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    lines = [line for line in CORPUS.read_text(encoding="utf-8").splitlines()[:200] if line.strip()]
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=5e-2,
        max_length=32,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    trainer = SFTTrainer(
        model=tiny_llama(len(bpe_tokenizer)),
        args=args,
        train_dataset=Dataset.from_dict({"text": lines}),
        processing_class=bpe_tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    assert type(trainer.model).__name__.startswith("Peft")  # the adapter, on the attention
    callback = TatBLiMPCallback.attach(trainer, eval_steps=2, data=small_data, allow_modified=True)
    trainer.train()
    assert [e["step"] for e in callback.history] == [0, 2, 4]
    first, last = (
        {k: v for k, v in e.items() if not k.endswith("eval_seconds")} for e in (callback.history[0], callback.history[-1])
    )
    assert first != last  # the adapter trained: the curve moved
    fresh = evaluate(trainer.model, bpe_tokenizer, small_data, allow_modified=True)
    assert [p.good_logprob for p in callback.last_results.pairs] == [p.good_logprob for p in fresh.pairs]
    assert callback.history[-1]["tatblimp/acc_norm"] == fresh.acc_norm
    assert [e["tatblimp/acc"] for e in trainer.state.log_history if "tatblimp/acc" in e] == [
        e["tatblimp/acc"] for e in callback.history
    ]


def run_accelerate(tmp_path: Path, tokenizer, small_data, processes: int) -> list[dict]:
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    shutil.copy(small_data, tmp_path / "small.jsonl")
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [*launcher, str(WORKER), str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return [torch.load(tmp_path / f"accelerate-rank{r}.pt", weights_only=False) for r in range(processes)]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_a_plain_accelerate_loop_scores_with_the_evaluator(tmp_path, bpe_tokenizer, small_data, processes):
    ranks = run_accelerate(tmp_path, bpe_tokenizer, small_data, processes)
    assert all(out["processes"] == processes for out in ranks)
    scores = ranks[0]["scores"]
    assert [step for step, _, _ in scores] == [2, 4]
    assert all(out["scores"] == scores for out in ranks)  # every process gets every sentence's log-prob
    assert all(out["training"] for out in ranks)  # the prepared model is back in train mode
    model = tiny_llama(len(bpe_tokenizer))
    model.load_state_dict(ranks[0]["weights"])
    fresh = evaluate(model, bpe_tokenizer, small_data, allow_modified=True)
    assert scores[-1][2] == [p.good_logprob for p in fresh.pairs]
    assert scores[-1][1] == fresh.acc_norm


def test_lightning_fabric_with_the_evaluator(bpe_tokenizer, small_data):
    lightning = pytest.importorskip("lightning")
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    model = tiny_llama(len(bpe_tokenizer)).train()
    bare_module = model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    assert type(model).__name__ == "_FabricModule" and unwrap_model(model) is bare_module
    assert unwrap_model(torch.compile(model)) is bare_module
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(torch.tensor([b["input_ids"] for b in corpus_blocks(bpe_tokenizer, lines=60)]), batch_size=4)
    )
    evaluator = Evaluator(bpe_tokenizer, small_data, allow_modified=True)
    curve = [(0, evaluator(model).acc_norm)]
    for step, batch in enumerate(loader, start=1):
        fabric.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 2 == 0:
            results = evaluator(model)
            curve.append((step, results.acc_norm))
        if step == 4:
            break
    assert [step for step, _ in curve] == [0, 2, 4]
    assert model.training
    bare = tiny_llama(len(bpe_tokenizer))
    bare.load_state_dict(model.module.state_dict())
    fresh = evaluate(bare, bpe_tokenizer, small_data, allow_modified=True)
    assert [p.good_logprob for p in results.pairs] == [p.good_logprob for p in fresh.pairs]
