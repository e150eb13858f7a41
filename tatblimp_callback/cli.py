"""The ``tatblimp`` command.

    tatblimp score MODEL_DIR [--data PATH] [--device DEV] [--dtype DTYPE] [--output results.json]

A failure exits with status 1 and a one-line message on stderr, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that loads and scores a model."""
    parser.add_argument("--data", help="benchmark JSONL (default: $TATBLIMP_DATA, else the Hub dataset ilchats/TatBLiMP)")
    parser.add_argument("--allow-modified", action="store_true", help="accept a file that is not the official release")
    parser.add_argument("--tokenizer", help="tokenizer folder or raw SentencePiece .model (default: the model's)")
    parser.add_argument("--prefix-token-id", type=int, help="token put before each sentence (default: BOS, else EOS)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: cuda if available)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weights dtype (default: float32)")
    parser.add_argument("--memory-budget-mb", type=int, help="extra memory one evaluation may use")
    parser.add_argument("--truncate", action="store_true", help="cut sentences longer than the model's context")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tatblimp", description="Score causal LMs on TatBLiMP minimal pairs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the scorer decides")
    commands = parser.add_subparsers(dest="command", required=True)

    score = commands.add_parser("score", help="score one model and print the per-phenomenon table")
    score.add_argument("model", help="a folder saved with save_pretrained, or a Hub model id")
    add_model_arguments(score)
    score.add_argument("--output", help="write the results as JSON here")
    score.set_defaults(run=run_score)
    return parser


def load_model(model_dir: str, device: str | None, dtype: str):
    """A causal LM in eval mode on the device."""
    import torch
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    return model.to(device).eval()


def evaluate_from_args(args: argparse.Namespace, model_dir: str):
    """Load the model named by ``model_dir`` and score it with the options in ``args``."""
    from .evaluation import evaluate
    from .tokenization import load_tokenizer

    model = load_model(model_dir, args.device, args.dtype)
    tokenizer = load_tokenizer(args.tokenizer or model_dir)
    return evaluate(
        model,
        tokenizer,
        args.data,
        prefix_token_id=args.prefix_token_id,
        allow_modified=args.allow_modified,
        memory_budget=args.memory_budget_mb * 2**20 if args.memory_budget_mb else None,
        truncate=args.truncate,
    )


def write_json(path: str, payload) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def run_score(args: argparse.Namespace) -> None:
    results = evaluate_from_args(args, args.model)
    results.extra["model"] = args.model
    print(results.format_table())
    if args.output:
        write_json(args.output, results.to_dict())
        print(f"wrote {args.output}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        args.run(args)
    except KeyboardInterrupt:
        print("tatblimp: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # one line for the user; --verbose shows the traceback
        if args.verbose:
            logging.exception("tatblimp %s failed", args.command)
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"tatblimp {args.command}: error: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
