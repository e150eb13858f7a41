"""A real ``lightning.Trainer`` run on the CPU with ``TatBLiMPLightningCallback``, for ``test_lightning.py``.

    python lightning_worker.py WORKDIR DEVICES [fsdp2-module | fsdp2-model]

WORKDIR holds ``tokenizer/`` and ``small.jsonl`` from the test. With DEVICES 2 the Trainer runs DDP (gloo),
and Lightning starts this script again for rank 1; with ``fsdp2-...`` it runs Lightning's ``ModelParallelStrategy``
and the module shards itself with ``fully_shard``: each decoder layer, then as the root unit the LightningModule
(``fsdp2-module``) or its transformers model (``fsdp2-model``). The run logs to a CSV, a TensorBoard and an offline
wandb logger; each rank writes ``rank{r}.pt``: the callback's history, the weights at every step it
scored (taken just before it, by a callback listed first), whether the random generators and the
train mode were as before after each of the callback's events, and (rank 0) the wandb run folder.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from transformers import PreTrainedTokenizerFast

from conftest import tiny_llama
from tatblimp_callback.lightning import TatBLiMPLightningCallback
from trainer_utils import corpus_blocks

EVERY = 2
MAX_STEPS = 5  # scored at 0, 2, 4 and the last, 5
FAIL_STEP = 4  # under fsdp2, the evaluation of this step fails on rank 1 only, before any scoring


class TinyLM(L.LightningModule):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.model = tiny_llama(vocab_size, attention_dropout=0.1).train()

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class ShardedLM(TinyLM):
    """FSDP2 with the LightningModule itself the root unit (``ROOT`` "module"): its forward, which
    ``training_step`` calls, gathers the parameters outside the layers (embeddings, norm, head); or with
    the transformers model the root ("model"), whose own forward gathers them."""

    ROOT = "module"

    def forward(self, batch):
        return self.model(input_ids=batch, labels=batch).loss

    def training_step(self, batch, batch_idx):
        return self(batch)

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self if self.ROOT == "module" else self.model, mesh=mesh)


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights on every rank (``full_tensor`` of sharded ones: a collective every rank calls)."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in module.state_dict().items()}


def rng_states():
    return (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())


class Around(L.Callback):
    """Listed before and after the TatBLiMP callback: weights before each evaluation; RNG and mode after."""

    def __init__(self, record: dict, before: bool):
        self.record, self.before = record, before

    def _check(self, trainer, pl_module):
        if self.before:
            self.record["step"] = trainer.global_step
            self.record["rng"] = rng_states()
            if trainer.global_step % EVERY == 0 or trainer.global_step == MAX_STEPS:
                self.record["weights"][trainer.global_step] = full_state(pl_module.model)
        else:
            python, numpy, torch_state = rng_states()
            same = (
                python == self.record["rng"][0]
                and numpy == self.record["rng"][1]
                and torch.equal(torch_state, self.record["rng"][2])
            )
            self.record["rng_same"].append(same)
            self.record["train_mode"].append(pl_module.model.training)

    def on_train_start(self, trainer, pl_module):
        self._check(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._check(trainer, pl_module)


def noisy_scoring() -> None:
    """Make every evaluation draw from every random generator, as a model with dropout in train mode would:
    the callback must leave them as they were."""
    from tatblimp_callback import evaluation

    score = evaluation.Evaluator.__call__

    def noisy(self, *args, **kwargs):
        random.random(), np.random.rand(), torch.rand(1)
        return score(self, *args, **kwargs)

    evaluation.Evaluator.__call__ = noisy


def failing_on_rank_1(record: dict) -> None:
    """Make the evaluation at ``FAIL_STEP`` fail on rank 1 alone, while preparing (before any forward):
    rank 0 must stop the same evaluation (the engine's check-in) rather than wait in a sharded forward."""
    from tatblimp_callback import evaluation

    prepare = evaluation.Evaluator.prepare

    def failing(self, model):
        if torch.distributed.get_rank() == 1 and record.get("step") == FAIL_STEP:
            raise RuntimeError("injected failure on rank 1")
        return prepare(self, model)

    evaluation.Evaluator.prepare = failing


def main(workdir: Path, devices: int, fsdp2: str | None = None) -> None:
    noisy_scoring()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(workdir / "tokenizer")
    blocks = torch.tensor([block["input_ids"] for block in corpus_blocks(tokenizer, lines=120)])
    record = {"weights": {}, "rng_same": [], "train_mode": []}
    if fsdp2:
        failing_on_rank_1(record)
    callback = TatBLiMPLightningCallback(
        tokenizer=tokenizer, data=workdir / "small.jsonl", allow_modified=True, eval_every_n_steps=EVERY
    )
    best = ModelCheckpoint(
        dirpath=workdir / "ckpt", monitor="tatblimp/acc_norm", mode="max", every_n_train_steps=EVERY, filename="{step}"
    )
    wandb_logger = WandbLogger(project="tatblimp-test", save_dir=str(workdir), offline=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
        if fsdp2
        else "ddp"
        if devices > 1
        else "auto",
        max_steps=MAX_STEPS,
        default_root_dir=str(workdir / "root"),
        logger=[
            CSVLogger(str(workdir), name="csv", version=0),
            TensorBoardLogger(str(workdir), name="tb", version=0),
            wandb_logger,
        ],
        callbacks=[Around(record, True), callback, Around(record, False), best],
        enable_progress_bar=False,
        log_every_n_steps=1,
    )
    ShardedLM.ROOT = fsdp2
    module = (ShardedLM if fsdp2 else TinyLM)(len(tokenizer))
    trainer.fit(module, DataLoader(blocks, batch_size=4))
    rank = trainer.global_rank
    out = {
        "history": callback.history,
        "failures": callback.failures,
        "weights": record["weights"],
        "rng_same": record["rng_same"],
        "train_mode": record["train_mode"],
        "final_weights": full_state(module.model),
        "best": (Path(best.best_model_path).name, best.best_model_score.item()),
    }
    if rank == 0:
        out["wandb_dir"] = str(Path(wandb_logger.experiment.dir).parent)
        wandb_logger.experiment.finish()
    torch.save(out, workdir / f"rank{rank}.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].removeprefix("fsdp2-") if sys.argv[3:] else None)
