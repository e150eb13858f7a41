"""A tiny HF Trainer run on the shared Tatar corpus, for the callback tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from conftest import CORPUS
from tatblimp_callback import TatBLiMPCallback


def corpus_blocks(tokenizer, block: int = 32, lines: int = 300) -> list[dict]:
    text = CORPUS.read_text(encoding="utf-8").splitlines()[:lines]
    ids = [t for line in tokenizer(text, add_special_tokens=False)["input_ids"] for t in [*line, tokenizer.eos_token_id]]
    return [{"input_ids": ids[i : i + block], "labels": ids[i : i + block]} for i in range(0, len(ids) - block, block)]


def checkpointed_trainer(model, tokenizer, output_dir) -> Trainer:
    """4 steps of batch 1 on the corpus's first 64 lines (32 tokens each), a checkpoint at step 4: a run whose last
    evaluation can be checked against ``lm_eval --model hf`` on that checkpoint."""
    lines = CORPUS.read_text(encoding="utf-8").splitlines()[:64]
    train = [{"input_ids": ids, "labels": ids} for ids in (tokenizer(line)["input_ids"][:32] for line in lines)]
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=4,
        per_device_train_batch_size=1,
        learning_rate=5e-3,
        save_strategy="steps",
        save_steps=4,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return Trainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)


def make_trainer(model, tokenizer, output_dir, callbacks=(), eval_dataset=None, attach=False, **overrides) -> Trainer:
    """A Trainer given ``callbacks=[...]``, as a user would; ``attach=True``: the ``TatBLiMPCallback``s among them
    are given the Trainer (``trainer=``), as ``TatBLiMPCallback.attach`` does."""
    options = dict(
        output_dir=str(output_dir),
        max_steps=5,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    args = TrainingArguments(**{**options, **overrides})
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=corpus_blocks(tokenizer),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )
    if attach:
        for callback in callbacks:
            if isinstance(callback, TatBLiMPCallback):
                callback.trainer = trainer
    return trainer


def losses(trainer: Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def tatblimp_entries(trainer: Trainer, key: str = "tatblimp/acc") -> list[dict]:
    return [entry for entry in trainer.state.log_history if key in entry]


def weights_copy(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def run_wandb_script(script: str, wandb_dir: Path, **env: str) -> list[str]:
    """Run ``script`` (a Trainer run reporting to offline wandb) in a fresh process; the run folders it
    printed as ``RUN_DIR=...`` lines."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_PROJECT": "tatblimp-test", **env}
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line[len("RUN_DIR=") :] for line in done.stdout.splitlines() if line.startswith("RUN_DIR=")]


def wandb_records(run_dir: str) -> list[dict]:
    """An offline wandb run read back as users would: ``wandb leet inspect --json``, one record a line."""
    command = [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", run_dir]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
