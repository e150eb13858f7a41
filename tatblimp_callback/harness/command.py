"""``tatblimp lm-eval-path`` and ``tatblimp lm-eval``: the harness tasks' folder, and the harness's own command line
with ``--model tatblimp`` registered and the TatBLiMP tasks included.

    tatblimp lm-eval-path                         # for: lm_eval --include_path "$(tatblimp lm-eval-path)" ...
    tatblimp lm-eval --model tatblimp --model_args pretrained=MODEL --tasks tatblimp,blimp

Building these parsers imports neither torch nor lm_eval; ``lm-eval`` imports them when it runs.
"""

from __future__ import annotations

import argparse
import sys


def add_harness_parsers(commands) -> None:
    """Add ``lm-eval-path`` and ``lm-eval`` to the ``tatblimp`` subcommands."""
    path = commands.add_parser("lm-eval-path", help="print the folder of the TatBLiMP lm-eval tasks (for --include_path)")
    path.set_defaults(run=print_task_path)
    run = commands.add_parser(
        "lm-eval",
        help="run lm-evaluation-harness with --model tatblimp registered and the TatBLiMP tasks included",
        description="Every argument goes to lm_eval's command line (lm_eval --help lists them); --include_path "
        "defaults to the TatBLiMP tasks' folder, and --model tatblimp is the fused engine.",
    )
    run.add_argument("harness_args", nargs=argparse.REMAINDER, help="lm_eval's arguments, as `lm_eval` takes them")
    run.set_defaults(run=run_harness)


def print_task_path(args: argparse.Namespace) -> None:
    from . import task_path

    print(task_path())


def run_harness(args: argparse.Namespace) -> None:
    """lm_eval's command line on ``args.harness_args``, with the model registered and the tasks' folder included."""
    from . import register, task_path

    register()
    from lm_eval.__main__ import cli_evaluate

    harness_args = list(args.harness_args)
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in harness_args):
        harness_args += ["--include_path", str(task_path())]
    sys.argv = ["lm_eval", *harness_args]
    cli_evaluate()
