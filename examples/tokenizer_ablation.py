"""A tokenizer ablation on a CPU: the same tiny Llama trained with SentencePiece vocabularies of different sizes.

    python examples/tokenizer_ablation.py --corpus ../shared/tatar-corpus/train.txt \\
        --data ../shared/tatblimp/test.jsonl --vocab-sizes 1000,4000,8000 --steps 300

For each vocabulary size it trains a SentencePiece unigram model on the corpus, a tiny Llama on
the raw sentencepiece ids with the Hugging Face Trainer (saving a checkpoint every --save-steps),
then scores every checkpoint with ``tatblimp sweep``'s Python API, passing the ``.model`` file so
the benchmark is scored with exactly the ids the model was trained on. It ends with the compare
table (printed, and as Markdown) and a plot of the acc_norm curves of all runs, and ``by_edit.md``: how each
vocabulary cuts the benchmark's edits (``tatblimp tokenizers``) and each run's acc and acc_norm split by edit
alignment and by the length confound's sign, with 95% intervals and Fisher's test, and the acquisition step of
its aligned and unaligned pairs.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from tatblimp_callback.commands.compare import format_markdown, format_text, load_runs, plot_comparison
from tatblimp_callback.commands.outputs import check_output_file
from tatblimp_callback.commands.sweep import SweepOptions, sweep
from tatblimp_callback.commands.tokenizers import format_tokenizer_table, tokenizer_figures
from tatblimp_callback.reading.data import BenchmarkError, load_benchmark
from tatblimp_callback.reading.option_types import natural_int, positive_int
from tatblimp_callback.results.curves import require_matplotlib
from tatblimp_callback.results.edit_outcomes import format_runs_by_edit, runs_by_edit

# torch, transformers and sentencepiece are imported where they are used: every input is checked first, in a second,
# so that a mistyped path fails before the first model trains, not after it.


def vocab_sizes(text: str) -> list[int]:
    """--vocab-sizes: comma-separated whole numbers of at least 100."""
    try:
        sizes = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated whole numbers, got {text!r}") from None
    if any(size < 100 for size in sizes):
        raise argparse.ArgumentTypeError(f"every size must be at least 100 (SentencePiece's smallest useful), got {text}")
    return sizes


PROG = "tokenizer_ablation.py"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="../shared/tatar-corpus/train.txt", help="one Tatar sentence a line")
    parser.add_argument("--data", default=os.environ.get("TATBLIMP_DATA"), help="TatBLiMP test.jsonl")
    parser.add_argument("--output-dir", default="runs/tokenizer-ablation")
    parser.add_argument("--vocab-sizes", type=vocab_sizes, default="1000,4000,8000", help="comma-separated vocabulary sizes")
    parser.add_argument("--lines", type=natural_int, default=0, help="use only the first N corpus lines (0: all)")
    parser.add_argument("--steps", type=positive_int, default=300, help="optimizer steps per model")
    parser.add_argument("--save-steps", type=natural_int, default=0, help="checkpoint every N steps (default: steps / 5)")
    parser.add_argument("--block-size", type=positive_int, default=128)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--hidden", type=positive_int, default=64, help="model width (a multiple of the 4 heads)")
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--threads", type=natural_int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--seed", type=natural_int, default=0)
    return parser.parse_args()


def train_sentencepiece(lines: list[str], vocab_size: int, prefix: Path) -> Path:
    """A unigram model with <unk>=0, <s>=1 (the prefix TatBLiMP scores from), </s>=2."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,  # a small corpus cannot fill a large vocabulary: take what it gives
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def training_blocks(lines: list[str], tokenizer, block_size: int) -> list[dict]:
    """Each sentence as <s> ids </s>, concatenated and cut into blocks of raw sentencepiece ids."""
    import torch

    stream = []
    for ids in tokenizer.encode_batch(lines):
        stream += [tokenizer.bos_token_id, *ids, tokenizer.eos_token_id]
    blocks = [torch.tensor(stream[i : i + block_size]) for i in range(0, len(stream) - block_size + 1, block_size)]
    return [{"input_ids": block, "labels": block} for block in blocks]


def train_run(lines: list[str], vocab_size: int, args: argparse.Namespace, out: Path) -> tuple[Path, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from tatblimp_callback import SentencePieceTokenizer

    run_dir = out / f"vocab-{vocab_size}"
    run_dir.mkdir(parents=True, exist_ok=True)
    model_file = train_sentencepiece(lines, vocab_size, run_dir / "spm")
    tokenizer = SentencePieceTokenizer(model_file)
    dataset = training_blocks(lines, tokenizer, args.block_size)
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,  # benchmark sentences are longer than a block with a small vocabulary
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    training = TrainingArguments(
        output_dir=str(run_dir),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=3e-3,
        warmup_steps=max(1, args.steps // 20),
        lr_scheduler_type="cosine",
        save_strategy="steps",
        save_steps=args.save_steps or max(1, args.steps // 5),
        save_only_model=True,
        logging_steps=max(1, args.steps // 10),
        report_to=[],
        use_cpu=True,
        seed=args.seed,
        disable_tqdm=True,
    )
    start = time.perf_counter()
    Trainer(model=LlamaForCausalLM(config), args=training, train_dataset=dataset).train()
    print(
        f"vocab {vocab_size} ({len(tokenizer)} pieces): {len(dataset)} blocks, trained {args.steps} steps in {time.perf_counter() - start:.0f} s"
    )
    return run_dir, model_file


def checked_inputs(args: argparse.Namespace):
    """The corpus lines and the benchmark, every input read and every output folder tried before any training;
    SystemExit with one line, as the ``tatblimp`` command fails, when one is wrong."""
    if args.hidden % 4:
        raise SystemExit(f"{PROG}: error: --hidden {args.hidden}: not a multiple of the 4 attention heads")
    try:
        benchmark = load_benchmark(args.data)  # sweep reads it so too: not a modified file
    except BenchmarkError as err:
        raise SystemExit(f"{PROG}: error: {getattr(err, 'command_line', None) or str(err).splitlines()[0]}") from None
    try:
        text = Path(args.corpus).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        why = getattr(err, "strerror", None) or err
        raise SystemExit(f"{PROG}: error: --corpus {args.corpus}: cannot read it ({why})") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = lines[: args.lines] if args.lines else lines
    if not lines:
        raise SystemExit(f"{PROG}: error: --corpus {args.corpus}: no sentences in it")
    try:
        check_output_file(Path(args.output_dir) / "ablation.md", "--output-dir")
        require_matplotlib()  # the plot at the end
    except (ValueError, ImportError) as err:
        raise SystemExit(f"{PROG}: error: {err}") from None
    return lines, benchmark


def main() -> None:
    args = parse_args()
    lines, benchmark = checked_inputs(args)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.output_dir)
    results, model_files = [], []
    for vocab_size in args.vocab_sizes:
        run_dir, model_file = train_run(lines, vocab_size, args, out)
        # Score with the raw .model file: the ids the model was trained on.
        report = sweep(run_dir, SweepOptions(data=args.data, tokenizer=str(model_file), device="cpu"))
        print(f"vocab {vocab_size}: {len(report.scored)} checkpoints scored into {report.results_path}")
        results.append(report.results_path)
        model_files.append(model_file)

    from tatblimp_callback import SentencePieceTokenizer

    runs = load_runs(results)
    print()
    print(format_text(runs))
    (out / "ablation.md").write_text(format_markdown(runs), encoding="utf-8")
    plot_comparison(runs, out / "ablation.png")
    pairs = list(benchmark.pairs)
    cuts = [format_tokenizer_table(tokenizer_figures(SentencePieceTokenizer(f), pairs)) for f in model_files]
    by_edit = "## How each vocabulary cuts the edit\n\n" + "".join(f"```text\n{c}\n```\n\n" for c in cuts)
    by_edit += "## Outcomes by how the tokenizer cut the edit\n\n" + format_runs_by_edit(runs_by_edit(runs))
    (out / "by_edit.md").write_text(by_edit, encoding="utf-8")
    print(f"\nwrote {out / 'ablation.md'}, {out / 'ablation.png'} and {out / 'by_edit.md'}")


if __name__ == "__main__":
    main()
