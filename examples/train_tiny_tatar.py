"""Train a tiny Llama on Tatar text from scratch and watch TatBLiMP while it learns.

    python examples/train_tiny_tatar.py --corpus ../shared/tatar-corpus/train.txt --data ../shared/tatblimp/test.jsonl

It trains a byte-level BPE tokenizer on the corpus, a 1.4M-parameter Llama with the Hugging Face
Trainer on a CPU (about 10 minutes on 2 cores with the defaults), scores TatBLiMP before the first
step and every --eval-steps steps with TatBLiMPCallback, logs to wandb (offline unless WANDB_MODE
says otherwise), then prints the per-phenomenon table and writes a PNG of the acc_norm curves.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shlex
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer, TrainingArguments

from tatblimp_callback import TatBLiMPCallback
from tatblimp_callback.results.curves import plot_curves


class AboveProgressBars(logging.Handler):
    """Log lines written with ``tqdm.write``: above the Trainer's progress bar, on a line of their own (a regression
    alert written straight to stderr was glued onto the bar's line)."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def log_above_progress_bars() -> None:
    """The library's warnings (``tatblimp: REGRESSION: ...``) through ``AboveProgressBars``, as they read otherwise."""
    package = logging.getLogger("tatblimp_callback")
    if not any(isinstance(handler, AboveProgressBars) for handler in package.handlers):
        handler = AboveProgressBars(logging.WARNING)
        handler.setFormatter(logging.Formatter("%(message)s"))
        package.addHandler(handler)
        package.propagate = False  # not printed a second time by a root handler


def finish_wandb() -> None:
    """Close the wandb run now, so that its closing lines come before the demo's last lines, not after them."""
    sys.stdout.flush()  # what was printed comes first also where stdout is a pipe (| tee demo.log)
    wandb = sys.modules.get("wandb")  # imported by the Trainer's wandb reporter only when it reports to wandb
    if wandb is not None and wandb.run is not None:
        wandb.finish()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="../shared/tatar-corpus/train.txt", help="one Tatar sentence a line")
    parser.add_argument("--data", default=os.environ.get("TATBLIMP_DATA"), help="TatBLiMP test.jsonl")
    parser.add_argument("--output-dir", default="runs/tiny-tatar")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eval-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-to", default="wandb", help="wandb, tensorboard, none, ...")
    parser.add_argument(
        "--save-steps",
        type=int,
        default=800,
        help="save a checkpoint every this many steps and at the end (for tatblimp explain / sweep / compare; "
        "default 800: checkpoint-800, -1600, -2000, 17 MB each); 0: none",
    )
    parser.add_argument("--resume", metavar="CHECKPOINT", help="resume from this checkpoint of an earlier run (--save-steps)")
    return parser.parse_args()


def train_tokenizer(lines: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE on the corpus, with <s> as BOS (the prefix TatBLiMP scores from) and </s> as EOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def training_blocks(lines: list[str], tokenizer, block_size: int) -> list[dict]:
    """Each sentence as <s> ... </s>, like the scored sentences, concatenated and cut into blocks."""
    stream = []
    for ids in tokenizer(lines, add_special_tokens=False)["input_ids"]:
        stream += [tokenizer.bos_token_id, *ids, tokenizer.eos_token_id]
    return [
        {"input_ids": stream[i : i + block_size], "labels": stream[i : i + block_size]}
        for i in range(0, len(stream) - block_size + 1, block_size)
    ]


def plot_demo_curves(history_file: Path, plot: Path, parameters: int) -> None:
    """The acc_norm curves of the run's history file, every panel with its 95% band: the README's figure is this
    drawing of the demo run whose history is tests/data/demo_history.jsonl."""
    records = [json.loads(line) for line in history_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    title = f"TatBLiMP while a {parameters / 1e6:.1f}M Llama learns Tatar"
    plot_curves(records, plot, metric="acc_norm", title=title)


def next_steps(output: Path, data: str | None) -> list[str]:
    """The lines the demo ends with: how to reach the ``tatblimp`` command of this environment (in its bin folder,
    which is on no one's PATH unless activated), how to point the guides' commands at the benchmark file, and two
    commands to try on this run."""
    bin_dir = Path(sys.executable).parent
    if bin_dir.is_relative_to(Path.cwd()):  # .venv/bin after make demo
        bin_dir = bin_dir.relative_to(Path.cwd())
    tatblimp = shlex.quote(str(bin_dir / "tatblimp"))
    run = shlex.quote(str(output))
    lines = [
        f"next: the guides' commands start with tatblimp, which is in {bin_dir}: "
        f"call {tatblimp} or first `source {shlex.quote(str(bin_dir / 'activate'))}`",
    ]
    if data and os.environ.get("TATBLIMP_DATA") != data:
        lines.append("  the commands without --data read the file named by $TATBLIMP_DATA:")
        lines.append(f"  export TATBLIMP_DATA={shlex.quote(str(Path(data).resolve()))}")
    lines.append(f"  {tatblimp} explain {run}/model --phenomenon quantifiers --worst 2")
    lines.append(f"  {tatblimp} report {run}/tatblimp_history.jsonl --output {run}/report.html --model {run}/model")
    return lines


def main() -> None:
    args = parse_args()
    log_above_progress_bars()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_PROJECT", "tatblimp-tiny-tatar")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)

    lines = [line for line in Path(args.corpus).read_text(encoding="utf-8").splitlines() if line.strip()]
    tokenizer = train_tokenizer(lines, args.vocab_size)
    blocks = training_blocks(lines, tokenizer, args.block_size)
    print(f"corpus: {len(lines)} lines, {len(blocks) * args.block_size} tokens in {len(blocks)} blocks")

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")

    training_args = TrainingArguments(
        output_dir=str(output),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=100,
        weight_decay=0.01,
        logging_steps=25,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=args.report_to,
        run_name="tiny-tatar",
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=blocks, processing_class=tokenizer)
    callback = TatBLiMPCallback.attach(trainer, eval_steps=args.eval_steps, data=args.data)

    start = time.time()
    trainer.train(resume_from_checkpoint=args.resume)
    minutes = (time.time() - start) / 60

    results = callback.last_results
    if results is None:
        raise SystemExit(f"TatBLiMP scoring failed {callback.failures} times; see the log above")
    print()
    print(results.format_table())
    print(
        f"\ntrained {args.steps} steps in {minutes:.1f} min; {len(callback.history)} evaluations, "
        f"{sum(h['tatblimp/eval_seconds'] for h in callback.history):.1f} s of scoring in all"
    )
    trainer.save_model(str(output / "model"))
    (output / "tatblimp_results.json").write_text(json.dumps(results.to_dict(), indent=1, ensure_ascii=False))
    plot = output / "tatblimp_acc_norm.png"
    plot_demo_curves(output / "tatblimp_history.jsonl", plot, sum(p.numel() for p in model.parameters()))
    print(
        f"wrote {plot}, {output / 'tatblimp_results.json'}, {output / 'tatblimp_history.jsonl'} (one line per evaluation)"
        f" and the model in {output / 'model'}"
    )
    finish_wandb()
    print("\n" + "\n".join(next_steps(output, args.data)))


if __name__ == "__main__":
    main()
