"""A plain accelerate training loop (``Accelerator.prepare``) that scores with ``Evaluator``, for ``test_training_stacks.py``.

    python -m torch.distributed.run --nproc_per_node 2 accelerate_worker.py WORKDIR   (or plain python: one process)

WORKDIR holds ``tokenizer/`` and ``small.jsonl``; each rank writes ``accelerate-rank{r}.pt``: its acc_norm and
per-sentence log-probs at every evaluation, and the final weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from transformers import PreTrainedTokenizerFast

from conftest import tiny_llama
from tatblimp_callback import Evaluator
from trainer_utils import corpus_blocks


def main(workdir: Path) -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(workdir / "tokenizer")
    blocks = torch.tensor([b["input_ids"] for b in corpus_blocks(tokenizer, lines=120)])
    model = tiny_llama(len(tokenizer)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(blocks, batch_size=4))
    evaluator = Evaluator(tokenizer, workdir / "small.jsonl", allow_modified=True)
    scores = []
    for step, batch in enumerate(loader, start=1):
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 2 == 0:  # every process calls the evaluator: each scores a share, all get the results
            results = evaluator(model)
            scores.append((step, results.acc_norm, [p.good_logprob for p in results.pairs]))
        if step == 4:
            break
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    out = {"scores": scores, "weights": weights, "training": model.training, "processes": accelerator.num_processes}
    torch.save(out, workdir / f"accelerate-rank{accelerator.process_index}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
