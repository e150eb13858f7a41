"""``tatblimp report``, the command: its options, ``--steps`` read on each sweep's axis, and ``--model``'s scoring of the
pairs the page lists (``report.py`` builds the page).

``--steps A B`` takes steps, or in a revision series placed by tokens or words, counts as the names write them
(``4B``, ``10M``) or the revisions' names (``step1000-tokens4B``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..reading.option_types import accuracy, natural_int
from ..results.curves import DEFAULT_THRESHOLD
from ..results.positions import find_step
from ..results.runs import Run, load_runs
from ..results.scored_pairs import scored_benchmark
from .report import check_steps, report_pairs, write_report


def resolve_steps(runs: Sequence[Run], texts: Sequence[str] | None) -> tuple[int, int] | None:
    """``--steps``' two values as the sweeps' steps: a number (``1200``, ``4B``) as it is, a revision's name as the
    step of the first sweep's record that names it.

    Raises:
        ValueError: a value that is neither a number nor a revision of the sweeps, named with the revisions there are.
    """
    if not texts:
        return None
    records = [record for run in runs if run.is_sweep for record in run.records_up_to_step]
    steps = []
    for text in texts:
        number = find_step(records, text)
        if number is None:
            known = list(dict.fromkeys(r["revision"] for r in records if r.get("revision")))
            some = ", ".join(known[:8]) + (" ..." if len(known) > 8 else "")
            raise ValueError(
                f"--steps {text!r}: not a step, a count such as 4B, nor the name of a revision"
                + (f" ({some})" if known else " (these results name none)")
            )
        steps.append(number)
    return steps[0], steps[1]


def _step_text(text: str) -> str:
    """A ``--steps`` value as given (a step, a count, a revision name); a number must be a step (at least 0)."""
    if text.lstrip("-").isdigit():
        natural_int(text)
    return text


def add_report_parser(commands) -> None:
    """Add ``tatblimp report`` to the CLI's sub-commands."""
    from ..commands.loading import add_model_arguments

    parser = commands.add_parser("report", help="write one self-contained HTML report of runs (curves, heatmap, flips)")
    parser.add_argument("results", nargs="+", help="sweep / history JSONL files or score --output JSON files (first: baseline)")
    parser.add_argument("--output", required=True, help="the HTML file to write")
    parser.add_argument(
        "--steps",
        type=_step_text,
        nargs=2,
        metavar=("A", "B"),
        help="test these two steps of each sweep (default: first, last); of a revision series placed by tokens or "
        "words, these counts (4B, 10M) or revision names",
    )
    parser.add_argument(
        "--model", help="show the first run's flipped and never-learned pairs token by token, scored by this model"
    )
    parser.add_argument(
        "--threshold", type=accuracy, default=DEFAULT_THRESHOLD, help="acc_norm that counts as acquired (default 0.75)"
    )
    parser.add_argument("--title", default="TatBLiMP report", help="the page title")
    parser.add_argument(
        "--no-paired",
        dest="paired",
        action="store_false",
        help="side by side only: no paired tests between the runs (results of other benchmark files or selections)",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="with --model: no progress bar while it scores"
    )
    add_model_arguments(parser)
    parser.set_defaults(run=run_report)


def run_report(args: argparse.Namespace) -> None:
    from ..commands.loading import model_options_given
    from ..commands.outputs import check_output_file

    check_output_file(args.output, "--output", args.results)  # before the work: a typo must not cost a model load
    if not args.model and (given := model_options_given(args)):
        raise ValueError(f"{', '.join(given)}: options of --model (the model that scores the pairs shown); no --model is given")
    runs = load_runs(args.results)
    steps = resolve_steps(runs, args.steps)
    check_steps(runs, steps)
    details = None
    if args.model:
        from ..commands.explain import score_pairs
        from ..commands.loading import load_from_args, tokenizer_source

        benchmark = scored_benchmark(runs[0].record, args.data)  # the pairs scored: their selection, their mapping
        if benchmark is None:
            source = args.data or runs[0].record.get("benchmark", {}).get("source")
            raise ValueError(
                f"{source}: not the pairs {runs[0].path} was scored on (another file, selection or column mapping); "
                "--model scores the pairs again: pass --data with the file they were scored on"
            )
        pairs = report_pairs(runs, steps)
        tokenizer_source(args.model, args.tokenizer)  # the paths checked, loading nothing: its error, not "loading"
        if args.progress:  # loading a big model takes a while too: said before it starts
            print(f"tatblimp report: loading {args.model} to score the {len(set(pairs))} pairs listed", file=sys.stderr)
        _, tokenizer, model = load_from_args(args, args.model)  # every loader option of score (device map, ...)
        details = score_pairs(
            model,
            tokenizer,
            benchmark,
            pairs,
            progress=args.progress,
            prefix_token_id=args.prefix_token_id,
            truncate=args.truncate,
            head_method=args.head_method,
            row_length=args.row_length,
            precision=getattr(args, "precision", None) or "auto",
        )
    path = write_report(
        args.output,
        runs,
        steps=steps,
        data=args.data,
        details=details,
        threshold=args.threshold,
        title=args.title,
        paired=args.paired,
    )
    print(f"wrote {path}")
