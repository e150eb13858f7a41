"""Log-prob scoring through an OpenAI-compatible completions endpoint (a vLLM server, or any that echoes log-probs).

Every sentence is tokenized here, as for the default backend (the same prefix token, the same ids), and
sent to ``/v1/completions`` as token ids, never as text, asking for the log-prob of each prompt token:
``echo=true, logprobs=0`` with ``max_tokens=0`` (no token generated), else ``max_tokens=1`` where the server
wants one, else vLLM's ``prompt_logprobs=0`` where ``echo`` is not served. The first sentence's reply settles
which of the three the server takes. The ids the server says it scored are checked against those sent:
a server that re-tokenizes, or names tokens by text only, is an error that says so, not a silent mismatch.
The sentence's log-prob is the float64 sum of its tokens' log-probs in token order, and the metrics are
those of ``metrics.compute_results``.

Requests go through ``endpoint.ChatClient``'s machinery: the official ``openai`` client with its retries
and timeouts, ``concurrency`` requests at a time (``endpoint.send_all``), a 4xx reply stopping the run, and
with ``results_path`` every sentence's token log-probs appended to a JSON Lines file as they arrive, so that
an interrupted run (Ctrl-C included) is resumed by a rerun, not repeated. More suites (``suites=``, the CLI's
``--suite``) are scored in the same run, their sentences sharing the requests in flight with TatBLiMP's, each
suite's log-probs kept in a results file of its own beside TatBLiMP's (``suite_results_path``), so that a
rerun with other suites still resumes each one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..reading.data import Benchmark, load_benchmark
from ..reading.suites import Suite, load_suite
from ..results.metrics import Results, compute_results
from ..results.provenance import provenance
from ..results.token_results import pair_tokens
from ..tokenized.cache import build_cache
from .endpoint import ChatClient, EndpointError, EndpointRejected, open_results, progress_bar, read_results_file, send_all

logger = logging.getLogger(__name__)

RESULTS_FORMAT = 1
# The ways of asking for prompt log-probs, in the order tried: the fewest generated tokens first.
MODES = {
    "echo": {"echo": True, "logprobs": 0, "max_tokens": 0},
    "echo+1": {"echo": True, "logprobs": 0, "max_tokens": 1},
    "prompt_logprobs": {"max_tokens": 1, "extra_body": {"prompt_logprobs": 0}},
}
# vLLM names each token by its id ("token_id:123") instead of its text, and gives the prompt's ids, when asked;
# other servers ignore these fields.
_IDS = {"return_tokens_as_token_ids": True, "return_token_ids": True}


@dataclass
class CompletionsClient(ChatClient):
    """Asks a completions endpoint for the log-prob of every token of a prompt given as ids (``ChatClient``'s options).

    ``mode`` is the way of asking (a key of ``MODES``); None: settled by ``settle_mode`` on the first sentence.
    """

    PATH = "/completions"
    mode: str | None = None

    def token_logprobs(self, ids: list[int]) -> list[float]:
        """The log-probs of ``ids[1:]``, each after the ones before it.

        Raises:
            EndpointError: the reply scored other ids than ``ids``, names no ids, or has no log-probs.
            EndpointRejected: a 4xx reply.
        """
        options = MODES[self.mode or "echo"]
        extra_body = {**_IDS, **options.get("extra_body", {}), **(self.extra_body or {})}
        body = self.send(
            lambda client: client.completions.with_raw_response.create(
                model=self.model_name,
                prompt=ids,
                temperature=0.0,
                extra_body=extra_body,
                **{key: value for key, value in options.items() if key != "extra_body"},
            )
        )
        return read_prompt_logprobs(body, ids, self.endpoint)

    def settle_mode(self, ids: list[int]) -> list[float]:
        """Find the first of ``MODES`` the server takes, asking for ``ids``; their log-probs."""
        if self.mode is not None:
            return self.token_logprobs(ids)
        rejected = None
        for mode in MODES:
            self.mode = mode
            try:
                values = self.token_logprobs(ids)
            except EndpointRejected as err:
                rejected = err
                continue
            logger.info("tatblimp: %s serves prompt log-probs as %s", self.endpoint, mode)
            return values
        self.mode = None
        raise EndpointRejected(f"{rejected}; the server serves prompt log-probs in none of the ways asked ({', '.join(MODES)})")


def read_prompt_logprobs(body: bytes, ids: list[int], endpoint: str = "the endpoint") -> list[float]:
    """The log-probs of ``ids[1:]`` from a completions reply, after checking that it scored exactly ``ids``.

    vLLM's ``choices[0].prompt_logprobs`` (``None`` first, then one ``{id: {"logprob": ...}}`` a token) is read
    when present, else the OpenAI ``choices[0].logprobs`` (``tokens`` named ``token_id:ID``, ``token_logprobs``);
    vLLM's ``prompt_token_ids``, where given, must be ``ids`` too.
    """
    try:
        choice = json.loads(body)["choices"][0]
        choice.get  # noqa: B018  (a dict, or the reply is no completion)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise EndpointError(f"{endpoint}: the reply is not a completion: {body[:200].decode('utf-8', 'replace')}") from None
    echoed = choice.get("prompt_token_ids")
    scored, values = _from_prompt_logprobs(choice, len(ids)) or _from_logprobs(choice, len(ids), endpoint)
    if scored[0] is None:  # prompt_logprobs say nothing of the first token; prompt_token_ids do
        scored[0] = echoed[0] if isinstance(echoed, list) and echoed else ids[0]
    if isinstance(echoed, list) and echoed != ids:
        scored = echoed
    if scored != ids:
        at = next((i for i, (a, b) in enumerate(zip(scored, ids)) if a != b), min(len(scored), len(ids)))
        raise EndpointError(
            f"{endpoint} scored other token ids than those sent (first difference at token {at}: sent {ids[at : at + 5]}, "
            f"scored {scored[at : at + 5]}; {len(ids)} sent, {len(scored)} scored): the server re-tokenizes its prompts, "
            "so its log-probs are not those of this tokenization"
        )
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values[1:]):
        raise EndpointError(f"{endpoint}: the reply has no log-prob for some of the prompt's tokens")
    return [float(v) for v in values[1:]]


def _from_prompt_logprobs(choice: dict, count: int) -> tuple[list[int | None], list[Any]] | None:
    """(ids, log-probs) of vLLM's ``prompt_logprobs``, the first token's unknown (None); None when absent."""
    entries = choice.get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) < 2:
        return None
    scored: list[int | None] = [None]
    values: list[Any] = [None]
    for entry in entries[1:count]:
        # prompt_logprobs=0 lists the prompt's own token first (alone, or before a better ranked one).
        key, item = next(iter(entry.items())) if isinstance(entry, dict) and entry else (None, None)
        scored.append(_as_id(key))
        values.append(item.get("logprob") if isinstance(item, dict) else None)
    return scored, values


def _head(tokens: list[Any]) -> str:
    """The first few of a reply's tokens, to name the request it answers."""
    return ", ".join(map(str, tokens[:6])) + (", ..." if len(tokens) > 6 else "")


def _as_id(key: Any) -> int | None:
    try:
        return int(key)
    except (TypeError, ValueError):
        return None


def _from_logprobs(choice: dict, count: int, endpoint: str) -> tuple[list[int | None], list[Any]]:
    """(ids, log-probs) of the first ``count`` echoed tokens of OpenAI's ``logprobs`` (named ``token_id:ID``)."""
    logprobs = choice.get("logprobs") or {}
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) < count:
        raise EndpointError(f"{endpoint}: the reply echoes no log-prob for each prompt token (no echo, no prompt_logprobs)")
    if len(values) != len(tokens):  # which token a value belongs to is unknown: none of them can be trusted
        raise EndpointError(
            f"{endpoint}: the reply to the request for {count} token ids ({_head(tokens[:count])}) has "
            f"{len(values)} token_logprobs for {len(tokens)} tokens"
        )
    scored: list[int | None] = []
    for token in tokens[:count]:
        if not (isinstance(token, str) and token.startswith("token_id:") and token[9:].lstrip("-").isdigit()):
            raise EndpointError(
                f"{endpoint} names the tokens it scored by their text ({token!r}), not their ids, so it cannot be checked "
                "that it scored the ids sent; a vLLM server names them by id (return_tokens_as_token_ids)"
            )
        scored.append(int(token[9:]))
    return scored, values[:count]


def evaluate_logprob_endpoint(
    client: CompletionsClient,
    tokenizer: Any,
    data: Benchmark | str | os.PathLike | None = None,
    *,
    prefix_token_id: int | None = None,
    results_path: str | os.PathLike | None = None,
    concurrency: int = 8,
    allow_modified: bool = False,
    include_tokens: bool = False,
    progress: bool = False,
    suites: Mapping[str, Suite | str | os.PathLike] | None = None,
) -> Results:
    """Score every pair through the endpoint: the same ``Results`` as ``evaluate`` gives for the same model.

    Args:
        client: the endpoint and model (``CompletionsClient``).
        tokenizer: the model's tokenizer (its ids are sent); a Hugging Face tokenizer or a ``SentencePieceTokenizer``.
        data: a ``Benchmark`` (a ``Suite`` scored alone included), a JSONL path, or None for ``$TATBLIMP_DATA`` /
            the Hub dataset.
        prefix_token_id: the token put before every sentence (default: BOS, else EOS).
        results_path: a JSONL file every sentence's token log-probs are appended to; a rerun for the same
            model, benchmark, tokenization and prefix asks only the sentences not in it yet. Each suite's
            go to a file of its own beside it (``suite_results_path``: ``lp.jsonl`` -> ``lp.blimp.jsonl``).
        concurrency: requests at once (the suites' sentences share them with TatBLiMP's).
        allow_modified: accept a benchmark file that is not the official release.
        include_tokens: also give each pair's token log-probs, texts and edit span (``Results.pair_tokens``).
        progress: a progress bar on stderr.
        suites: more suites scored in the same run, ``{name: path or Suite}`` as ``Evaluator``'s; their
            results are in ``results.suites[name]``, with the pairs they leave out.

    Raises:
        EndpointError: the server re-tokenizes, names no token ids, has no prompt log-probs, rejects the
            requests (4xx), or some sentences still fail after their retries (the others are kept with
            ``results_path``); a results file written for another model, benchmark or tokenization.
        TokenizationError: no prefix token can be found, or a sentence encodes to no tokens.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    benchmark = data if isinstance(data, Benchmark) else load_benchmark(data, allow_modified=allow_modified)
    named = {name: s if isinstance(s, Suite) else load_suite(name, s) for name, s in (suites or {}).items()}
    parts = [
        _Part(None, benchmark, tokenizer, prefix_token_id, client.model_name, results_path),
        *(
            _Part(n, s, tokenizer, prefix_token_id, client.model_name, suite_results_path(results_path, n))
            for n, s in named.items()
        ),
    ]
    for part in parts:
        part.open()
    # One list of every part's sentences, so that all of them share the requests in flight.
    where = [(part, s) for part in parts for s in range(len(part.sentences))]
    sentences = [part.sentences[s] for part, s in where]
    pending = [k for k, (part, s) in enumerate(where) if s not in part.found]
    resumed = len(sentences) - len(pending)
    bar = progress_bar(progress, len(sentences), resumed, desc="tatblimp log-probs", unit="sentence")

    def keep(k: int, values: list[float]) -> None:
        part, s = where[k]
        part.keep(s, values)
        if bar is not None:
            bar.update(1)

    start = time.perf_counter()
    try:
        if pending:  # the first settles how the server serves prompt log-probs; the rest go at once
            keep(pending[0], client.settle_mode(sentences[pending[0]]))
        failed = send_all(client.token_logprobs, sentences, pending[1:], keep, concurrency)
    except BaseException:
        if results_path:
            kept = sum(len(part.found) for part in parts)
            logger.warning("tatblimp: stopped; %d sentences are in %s, a rerun asks only the rest", kept, _files(parts))
        raise
    finally:
        for part in parts:
            part.close()
        if bar is not None:
            bar.close()
    if failed:
        kept = sum(len(part.found) for part in parts)
        also = f"; the {kept} scored sentences are in {_files(parts)}, rerun to ask only the rest" if results_path else ""
        k, error = failed[0]
        name = where[k][0].name
        raise EndpointError(
            f"{len(failed)} of {len(sentences)} sentences failed (sentence {where[k][1]}"
            f"{f' of suite {name}' if name else ''}: {error}){also}"
        )
    run_info = {
        "backend": "endpoint",
        "scoring_method": f"endpoint ({client.mode or 'resumed'})",
        "endpoint": client.endpoint,
        "model": client.model_name,
        "seconds": time.perf_counter() - start,
        "requests": len(pending),
        "resumed_sentences": resumed,
        "retries": client.retries,
        "prefix_token_id": parts[0].cache.prefix_token_id,  # sent before each sentence, as the default backend puts it
        **provenance(),  # no local model: dtype and device are None
    }
    results = parts[0].results(run_info)
    if isinstance(benchmark, Suite):  # a suite scored alone: its left-out pairs, as the default backend gives them
        results.left_out = [dict(entry) for entry in benchmark.left_out]
    if include_tokens:  # TatBLiMP's pairs only, as the default backend gives them
        results.pair_tokens = pair_tokens(parts[0].cache, parts[0].token_logprobs(), tokenizer)
    for part in parts[1:]:
        results.suites[part.name] = part.results(run_info)
        results.suites[part.name].left_out = [dict(entry) for entry in named[part.name].left_out]
    return results


def suite_results_path(results_path: str | os.PathLike | None, name: str) -> Path | None:
    """Where suite ``name``'s token log-probs are kept beside TatBLiMP's ``results_path`` (``lp.blimp.jsonl``)."""
    if results_path is None:
        return None
    path = Path(results_path)
    return path.with_name(f"{path.stem}.{name}{path.suffix}")


def _files(parts: list[_Part]) -> str:
    return ", ".join(str(part.path) for part in parts)


class _Part:
    """TatBLiMP's or one suite's sentences, as tokenized for the endpoint, and their results file."""

    def __init__(self, name, benchmark, tokenizer, prefix_token_id, model_name, path):
        self.name, self.path = name, Path(path) if path else None
        self.cache = build_cache(tokenizer, benchmark, prefix_token_id=prefix_token_id)
        ids, offsets = self.cache.token_ids.tolist(), self.cache.offsets.tolist()
        self.sentences = [ids[offsets[s] : offsets[s + 1]] for s in range(self.cache.num_sentences)]
        header = {
            "tatblimp_logprob_endpoint": RESULTS_FORMAT,
            "model": model_name,
            "benchmark_md5": benchmark.md5,
            "benchmark_selection": benchmark.selection,
            "tokenization": self.cache.fingerprint,  # the tokenizer, the prefix token and the data
        }
        self.header, self.sink = header, None
        self.found = _load_results(self.path, header, self.sentences) if self.path else {}

    def open(self) -> None:
        """Open the results file to append (after every part's file was read and found to fit)."""
        if self.path:
            self.sink = open_results(self.path, self.header)

    def keep(self, s: int, values: list[float]) -> None:
        self.found[s] = values
        if self.sink is not None:
            self.sink.write(json.dumps({"sentence": s, "token_logprobs": values}) + "\n")
            self.sink.flush()

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()

    def token_logprobs(self) -> list[list[float]]:
        return [self.found[s] for s in range(len(self.sentences))]

    def results(self, run_info: dict) -> Results:
        logprobs = torch.zeros(len(self.sentences), dtype=torch.float64)
        for s, values in enumerate(self.token_logprobs()):
            total = 0.0
            for value in values:  # float64, in token order
                total += value
            logprobs[s] = total
        return compute_results(self.cache, logprobs, run_info)


def _load_results(path: Path, header: dict, sentences: list[list[int]]) -> dict[int, list[float]]:
    """Token log-probs already in a results file; an error if it was written for another model, benchmark or tokenization."""
    lines = read_results_file(path, header, "tatblimp_logprob_endpoint", "log-prob endpoint", "log-probs")
    found = {}
    for number, line in enumerate(lines, start=2):
        try:
            record = json.loads(line)
            s, values = record["sentence"], record["token_logprobs"]
        except (ValueError, KeyError, TypeError):
            raise EndpointError(f"{path}:{number}: not a results record") from None
        if not isinstance(s, int) or not 0 <= s < len(sentences) or not isinstance(values, list):
            raise EndpointError(f"{path}:{number}: sentence {s!r} is not one of the {len(sentences)} sentences")
        if len(values) != len(sentences[s]) - 1:
            raise EndpointError(
                f"{path}:{number}: {len(values)} log-probs for sentence {s} of {len(sentences[s]) - 1} scored tokens"
            )
        found[s] = [float(v) for v in values]
    return found
