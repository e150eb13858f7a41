"""The ``tatblimp`` command.

    tatblimp score MODEL_DIR [--data PATH] [--device DEV] [--dtype DTYPE] [--output results.json]
    tatblimp score MODEL_DIR --suite blimp=DIR [--suite turblimp=DIR]    (more suites in the same pass; see suites.py)
    tatblimp score MODEL_DIR --protocol forced-choice            (a local chat model; see forced_choice.py)
    tatblimp score --endpoint URL --model-name NAME --protocol forced-choice   (see endpoint.py)
    tatblimp sweep RUN_DIR [--data PATH] [--watch] [--wandb-project P]   (see sweep.py)
    tatblimp compare RESULTS... [--markdown out.md] [--plot out.png]      (see compare.py)
    torchrun --nproc-per-node N -m tatblimp_callback sweep RUN_DIR        (checkpoints shared out: sweep_processes.py)
    torchrun --nproc-per-node N -m tatblimp_callback score MODEL --tp-plan auto
    tatblimp explain MODEL_DIR --pair N | --phenomenon NAME --worst K     (see explain.py)
    tatblimp report RESULTS... --output report.html [--model MODEL_DIR]   (see report.py)
    tatblimp lm-eval-path | lm-eval --model tatblimp --tasks tatblimp ...  (see harness/)

A failure exits with status 1 and a one-line message on stderr, not a traceback; a wrong option or a missing
argument exits with status 2 (argparse's convention), the usage of the subcommand it was given to, and one
error line. Everything that can be checked without the model (paths, options) is checked before it loads;
output files are written before the tables are printed, and a closed stdout (``| head``) is not an error.

``--version`` and ``--help`` import neither torch nor transformers (tests/test_cli_startup.py): the parsers
are built from light modules, and each command imports what it runs when it runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from . import __version__
from .commands.compare import add_compare_parser
from .commands.explain import add_explain_parser
from .commands.loading import add_model_arguments, load_from_args, tokenizer_source
from .commands.outputs import check_output_file, say, silence_stdout, write_text
from .commands.sweep import add_sweep_parser
from .commands.tokenizers import add_tokenizers_parser
from .harness.command import add_harness_parsers
from .reading.option_types import json_object, natural_int, positive_float, positive_int
from .reading.suites import add_suite_arguments, benchmark_and_suites
from .reports.report_command import add_report_parser

VERBOSE_HELP = "log what the scorer decides, and show a failure's traceback"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tatblimp", description="Score causal LMs on TatBLiMP minimal pairs.")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    parser.add_argument("--version", action="version", version=f"tatblimp {__version__}", help="print the version and exit")
    commands = parser.add_subparsers(dest="command", required=True)

    score = commands.add_parser("score", help="score one model and print the per-phenomenon table")
    score.add_argument("model", nargs="?", help="a folder saved with save_pretrained, or a Hub model id (not with --endpoint)")
    add_model_arguments(score)
    score.add_argument(
        "--limit",
        type=positive_int,
        metavar="N",
        help="score only the first N pairs of each phenomenon, of TatBLiMP and of each --suite (a quick run; marked partial "
        "where it leaves pairs out)",
    )
    score.add_argument(
        "--phenomena",
        metavar="A,B",
        help="score only these phenomena, comma-separated (a quick run; marked partial where it leaves pairs out)",
    )
    score.add_argument("--output", help="write the results as JSON here (missing folders are created)")
    score.add_argument("--revision", help="a Hub model's branch, tag or commit (default: main)")
    score.add_argument(
        "--tp-plan",
        choices=("auto",),
        help="under torchrun: split each layer over the processes (transformers' tensor parallelism); process 0 writes",
    )
    score.add_argument(
        "--include-tokens",
        action="store_true",
        help="add each pair's token log-probs, token texts and edit span to pairs[i] of --output (see diagnostics docs)",
    )
    score.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="never replay the forward calls as CUDA graphs (they are captured at a plan's second evaluation only)",
    )
    score.add_argument(
        "--compile", action="store_true", help="torch.compile the scoring forward (about a minute to start on a GPU)"
    )
    add_suite_arguments(score)
    add_forced_choice_arguments(score)
    score.set_defaults(run=run_score)

    add_sweep_parser(commands)
    add_compare_parser(commands)
    add_explain_parser(commands)
    add_report_parser(commands)
    add_tokenizers_parser(commands)
    add_harness_parsers(commands)
    for command in commands.choices.values():  # -v after the command too; SUPPRESS keeps a -v given before it
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


def evaluate_from_args(args: argparse.Namespace, model_dir: str):
    """Load the model named by ``model_dir`` and score it with the options in ``args``."""
    tokenizer_source(model_dir, args.tokenizer)  # checks the paths first, loading nothing (not even torch)
    from .commands.backends import backend_options
    from .evaluation import evaluate
    from .tokenized.tokenization import check_sentencepiece_mismatch

    benchmark, suites = benchmark_and_suites(args)
    source, tokenizer, model = load_from_args(args, model_dir)
    # A folder with a raw tokenizer.model: warn if the converted tokenizer's ids differ from it.
    mismatches = None
    if Path(source).is_dir():
        mismatches = check_sentencepiece_mismatch(source, tokenizer, benchmark.sentences)
    results = evaluate(
        model,
        tokenizer,
        benchmark,
        prefix_token_id=args.prefix_token_id,
        allow_modified=args.allow_modified,
        memory_budget=args.memory_budget_mb * 2**20 if args.memory_budget_mb else None,
        truncate=args.truncate,
        head_method=getattr(args, "head_method", None),
        row_length=getattr(args, "row_length", None),
        cuda_graphs=not getattr(args, "no_cuda_graphs", False),
        compile=getattr(args, "compile", False),
        precision=getattr(args, "precision", None) or "auto",
        suites=suites,
        include_tokens=getattr(args, "include_tokens", False),
        **backend_options(args),
    )
    if mismatches is not None:
        results.run_info["sentencepiece_mismatches"] = mismatches
    return results


def write_json(path: str, payload) -> None:
    write_text(path, json.dumps(payload, indent=1, ensure_ascii=False) + "\n")


def report(results, output: str | None) -> None:
    """Write ``results`` to ``output`` (if given), then print the table."""
    if output:
        write_json(output, results.to_dict())
    say(results.format_table())
    if output:
        say(f"wrote {output}")


def read_option_file(path: str, option: str) -> str:
    """The UTF-8 text of the file an option names; an ``OSError`` naming the option and the file."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise OSError(f"{option} {path}: cannot read ({err.strerror or err})") from None


def run_score(args: argparse.Namespace) -> None:
    if args.protocol == "logprob" and (args.prompt_file or args.system_prompt):
        option = "--prompt-file" if args.prompt_file else "--system-prompt"
        raise ValueError(f"{option}: the forced-choice protocol's; give --protocol forced-choice (log-probs use no prompt)")
    inputs = [args.data or os.environ.get("TATBLIMP_DATA"), *args.suite, args.prompt_file]
    check_output_file(args.output, "--output", [*inputs, args.results])
    check_output_file(args.results, "--results", inputs, appends=True)
    if args.endpoint is None and not args.model and (args.protocol == "forced-choice" or args.model_name):
        args.endpoint = os.environ.get("OPENAI_BASE_URL") or None  # as the openai client does
    given = [option for option, value in (("--results", args.results), ("--extra-body", args.extra_body)) if value]
    if not args.endpoint and (given or args.model_name):
        option = given[0] if given else "--model-name"
        raise ValueError(f"{option}: an option of --endpoint (a served model's answers); no --endpoint is given")
    if args.revision and (args.endpoint or (args.model and Path(args.model).is_dir())):
        where = "--endpoint serves the one model it has" if args.endpoint else f"{args.model} is a local folder, one version"
        raise ValueError(f"--revision {args.revision}: {where}; --revision picks a Hub model's branch, tag or commit")
    if args.endpoint:  # the server runs the model: the options of one loaded here would do nothing
        from .commands.loading import model_options_given

        kept = ("--tokenizer", "--prefix-token-id") if args.protocol == "logprob" else ()  # the ids sent are ours
        ignored = [option for option in model_options_given(args) if option not in kept]
        if ignored:
            raise ValueError(f"{', '.join(ignored)}: options of a model loaded here; an --endpoint's server runs its own")
    if args.endpoint and args.protocol == "logprob":  # a completions endpoint
        from .commands.endpoint_scoring import score_through_endpoint

        results = score_through_endpoint(args)
    elif args.endpoint or args.protocol == "forced-choice":
        return run_forced_choice(args)
    else:
        if not args.model:
            raise ValueError("name a model folder or Hub id to score (or an --endpoint URL with --model-name)")
        results = evaluate_from_args(args, args.model)
        results.run_info["model"] = args.model
        from .engine import distributed

        if args.tp_plan and distributed.world()[0] != 0:
            return  # every process scored the same rows; process 0 reports
    report(results, args.output)
    if results.pair_tokens is not None:
        from .results.token_results import edit_margins, format_edit_margins

        say(format_edit_margins(edit_margins(results.pair_tokens, [p.phenomenon for p in results.pairs])))


def add_forced_choice_arguments(parser: argparse.ArgumentParser) -> None:
    """``score`` options of the forced-choice protocol (local chat model or chat-completions endpoint)."""
    group = parser.add_argument_group("forced choice (chat models, local or behind an OpenAI-compatible endpoint)")
    group.add_argument(
        "--protocol",
        choices=("logprob", "forced-choice"),
        default="logprob",
        help="logprob: logP(good) > logP(bad) (default); forced-choice: the model names the grammatical "
        "one of sentences A and B, both orderings",
    )
    group.add_argument(
        "--prompt-file",
        help="UTF-8 file with the user message, {a} and {b} for the sentences (default: forced_choice.DEFAULT_PROMPT)",
    )
    group.add_argument("--system-prompt", help="a system message before each prompt (default: none)")
    group.add_argument(
        "--endpoint",
        metavar="URL",
        help="an OpenAI-compatible server, e.g. http://localhost:8000/v1: chat completions with --protocol forced-choice, "
        "completions (token ids, echoed log-probs; needs --tokenizer) with logprob (default with --model-name or "
        "--protocol forced-choice and no model folder: $OPENAI_BASE_URL)",
    )
    group.add_argument("--model-name", help="the model field of each endpoint request")
    group.add_argument(
        "--api-key-env",
        default="OPENAI_API_KEY",
        help="environment variable holding the endpoint's API key, if it needs one (default: OPENAI_API_KEY)",
    )
    group.add_argument("--results", help="endpoint: append answers to this JSONL file and skip those already in it")
    group.add_argument("--concurrency", type=positive_int, default=8, help="endpoint: requests at once (default: 8)")
    group.add_argument(
        "--max-retries", type=natural_int, default=4, help="endpoint: retries per request on 5xx/connection errors"
    )
    group.add_argument("--timeout", type=positive_float, default=60.0, help="endpoint: seconds per request (default: 60)")
    group.add_argument("--max-tokens", type=positive_int, default=8, help="endpoint: reply token limit (default: 8)")
    group.add_argument(
        "--extra-body",
        type=json_object,
        help='endpoint: JSON object of extra request fields, e.g. \'{"guided_choice": ["A", "B"]}\'',
    )


def run_forced_choice(args: argparse.Namespace) -> None:
    """``tatblimp score --protocol forced-choice``: a local chat model, or an endpoint with ``--endpoint``."""
    from .chat.forced_choice import DEFAULT_PROMPT, check_prompt
    from .reading.data import load_benchmark

    if args.protocol != "forced-choice":
        raise ValueError("--endpoint needs --protocol forced-choice (chat endpoints give no sentence log-probabilities)")
    prompt = check_prompt(read_option_file(args.prompt_file, "--prompt-file")) if args.prompt_file else DEFAULT_PROMPT

    if args.suite or args.suites_only:
        raise ValueError("--suite: the forced-choice protocol scores TatBLiMP's pairs only; score suites by log-probs")

    def benchmark():  # after the options are checked, before a model loads or a request is sent
        return load_benchmark(args.data, allow_modified=args.allow_modified).select(args.limit, args.phenomena)

    if args.endpoint:
        from .chat.endpoint import ChatClient, evaluate_endpoint

        if not args.model_name:
            raise ValueError("--endpoint needs --model-name (the model field of each request)")
        if args.model:
            raise ValueError(f"give either a model folder ({args.model}) or --endpoint, not both")
        client = ChatClient(
            args.endpoint,
            args.model_name,
            api_key=os.environ.get(args.api_key_env, ""),  # unset: no key, never $OPENAI_API_KEY's
            max_tokens=args.max_tokens,
            extra_body=args.extra_body,
            timeout=args.timeout,
            max_retries=args.max_retries,
        )
        results = evaluate_endpoint(
            client,
            benchmark(),
            prompt=prompt,
            system_prompt=args.system_prompt,
            results_path=args.results,
            concurrency=args.concurrency,
            allow_modified=args.allow_modified,
            progress=sys.stderr.isatty(),
        )
    else:
        from .chat.forced_choice import evaluate_forced_choice
        from .commands.backends import uses_vllm

        if uses_vllm(args):
            raise ValueError(
                "--backend vllm scores sentences (--protocol logprob); for forced choice, serve the model and use --endpoint"
            )
        if not args.model:
            raise ValueError("name a chat model folder or Hub id, or an --endpoint URL")
        tokenizer_source(args.model, args.tokenizer)  # checks the paths first, loading nothing
        pairs = benchmark()
        _, tokenizer, model = load_from_args(args, args.model)
        results = evaluate_forced_choice(
            model,
            tokenizer,
            pairs,
            prompt=prompt,
            system_prompt=args.system_prompt,
            allow_modified=args.allow_modified,
            memory_budget=args.memory_budget_mb * 2**20 if args.memory_budget_mb else None,
        )
        results.model = args.model
    report(results, args.output)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that an option no parser knows is reported by the subcommand's parser:
    its usage, not the top-level one, and status 2; so is what a subcommand's ``usage_problem`` (a default of its
    parser: args -> a message or None) finds."""
    args, unknown = parser.parse_known_args(argv)
    if args.command == "lm-eval":  # every argument after it is the harness's, in its order (argparse's REMAINDER
        # leaves an option that comes first to the unknown ones)
        given = list(sys.argv[1:] if argv is None else argv)
        args.harness_args = given[given.index("lm-eval") + 1 :]
        unknown = []
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if unknown:
        subcommands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    # Options that need one another (tokenizers --include-pairs needs --output): a usage error too, status 2.
    problem = getattr(args, "usage_problem", lambda _: None)(args)
    if problem:
        subcommands.choices[args.command].error(problem)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        args.run(args)
    except BrokenPipeError:  # stdout closed by its reader (| head): the files are written; the rest is not wanted
        silence_stdout()
    except KeyboardInterrupt:
        print("tatblimp: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # one line for the user; --verbose shows the traceback
        if args.verbose:
            logging.exception("tatblimp %s failed", args.command)
        message = getattr(err, "command_line", None) or str(err)  # BenchmarkError: the wording that names the option
        message = message.splitlines()[0] if message else type(err).__name__
        print(f"tatblimp {args.command}: error: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
