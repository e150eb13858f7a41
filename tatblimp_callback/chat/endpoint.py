"""Forced choice against an OpenAI-compatible chat-completions endpoint (vLLM, llama.cpp, SGLang, ...).

The items and prompts are those of ``forced_choice``; each is sent as one chat request and the
reply's text is parsed strictly: after stripping white space (and one trailing ``.``) it must be
exactly ``A`` or ``B``. Anything else counts as wrong and is counted as ``unparsed``, as is a 200
reply that is not a chat completion at all.

Requests go through the official ``openai`` client (``pip install 'tatblimp-callback[endpoint]'``),
from a bounded pool of threads sharing one client. The client retries connection errors,
timeouts, 408, 409, 429 and 5xx replies a bounded number of times with exponential backoff (or
as long as the server's ``Retry-After`` says); any other 4xx reply (a wrong model name, a
rejected option) stops the run at once. With ``results_path`` every answer is appended to a
JSON Lines file as it arrives, and a rerun skips the items already there, so an interrupted or
partly failed run is resumed, not repeated.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..reading.data import Benchmark, load_benchmark
from ..reading.jsonl import read_complete_lines
from ..results.provenance import provenance
from ..results.records_file import open_for_append
from .forced_choice import (
    DEFAULT_PROMPT,
    ORDERS,
    ChoiceItem,
    ForcedChoiceResults,
    all_item_messages,
    compute_choice_results,
)

logger = logging.getLogger(__name__)

RESULTS_FORMAT = 1
_ANSWER = re.compile(r"\s*([AB])\.?\s*")
# The statuses the openai client retries; a reply with any other 4xx is the request's fault.
_RETRIED_STATUS = {408, 409, 429}
# Sent when no key is given or set: keyless servers (vLLM, llama.cpp without --api-key) ignore it.
NO_KEY = "EMPTY"


class EndpointError(RuntimeError):
    """The endpoint cannot be used (a 4xx reply, retries exhausted) or a results file does not match."""


class EndpointRejected(EndpointError):
    """A 4xx reply other than 408/409/429: the request itself is wrong, so no other item is asked."""


def parse_answer(text: str | None) -> str | None:
    """``"A"`` or ``"B"`` when the reply is exactly that letter (white space and one trailing dot aside), else None."""
    match = _ANSWER.fullmatch(text or "")
    return match.group(1) if match else None


def _import_openai():
    try:
        import openai
    except ImportError as err:
        raise ImportError("the endpoint protocol needs the openai client: pip install 'tatblimp-callback[endpoint]'") from err
    return openai


@dataclass
class ChatClient:
    """Sends chat-completions requests through one ``openai.OpenAI`` client, safe to share between threads.

    Args:
        url: the server's base URL (``http://host:8000/v1``) or the full ``.../chat/completions`` URL;
            None: ``$OPENAI_BASE_URL``, else OpenAI's own API, as the openai client decides.
        model_name: the ``model`` field of each request.
        api_key: sent as ``Authorization: Bearer``; None: ``$OPENAI_API_KEY``, else a placeholder; ``""``: the
            placeholder (a key variable named and unset: never another variable's key)
            that keyless servers ignore. Never printed or logged.
        max_tokens: the reply's token limit; a letter needs one, a little more lets a chatty reply
            show up as unparsed instead of cut to a letter.
        temperature: 0 for greedy answers.
        extra_body: more request fields, e.g. vLLM's ``{"guided_choice": ["A", "B"]}``.
        timeout: seconds per attempt.
        max_retries: the openai client's retries of one request after a connection error, timeout,
            408, 409, 429 or 5xx; it waits 0.5 s before the first, doubling up to 8 s, or what the
            server's ``Retry-After`` header asks.
    """

    PATH = "/chat/completions"  # the route asked, below the base URL

    url: str | None
    model_name: str
    api_key: str | None = field(default=None, repr=False)
    max_tokens: int = 8
    temperature: float = 0.0
    extra_body: dict[str, Any] | None = None
    timeout: float = 60.0
    max_retries: int = 4

    def __post_init__(self):
        openai = _import_openai()
        base_url = None
        if self.url is not None:
            base_url = self.url.rstrip("/").removesuffix(self.PATH)
            if not base_url.startswith(("http://", "https://")):
                raise EndpointError(f"endpoint URL must start with http:// or https://, got {self.url!r}")
        self.retries = 0  # retries done, over all requests
        self._lock = threading.Lock()
        self._attempts = threading.local()  # attempts of the request this thread is sending
        # The sync client calls its hooks in the thread that sends, once per attempt.
        http_client = openai.DefaultHttpxClient(event_hooks={"request": [self._count_attempt]})
        self._client = openai.OpenAI(
            base_url=base_url,
            api_key=self.api_key or (None if self.api_key == "" else os.environ.get("OPENAI_API_KEY")) or NO_KEY,
            timeout=self.timeout,
            max_retries=self.max_retries,
            http_client=http_client,
        )
        self.endpoint = str(self._client.base_url).rstrip("/") + self.PATH
        self._openai = openai

    def _count_attempt(self, request) -> None:
        self._attempts.count = getattr(self._attempts, "count", 0) + 1

    def ask(self, messages: list[dict]) -> str:
        """The reply's text (``choices[0].message.content``); for a 200 reply that is no chat completion, its body."""
        # The raw reply: a 200 whose body is not a chat completion is an answer too (counted unparsed).
        return _reply_text(
            self.send(
                lambda client: client.chat.completions.with_raw_response.create(
                    model=self.model_name,
                    messages=messages,
                    max_tokens=self.max_tokens,
                    temperature=self.temperature,
                    extra_body=self.extra_body,
                )
            )
        )

    def send(self, request) -> bytes:
        """The body of the raw reply ``request(openai_client)`` gets, with the client's retries counted.

        Raises:
            EndpointRejected: a 4xx reply other than 408, 409, 429 (the request itself is wrong).
            EndpointError: retries exhausted (5xx, 408, 409, 429, connection errors, timeouts).
        """
        self._attempts.count = 0
        try:
            return request(self._client).http_response.content
        except self._openai.APIStatusError as err:
            detail = err.response.content[:300].decode("utf-8", "replace")
            if err.status_code < 500 and err.status_code not in _RETRIED_STATUS:
                raise EndpointRejected(f"{self.endpoint} answered HTTP {err.status_code}: {detail}") from None
            problem = f"HTTP {err.status_code}: {detail}"
        except self._openai.APIConnectionError as err:  # refused, reset, timed out, cut reply
            problem = f"{type(err).__name__}: {err.__cause__ or err}"
        finally:
            with self._lock:
                self.retries += max(self._attempts.count - 1, 0)
        raise EndpointError(f"{self.endpoint}: giving up after {self._attempts.count} attempts; last error {problem}")


def _reply_text(raw: bytes) -> str:
    try:
        content = json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        return raw[:200].decode("utf-8", "replace")
    return content if isinstance(content, str) else ""


def evaluate_endpoint(
    client: ChatClient,
    data: Benchmark | str | os.PathLike | None = None,
    *,
    prompt: str = DEFAULT_PROMPT,
    system_prompt: str | None = None,
    results_path: str | os.PathLike | None = None,
    concurrency: int = 8,
    allow_modified: bool = False,
    progress: bool = False,
) -> ForcedChoiceResults:
    """Ask every forced-choice item of the endpoint and return the results.

    ``concurrency`` requests run at once. With ``results_path``, answers already in that JSONL
    file (for the same model, benchmark and prompt) are not asked again, and new ones are added
    as they arrive. If some items still fail after their retries, ``EndpointError`` says how
    many; the answered ones are in the file, and a rerun asks only the rest.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    benchmark = data if isinstance(data, Benchmark) else load_benchmark(data, allow_modified=allow_modified)
    conversations = all_item_messages(benchmark, prompt, system_prompt)
    header = {
        "tatblimp_forced_choice": RESULTS_FORMAT,
        "model": client.model_name,
        "benchmark_md5": benchmark.md5,
        "benchmark_selection": benchmark.selection,  # --limit/--phenomena: item k is another pair's
        "prompt": prompt,
        "system_prompt": system_prompt,
        # They change the answers too (guided_choice, a reply cut short): one file holds the answers of one setting
        "extra_body": client.extra_body,
        "max_tokens": client.max_tokens,
    }
    texts: dict[int, str] = _load_results(Path(results_path), header, len(conversations)) if results_path else {}
    resumed = len(texts)
    pending = [k for k in range(len(conversations)) if k not in texts]
    sink = open_results(Path(results_path), header) if results_path else None

    def keep(k: int, text: str) -> None:
        """An answer, saved as it arrives: an interrupted run keeps every answer it paid for."""
        texts[k] = text
        if sink is not None:
            record = {"item": k, "pair": k // 2, "order": ORDERS[k % 2], "text": text, "answer": parse_answer(text)}
            sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            sink.flush()
        if bar is not None:
            bar.update(1)

    bar = progress_bar(progress, len(conversations), resumed)
    start = time.perf_counter()
    try:
        failed = send_all(client.ask, conversations, pending, keep, concurrency)
    except BaseException:
        if results_path:
            logger.warning("tatblimp: stopped; %d answers are in %s, a rerun asks only the rest", len(texts), results_path)
        raise
    finally:
        if sink is not None:
            sink.close()
        if bar is not None:
            bar.close()
    if failed:
        where = f"; the {len(texts)} answered items are in {results_path}, rerun to ask only the rest" if results_path else ""
        raise EndpointError(f"{len(failed)} of {len(conversations)} items failed (item {failed[0][0]}: {failed[0][1]}){where}")

    items = []
    for k in range(len(conversations)):
        answer = parse_answer(texts[k])
        items.append(ChoiceItem.of_item(k, answer, None if answer else "unparsed", text=texts[k]))
    extra = {
        "endpoint": client.endpoint,
        "seconds": time.perf_counter() - start,
        "requests": len(pending),
        "resumed_items": resumed,
        "retries": client.retries,
        **provenance(),  # no local model: dtype and device are None
    }
    return compute_choice_results(
        benchmark, items, model=client.model_name, prompt=prompt, system_prompt=system_prompt, run_info=extra
    )


def send_all(ask, requests, pending, keep, concurrency: int) -> list[tuple[int, str]]:
    """``keep(k, ask(requests[k]))`` for every ``k`` of ``pending``, ``concurrency`` at a time; the items that failed.

    Returns the ``(k, error)`` of the items whose ``ask`` raised ``EndpointError`` (retries exhausted), sorted.
    At most ``concurrency`` requests exist at any time: on Ctrl-C or a rejected request (``EndpointRejected``)
    nothing more is sent, the few already on their way are waited for and kept, and the exception goes on
    (a queue of all items would send them all first).
    """
    failed: list[tuple[int, str]] = []
    queue = iter(pending)
    in_flight: dict[Future, int] = {}
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        try:
            while True:
                while len(in_flight) < concurrency and (k := next(queue, None)) is not None:
                    in_flight[pool.submit(ask, requests[k])] = k
                if not in_flight:
                    break
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    k = in_flight.pop(future)
                    try:
                        keep(k, future.result())
                    except EndpointRejected:
                        raise
                    except EndpointError as err:
                        failed.append((k, str(err)))
        except BaseException:  # Ctrl-C, a rejected request: keep what is still on its way, send nothing more
            _keep_answers_in_flight(in_flight, keep)
            raise
    return sorted(failed)


def _keep_answers_in_flight(in_flight: dict[Future, int], keep) -> None:
    """Wait for the requests already sent and ``keep`` each answer that comes back."""
    for future, k in in_flight.items():
        with contextlib.suppress(Exception):  # the run is stopping anyway; a failed item is asked again by a rerun
            keep(k, future.result())


LATER_HEADER_KEYS = ("extra_body", "max_tokens")  # header keys a results file of an earlier version lacks


def read_results_file(path: Path, header: dict, format_key: str, what: str, held: str) -> list[str]:
    """The record lines of a results file the endpoint routes append to (after its header line), or [] for a new
    one; an error naming the file if it is another kind (``format_key`` not this ``RESULTS_FORMAT``: ``what``) or
    was written for another model, benchmark or setting (each ``header`` key but the format's; ``held``: what it
    holds). A line cut short when a run was killed mid-write is left out: that item is asked again."""
    lines = read_complete_lines(path) if path.exists() else []
    if not lines:
        return []
    try:
        found = json.loads(lines[0])
    except ValueError:
        found = None
    if not isinstance(found, dict) or found.get(format_key) != header[format_key]:
        raise EndpointError(f"{path}: not a tatblimp {what} results file; choose another results path")
    for key in header:
        if key in LATER_HEADER_KEYS and key not in found:  # a file written before they were recorded
            continue
        if key != format_key and found.get(key) != header[key]:
            raise EndpointError(
                f"{path} holds {held} for a different {key.replace('_', ' ')} ({found.get(key)!r}, now {header[key]!r}); "
                "choose another results path"
            )
    return lines[1:]


def _load_results(path: Path, header: dict, items: int) -> dict[int, str]:
    """Replies already in a results file; an error if it was written for another model, benchmark or prompt."""
    lines = read_results_file(path, header, "tatblimp_forced_choice", "forced-choice", "answers")
    texts = {}
    for number, line in enumerate(lines, start=2):
        try:
            record = json.loads(line)
            k, text = record["item"], record["text"]
        except (ValueError, KeyError, TypeError):
            raise EndpointError(f"{path}:{number}: not a results record") from None
        if not isinstance(k, int) or not 0 <= k < items or not isinstance(text, str):
            raise EndpointError(f"{path}:{number}: item {k!r} is not one of the {items} items, or its text is not a string")
        texts[k] = text
    return texts


def open_results(path: Path, header: dict):
    """``path`` opened to append (a partial last line of a killed run cut off first), its ``header`` line written
    first when it is new or empty."""
    sink = open_for_append(path)
    if path.stat().st_size == 0:
        sink.write(json.dumps(header, ensure_ascii=False) + "\n")
        sink.flush()
    return sink


def progress_bar(enabled: bool, total: int, done: int, desc: str = "tatblimp forced choice", unit: str = "item"):
    """A tqdm bar on stderr (None when not ``enabled``), starting at ``done`` of ``total``."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=desc, unit=unit)
