"""``tatblimp explain MODEL``: where in the sentence a model prefers the wrong one, token by token.

    tatblimp explain MODEL --pair 313 [--pair 17 ...]
    tatblimp explain MODEL --phenomenon binding --worst 5

Each pair is shown as its two sentences aligned one above the other, token by token, with each
token's surprisal in bits (-log2 p(token | earlier tokens)); the edit (the tokens between the
longest common token prefix and suffix, see ``token_results``) is bracketed, and the margin is
split into its parts before, at and after the edit. In a terminal the edit and high surprisals are
coloured; piped to a file or another program it is plain text. "Worst" means the lowest
byte-normalised margin (the acc_norm criterion), most negative first.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..reading.data import Benchmark, did_you_mean
from ..reading.option_types import natural_int, positive_int

if TYPE_CHECKING:  # torch comes with them: `tatblimp explain --help` does without
    from ..results.metrics import PairResult
    from ..results.token_results import PairTokens

LN2 = math.log(2)
PROGRESS_PART, PROGRESS_PARTS = 32, 20  # with a progress bar: parts of 32 pairs or more, 20 at most
RESET, BOLD, EDIT, HIGH, MEDIUM = "\033[0m", "\033[1m", "\033[30;43m", "\033[31m", "\033[33m"


def score_pairs(
    model, tokenizer, benchmark: Benchmark, indices: Sequence[int], progress: bool = False, **options
) -> dict[int, tuple[PairResult, PairTokens]]:
    """Score only the pairs ``indices`` of ``benchmark`` with their token-level results.

    Args:
        model: a causal LM.
        tokenizer: its tokenizer (decodes the token texts too).
        benchmark: the benchmark the indices refer to (file order).
        indices: pair indices to score.
        progress: a progress bar on stderr, the pairs scored in parts of ``PROGRESS_PART`` pairs or more (the
            head method timed, and the weights labelled, once, by the first part). Without it, one part.
        options: ``Evaluator`` options (``prefix_token_id``, ``memory_budget``, ``truncate``).

    Returns:
        pair index -> (its ``PairResult``, its ``PairTokens``).
    """
    from ..evaluation import Evaluator

    indices = list(dict.fromkeys(indices))
    if not indices:
        return {}
    size = max(PROGRESS_PART, -(-len(indices) // PROGRESS_PARTS)) if progress else len(indices)
    parts = [indices[start : start + size] for start in range(0, len(indices), size)]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(indices), desc="tatblimp scoring pairs", unit="pair", file=sys.stderr)
    scored, weights = {}, None
    try:
        for part in parts:
            subset = benchmark.pick(part)
            results = Evaluator(tokenizer, subset, include_tokens=True, allow_modified=True, **options)(model, weights=weights)
            scored.update((index, (results.pairs[k], results.pair_tokens[k])) for k, index in enumerate(part))
            weights = results.run_info.get("weights")
            if results.run_info.get("head_method") and not options.get("head_method"):
                options = {**options, "head_method": results.run_info["head_method"]}  # timed once
            if bar is not None:
                bar.update(len(part))
    finally:
        if bar is not None:
            bar.close()
    return {index: scored[index] for index in indices}


def normalised_margin(pair: PairResult) -> float:
    """logP(good)/bytes - logP(bad)/bytes: negative when the pair fails acc_norm."""
    return pair.good_logprob / pair.good_bytes - pair.bad_logprob / pair.bad_bytes


def display_piece(text: str) -> str:
    """A token's text for a terminal column: a leading space as "▁", a token holding part of a character as "·"."""
    if not text:
        return "·"
    return ("▁" + text[1:] if text.startswith(" ") else text).replace("\n", "⏎")


def bits(logprob: float) -> str:
    return f"{-logprob / LN2:.1f}"


def _paint(text: str, code: str, color: bool) -> str:
    return f"{code}{text}{RESET}" if color and code else text


def _bits_code(logprob: float) -> str:
    value = -logprob / LN2
    return HIGH if value >= 12 else MEDIUM if value >= 6 else ""


def format_pair(index: int, pair: PairResult, tokens: PairTokens, *, color: bool = False, width: int = 100) -> str:
    """The two sentences aligned token by token with surprisal in bits, the edit in brackets, wrapped to ``width``."""
    (gs, ge), (bs, be) = tokens.edit["good"], tokens.edit["bad"]
    good_lp, bad_lp = tokens.good_token_logprobs, tokens.bad_token_logprobs
    good_tx = tokens.good_tokens_text or [str(i) for i in range(len(good_lp))]
    bad_tx = tokens.bad_tokens_text or [str(i) for i in range(len(bad_lp))]
    # A column is (good cells, bad cells, is_edit); shared tokens get one column each, the edit one block.
    columns: list[tuple[list[tuple[str, float]], list[tuple[str, float]], bool]] = []
    for g in range(gs):
        columns.append(([(good_tx[g], good_lp[g])], [(bad_tx[g], bad_lp[g])], False))
    columns.append((list(zip(good_tx[gs:ge], good_lp[gs:ge])), list(zip(bad_tx[bs:be], bad_lp[bs:be])), True))
    for g, b in zip(range(ge, len(good_lp)), range(be, len(bad_lp))):
        columns.append(([(good_tx[g], good_lp[g])], [(bad_tx[b], bad_lp[b])], False))

    def cells(items: list[tuple[str, float]]) -> tuple[list[str], list[str], list[str], list[int]]:
        texts = [display_piece(t) for t, _ in items]
        values = [bits(lp) for _, lp in items]
        widths = [max(len(t), len(v)) for t, v in zip(texts, values)]
        return texts, values, [_bits_code(lp) for _, lp in items], widths

    blocks = []  # each: four (plain, painted) strings: good text, good bits, bad text, bad bits
    for good_items, bad_items, is_edit in columns:
        lines = []
        for items in (good_items, bad_items):
            texts, values, codes, widths = cells(items)
            text_plain = " ".join(t.ljust(w) for t, w in zip(texts, widths))
            text_paint = " ".join(_paint(t.ljust(w), BOLD if is_edit else "", color) for t, w in zip(texts, widths))
            bits_plain = " ".join(v.ljust(w) for v, w in zip(values, widths))
            bits_paint = " ".join(_paint(v.ljust(w), c, color) for v, c, w in zip(values, codes, widths))
            lines += [(text_plain, text_paint), (bits_plain, bits_paint)]
        block_width = max(len(plain) for plain, _ in lines)
        padded = [(plain.ljust(block_width), paint + " " * (block_width - len(plain))) for plain, paint in lines]
        if is_edit:
            padded = [("[" + plain + "]", _paint("[", EDIT, color) + paint + _paint("]", EDIT, color)) for plain, paint in padded]
        blocks.append(padded)

    before, at, after = tokens.margin_parts()
    passed = "passed" if pair.passed_norm else "FAILED"
    header = [
        f"pair {index}  {pair.phenomenon}" + (f" / {pair.subtype}" if pair.subtype else ""),
        f"acc_norm {passed} (margin per byte {normalised_margin(pair):+.4f} nats), acc {'passed' if pair.passed else 'FAILED'}",
        f"margin {pair.good_logprob - pair.bad_logprob:+.3f} nats = before the edit {before:+.3f} + at the edit {at:+.3f} "
        f"+ after it {after:+.3f}",
        *edit_lines(pair, tokens),
        "(surprisal in bits under each token; [ ]: the edit)",
    ]
    labels = ("good", "bits", "bad", "bits")
    # Wrapped at spaces to ``width``, so that a terminal of that width does not break a word in two.
    header = [textwrap.wrap(line, width, subsequent_indent="  ", break_long_words=False) for line in header]
    out = [*(_paint(line, BOLD, color) for line in header[0]), *(line for lines in header[1:] for line in lines)]
    row: list[list[tuple[str, str]]] = []
    used = 6

    def flush() -> None:
        for line, label in enumerate(labels):
            out.append(f"{label:<5} " + " ".join(block[line][1] for block in row).rstrip())
        out.append("")

    for block in blocks:
        block_width = len(block[0][0]) + 1
        if row and used + block_width > width:
            flush()
            row, used = [], 6
        row.append(block)
        used += block_width
    if row:
        flush()
    return "\n".join(out).rstrip() + "\n"


def edit_lines(pair: PairResult, tokens: PairTokens) -> list[str]:
    """The edit in characters and its critical region (``reading/edit.py``), with the region's word-level surprisal."""
    if not pair.good and not pair.bad:  # a cache written before the sentences were kept
        return []
    from ..reading.edit import find_edit

    edit = find_edit(pair.good, pair.bad)
    good, bad = pair.good[slice(*edit.good)], pair.bad[slice(*edit.bad)]
    lines = [
        f"edit: {good!r} -> {bad!r} (characters {edit.good[0]}-{edit.good[1]} / {edit.bad[0]}-{edit.bad[1]}); "
        f"critical region: {pair.good[slice(*edit.good_region)]!r} / {pair.bad[slice(*edit.bad_region)]!r}"
    ]
    bits = tokens.critical_region_bits
    if bits and bits["good"] is not None and bits["bad"] is not None:
        corrected = "word-start corrected" if bits["word_marks"] in ("start", "continuation") else "no correction needed"
        lines.append(
            f"critical-region surprisal: good {bits['good']:.2f} bits, bad {bits['bad']:.2f} bits, "
            f"bad - good {bits['bad'] - bits['good']:+.2f} ({corrected}: {bits['word_marks']} marks)"
        )
    return lines


def add_explain_parser(commands) -> None:
    """Add ``tatblimp explain`` to the CLI's sub-commands."""
    from .loading import add_model_arguments

    parser = commands.add_parser("explain", help="show pairs token by token: surprisal in bits, the edit marked")
    parser.add_argument("model", help="a folder saved with save_pretrained, or a Hub model id")
    parser.add_argument(
        "--pair", type=natural_int, action="append", help="pair index in the benchmark file (0-based; repeatable)"
    )
    parser.add_argument("--phenomenon", help="with --worst: the phenomenon whose worst pairs to show")
    parser.add_argument("--worst", type=positive_int, help="show the K pairs of --phenomenon with the lowest per-byte margin")
    add_model_arguments(parser)
    parser.set_defaults(run=run_explain)


def choose_pairs(args: argparse.Namespace, benchmark: Benchmark) -> tuple[list[int], bool]:
    """(pair indices to score, whether to keep only the worst ``args.worst`` of them)."""
    if args.pair and (args.phenomenon or args.worst):
        raise ValueError("give either --pair N or --phenomenon NAME --worst K, not both")
    if args.pair:
        bad = [n for n in args.pair if not 0 <= n < len(benchmark)]
        if bad:
            raise ValueError(f"--pair {bad[0]}: the benchmark has pairs 0 to {len(benchmark) - 1}")
        return args.pair, False
    if not args.phenomenon or not args.worst:
        raise ValueError("name the pairs: --pair N, or --phenomenon NAME --worst K")
    if args.phenomenon not in benchmark.phenomena:
        hint = did_you_mean(args.phenomenon, benchmark.phenomena)
        raise ValueError(f"--phenomenon {args.phenomenon}: no such phenomenon{hint} ({', '.join(benchmark.phenomena)})")
    return [i for i, p in enumerate(benchmark.pairs) if p.phenomenon == args.phenomenon], True


def run_explain(args: argparse.Namespace, stream: Any = None) -> None:
    from ..reading.data import load_benchmark
    from .loading import load_from_args

    stream = stream or sys.stdout
    benchmark = load_benchmark(args.data, allow_modified=args.allow_modified)
    indices, worst = choose_pairs(args, benchmark)
    _, tokenizer, model = load_from_args(args, args.model)  # every loader option of score (device map, ...)
    scored = score_pairs(
        model,
        tokenizer,
        benchmark,
        indices,
        prefix_token_id=args.prefix_token_id,
        memory_budget=args.memory_budget_mb * 2**20 if args.memory_budget_mb else None,
        truncate=args.truncate,
        head_method=args.head_method,
        row_length=args.row_length,
        precision=getattr(args, "precision", None) or "auto",
    )
    if worst:
        indices = sorted(scored, key=lambda i: normalised_margin(scored[i][0]))[: args.worst]
    color = stream.isatty()
    width = shutil.get_terminal_size((100, 24)).columns if color else 100
    for index in indices:
        print(format_pair(index, *scored[index], color=color, width=width), file=stream)
