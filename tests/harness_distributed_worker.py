"""One process of a two-process (gloo) run for ``test_harness_in_loop.py``, started by torchrun.

    python -m torch.distributed.run --nproc_per_node 2 harness_distributed_worker.py WORKDIR DATA TASKS

The callback's in-loop monitor scores TatBLiMP and harness tasks (``lm_eval_tasks``) on a DDP-wrapped tiny model,
both processes alike; each rank writes ``harness-rank{r}.pt``: its metrics, how many harness continuation tokens it
gave the head, and how many evaluations it published. Afterwards rank 0 scores the same weights on one process.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from transformers import PreTrainedTokenizerFast

from conftest import tiny_llama
from tatblimp_callback import TatBLiMPCallback

TASKS = ["local_mc", "local_blimp", "local_rolling", "tatblimp_binding"]
BUDGET = 2**20  # small: several batches to deal out


def evaluate(model, tokenizer, data: str, tasks: str) -> tuple[dict, int, int, int, list]:
    """One in-loop evaluation: the metrics, this process's continuation tokens read, their total, publications, and
    each request's (log-prob, is_greedy)."""
    callback = TatBLiMPCallback(
        data=data, allow_modified=True, memory_budget=BUDGET, lm_eval_tasks=TASKS, lm_eval_include_path=tasks, lm_eval_limit=12
    )
    monitor, published = callback._monitor, []
    monitor.prepare(tokenizer, model)
    metrics = monitor.score(
        model, 0, lambda *args: published.append(args), main=dist.is_initialized() is False or dist.get_rank() == 0
    )
    spans = monitor.evaluator._scorer.spans
    total = sum(monitor.evaluator._scorer.cache.span_tokens)
    lm_eval = {k: v for k, v in metrics.items() if k.startswith("lm_eval/")}
    return lm_eval, spans.tokens_read, total, len(published), list(monitor.evaluator.span_scores)


def greedy_spans(model, tokenizer, data: str) -> list:
    """(log-prob, is_greedy) of spans whose continuations are the model's own greedy tokens, and of the same with
    the last token changed, scored with TatBLiMP: the greedy flags added over the processes."""
    from tatblimp_callback import Evaluator
    from tatblimp_callback.engine.scored_spans import Spans

    sequences = []
    for k in range(8):
        prompt = torch.tensor([[tokenizer.bos_token_id, *range(10 + 7 * k, 16 + 7 * k)]])
        with torch.no_grad():
            ids = model.generate(prompt, max_new_tokens=1 + k % 3, do_sample=False, pad_token_id=0)[0].tolist()
        sequences += [ids, [*ids[:-1], (ids[-1] + 1) % len(tokenizer)]]
    scored = [1 + (k // 2) % 3 for k in range(len(sequences))]
    evaluator = Evaluator(tokenizer, data, allow_modified=True, memory_budget=BUDGET, spans=Spans(sequences, scored))
    evaluator(model)
    return list(evaluator.span_scores)


def main() -> None:
    workdir, data, tasks = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(workdir / "tokenizer")
    model = tiny_llama(len(tokenizer), seed=3)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    metrics, read, total, published, scores = evaluate(wrapped, tokenizer, data, tasks)
    out = {"world_size": dist.get_world_size(), "metrics": metrics, "tokens_read": read, "continuation_tokens": total}
    out["span_scores"] = scores
    out["greedy"] = greedy_spans(model, tokenizer, data)
    out["published"] = published
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:  # the same weights on one process
        out["one_process"], out["one_process_tokens_read"], _, _, out["one_process_scores"] = evaluate(
            tiny_llama(len(tokenizer), seed=3), tokenizer, data, tasks
        )
        out["one_process_greedy"] = greedy_spans(tiny_llama(len(tokenizer), seed=3), tokenizer, data)
    torch.save(out, workdir / f"harness-rank{rank}.pt")


if __name__ == "__main__":
    main()
