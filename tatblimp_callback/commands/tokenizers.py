"""``tatblimp tokenizers TOKENIZER [TOKENIZER ...]``: how each tokenizer cuts the benchmark's edits, no model needed.

    tatblimp tokenizers runs/bpe-4k ../shared/tokenizers/kypchak_unigram_48k.model --output tokenizers.json

Per tokenizer, overall and per phenomenon (the figures of ``tokenized/edit_tokens.py``): tokens per byte, tokens
inside the edit (good, bad), the share of pairs whose edit is aligned with token boundaries in both sentences,
the share whose critical region is one token, the token-count difference bad minus good (raw acc's length
confound), pairs with identical ids, and unknown or byte-fallback tokens at the edit. A tokenizer is what
``score --tokenizer`` takes: a folder, a Hub id or a raw SentencePiece ``.model`` file; the ids are the ones
scored (special tokens stripped; the prefix token is not counted). Nothing here imports torch or transformers:
folders and Hub ids are read from their ``tokenizer.json`` (``tokenized/json_tokenizer.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["add_tokenizers_parser", "format_tokenizer_table", "load_light_tokenizer", "tokenizer_figures"]

HUB_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
COLUMNS = (  # (heading, key, format)
    ("tok/byte", "tokens_per_byte", "{:.3f}"),
    ("edit good", "mean_edit_tokens_good", "{:.2f}"),
    ("edit bad", "mean_edit_tokens_bad", "{:.2f}"),
    ("aligned", "edit_aligned", "{:.1%}"),
    ("1-token", "region_one_token", "{:.1%}"),
    ("bad-good", "mean_token_difference", "{:+.2f}"),
    ("bad>good", "bad_longer", "{:.1%}"),
    ("same ids", "identical_ids", "{}"),
    ("unk/byte", "flagged_pairs", "{}"),
)


def load_light_tokenizer(name: str) -> Any:
    """A raw ``SentencePieceTokenizer`` for a ``.model`` file, else a ``JsonTokenizer`` of a folder or Hub id."""
    from ..tokenized.json_tokenizer import JsonTokenizer
    from ..tokenized.tokenization import SentencePieceTokenizer
    from .loading import check_folder_or_hub_id

    path = Path(name)
    if path.suffix == ".model":
        if not path.is_file():
            raise FileNotFoundError(f"{name}: no such SentencePiece model file")
        return SentencePieceTokenizer(path)
    if path.is_file():
        raise FileNotFoundError(f"{name}: a file; give the tokenizer's folder, or a SentencePiece .model file")
    folder = check_folder_or_hub_id(name, "tokenizer")
    if folder is None:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(name, allow_patterns=HUB_FILES))
    return JsonTokenizer.from_folder(folder, name=name)


def tokenizer_figures(tokenizer: Any, pairs: list[Any], include_pairs: bool = False) -> dict[str, Any]:
    """One tokenizer's figures on ``pairs`` (``Pair``s): overall, ``phenomena``, and with ``include_pairs`` ``pairs``."""
    from dataclasses import asdict

    from ..reading.edit import find_edit
    from ..tokenized.edit_tokens import edit_tokens_of_pairs, summarise_edit_tokens
    from ..tokenized.tokenization import tokenizer_name

    facts = edit_tokens_of_pairs(tokenizer, pairs)
    byte_lengths = [len(p.good.encode("utf-8")) + len(p.bad.encode("utf-8")) for p in pairs]
    figures = {"tokenizer": tokenizer_name(tokenizer), "vocabulary": len(tokenizer)}
    figures.update(summarise_edit_tokens(facts, [p.phenomenon for p in pairs], byte_lengths))
    if include_pairs:
        figures["pairs"] = [
            {"index": i, "phenomenon": p.phenomenon, **find_edit(p.good, p.bad).to_dict(p.good, p.bad), **asdict(f)}
            for i, (p, f) in enumerate(zip(pairs, facts))
        ]
    return figures


def format_tokenizer_table(figures: dict[str, Any]) -> str:
    """One tokenizer's figures as a plain-text table: per phenomenon, then overall."""
    rows = [*figures["phenomena"].items(), ("overall", figures)]
    width = max(len(name) for name, _ in rows)
    head = f"{'':<{width}}  {'n':>5}  " + "  ".join(f"{h:>9}" for h, _, _ in COLUMNS)
    lines = [f"{figures['tokenizer']} ({figures['vocabulary']:,} tokens)", head]
    for name, row in rows:
        cells = ["-" if isinstance(row[k], float) and math.isnan(row[k]) else f.format(row[k]) for _, k, f in COLUMNS]
        lines.append(f"{name:<{width}}  {row['n']:>5}  " + "  ".join(f"{c:>9}" for c in cells))
    return "\n".join(lines)


def add_tokenizers_parser(commands) -> None:
    """Add ``tatblimp tokenizers`` to the CLI's sub-commands."""
    from ..reading.suites import add_suite_arguments

    parser = commands.add_parser("tokenizers", help="how tokenizers cut each pair's edit (no model needed)")
    parser.add_argument("tokenizers", nargs="+", metavar="TOKENIZER", help="a tokenizer folder, Hub id or SentencePiece .model")
    parser.add_argument("--data", help="benchmark JSONL (default: $TATBLIMP_DATA, else the Hub dataset ilchats/TatBLiMP)")
    parser.add_argument("--allow-modified", action="store_true", help="accept a file that is not the official release")
    parser.add_argument("--output", help="write the figures as JSON here (missing folders are created)")
    parser.add_argument("--include-pairs", action="store_true", help="with --output: each pair's edit and figures too")
    add_suite_arguments(parser)
    parser.set_defaults(run=run_tokenizers, usage_problem=_usage_problem)


def _usage_problem(args: argparse.Namespace) -> str | None:
    if args.include_pairs and not args.output:  # the terminal shows totals only: the pairs would go nowhere
        return "--include-pairs goes with --output (the per-pair figures are written to that JSON file only)"
    return None


def run_tokenizers(args: argparse.Namespace) -> None:
    from ..reading.data import load_benchmark
    from ..reading.suites import suites_from_args
    from .outputs import check_output_file, say, write_text

    check_output_file(args.output, "--output", [args.data or os.environ.get("TATBLIMP_DATA"), *args.suite])
    suites = suites_from_args(args)
    sets = {} if args.suites_only else {"tatblimp": list(load_benchmark(args.data, allow_modified=args.allow_modified).pairs)}
    sets.update({name: list(suite.pairs) for name, suite in suites.items()})
    tokenizers = [load_light_tokenizer(name) for name in args.tokenizers]  # every name checked before the work
    results = {
        name: [tokenizer_figures(tokenizer, pairs, args.include_pairs) for tokenizer in tokenizers]
        for name, pairs in sets.items()
    }
    if args.output:
        write_text(args.output, json.dumps({"suites": results}, ensure_ascii=False, indent=1) + "\n")
    for name, figures in results.items():
        for one in figures:
            say(f"{name}: " + format_tokenizer_table(one) + "\n")
