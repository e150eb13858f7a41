"""``tatblimp score --endpoint URL --model-name NAME --tokenizer TOKENIZER`` with ``--protocol logprob``: its options
checked, the tokenizer and benchmark read, and the sentences scored through ``chat/logprob_endpoint.py``."""

from __future__ import annotations

import argparse

from .backends import uses_vllm


def score_through_endpoint(args: argparse.Namespace):
    """``tatblimp score --endpoint URL --model-name NAME --tokenizer TOK`` (``--protocol logprob``): the ``Results``."""
    import os
    import sys

    from ..chat.logprob_endpoint import CompletionsClient, evaluate_logprob_endpoint
    from ..reading.suites import benchmark_and_suites
    from .loading import load_tokenizer

    if not args.model_name:
        raise ValueError("--endpoint needs --model-name (the model field of each request)")
    if args.model:
        raise ValueError(f"give either a model folder ({args.model}) or --endpoint, not both")
    if not args.tokenizer:
        raise ValueError(
            "--protocol logprob with --endpoint needs --tokenizer: the served model's tokenizer, whose token ids are sent"
        )
    if uses_vllm(args):
        raise ValueError("--backend vllm starts an engine in this process; an --endpoint is a server's")
    benchmark, suites = benchmark_and_suites(args)  # each suite's log-probs resumable from its own file beside --results
    tokenizer = load_tokenizer(args.tokenizer)
    client = CompletionsClient(
        args.endpoint,
        args.model_name,
        api_key=os.environ.get(args.api_key_env, ""),  # unset: no key, never $OPENAI_API_KEY's
        extra_body=args.extra_body,
        timeout=args.timeout,
        max_retries=args.max_retries,
    )
    return evaluate_logprob_endpoint(
        client,
        tokenizer,
        benchmark,
        prefix_token_id=args.prefix_token_id,
        results_path=args.results,
        concurrency=args.concurrency,
        allow_modified=args.allow_modified,
        include_tokens=getattr(args, "include_tokens", False),
        progress=sys.stderr.isatty(),
        suites=suites,
    )
