"""Forced choice against an OpenAI-compatible chat-completions endpoint (vLLM, llama.cpp, SGLang, ...).

The items and prompts are those of ``forced_choice``; each is sent as one chat request and the
reply's text is parsed strictly: after stripping white space (and one trailing ``.``) it must be
exactly ``A`` or ``B``. Anything else counts as wrong and is counted as ``unparsed``, as is a 200
reply that is not a chat completion at all.

Requests run in a bounded pool of threads. Connection errors, timeouts, 408, 429 and 5xx replies
are retried with exponential backoff a bounded number of times; any other 4xx reply (a wrong
model name, a rejected option) stops the run at once. With ``results_path`` every answer is
appended to a JSON Lines file as it arrives, and a rerun skips the items already there, so an
interrupted or partly failed run is resumed, not repeated.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from typing import Any

from .data import Benchmark, load_benchmark
from .forced_choice import (
    DEFAULT_PROMPT,
    LETTERS,
    ORDERS,
    ChoiceItem,
    ForcedChoiceResults,
    all_item_messages,
    compute_choice_results,
)

logger = logging.getLogger(__name__)

RESULTS_FORMAT = 1
_ANSWER = re.compile(r"\s*([AB])\.?\s*")
_RETRY_STATUS = {408, 429}
_MAX_BACKOFF = 30.0


class EndpointError(RuntimeError):
    """The endpoint cannot be used (a 4xx reply, retries exhausted) or a results file does not match."""


class EndpointRejected(EndpointError):
    """A 4xx reply other than 408/429: the request itself is wrong, so no other item is asked."""


def parse_answer(text: str | None) -> str | None:
    """``"A"`` or ``"B"`` when the reply is exactly that letter (white space and one trailing dot aside), else None."""
    match = _ANSWER.fullmatch(text or "")
    return match.group(1) if match else None


@dataclass
class ChatClient:
    """Sends one chat-completions request, with bounded retries.

    Args:
        url: the server's base URL (``http://host:8000/v1``) or the full ``.../chat/completions`` URL.
        model_name: the ``model`` field of each request.
        api_key: sent as ``Authorization: Bearer``; None: no header.
        max_tokens: the reply's token limit; a letter needs one, a little more lets a chatty reply
            show up as unparsed instead of cut to a letter.
        temperature: 0 for greedy answers.
        extra_body: more request fields, e.g. vLLM's ``{"guided_choice": ["A", "B"]}``.
        timeout: seconds per request.
        max_retries: retries of one request after a connection error, timeout, 408, 429 or 5xx.
        backoff: seconds before the first retry, doubled for each next one (at most 30 s).
    """

    url: str
    model_name: str
    api_key: str | None = None
    max_tokens: int = 8
    temperature: float = 0.0
    extra_body: dict[str, Any] | None = None
    timeout: float = 60.0
    max_retries: int = 4
    backoff: float = 1.0

    def __post_init__(self):
        base = self.url.rstrip("/")
        self.endpoint = base if base.endswith("/chat/completions") else base + "/chat/completions"
        if not self.endpoint.startswith(("http://", "https://")):
            raise EndpointError(f"endpoint URL must start with http:// or https://, got {self.url!r}")
        self.retries = 0  # retries done, over all requests
        self._lock = threading.Lock()

    def ask(self, messages: list[dict]) -> str:
        """The reply's text (``choices[0].message.content``); for a 200 reply that is no chat completion, its body."""
        body = {"model": self.model_name, "messages": messages, "max_tokens": self.max_tokens,
                "temperature": self.temperature, **(self.extra_body or {})}
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        attempt = 0
        while True:
            try:
                request = urllib.request.Request(self.endpoint, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return _reply_text(response.read())
            except urllib.error.HTTPError as err:
                detail = err.read()[:300].decode("utf-8", "replace")
                if err.code < 500 and err.code not in _RETRY_STATUS:
                    raise EndpointRejected(f"{self.endpoint} answered HTTP {err.code}: {detail}") from None
                problem = f"HTTP {err.code}: {detail}"
            except (urllib.error.URLError, HTTPException, OSError) as err:  # refused, reset, timeout, cut reply
                problem = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
            if attempt >= self.max_retries:
                raise EndpointError(f"{self.endpoint}: giving up after {attempt + 1} attempts; last error {problem}")
            with self._lock:
                self.retries += 1
            time.sleep(min(self.backoff * 2**attempt, _MAX_BACKOFF))
            attempt += 1


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
    header = {"tatblimp_forced_choice": RESULTS_FORMAT, "model": client.model_name, "benchmark_md5": benchmark.md5,
              "prompt": prompt, "system_prompt": system_prompt}
    texts: dict[int, str] = _load_results(Path(results_path), header, len(conversations)) if results_path else {}
    resumed = len(texts)
    pending = [k for k in range(len(conversations)) if k not in texts]
    sink = _open_results(Path(results_path), header) if results_path else None
    failed: list[tuple[int, str]] = []
    stop = threading.Event()

    def ask(k: int) -> str:
        if stop.is_set():
            raise EndpointError("stopped after a fatal error")
        return client.ask(conversations[k])

    bar = _progress(progress, len(conversations), resumed)
    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            futures = {pool.submit(ask, k): k for k in pending}
            for future in as_completed(futures):
                k = futures[future]
                try:
                    texts[k] = future.result()
                except EndpointRejected:
                    stop.set()
                    pool.shutdown(cancel_futures=True)
                    raise
                except EndpointError as err:
                    failed.append((k, str(err)))
                    continue
                if sink is not None:
                    sink.write(json.dumps({"item": k, "pair": k // 2, "order": ORDERS[k % 2], "text": texts[k],
                                           "answer": parse_answer(texts[k])}, ensure_ascii=False) + "\n")
                    sink.flush()
                if bar is not None:
                    bar.update(1)
    finally:
        if sink is not None:
            sink.close()
        if bar is not None:
            bar.close()
    if failed:
        failed.sort()
        where = f"; the {len(texts)} answered items are in {results_path}, rerun to ask only the rest" if results_path else ""
        raise EndpointError(f"{len(failed)} of {len(conversations)} items failed (item {failed[0][0]}: {failed[0][1]}){where}")

    items = []
    for k in range(len(conversations)):
        answer = parse_answer(texts[k])
        items.append(ChoiceItem(pair=k // 2, order=ORDERS[k % 2], expected=LETTERS[k % 2], answer=answer,
                                note=None if answer else "unparsed", text=texts[k]))
    extra = {"endpoint": client.endpoint, "seconds": time.perf_counter() - start, "requests": len(pending),
             "resumed_items": resumed, "retries": client.retries}
    return compute_choice_results(benchmark, items, model=client.model_name, prompt=prompt,
                                  system_prompt=system_prompt, run_info=extra)


def _load_results(path: Path, header: dict, items: int) -> dict[int, str]:
    """Replies already in a results file; an error if it was written for another model, benchmark or prompt."""
    if not path.exists() or path.stat().st_size == 0:
        return {}
    raw = path.read_bytes()
    if not raw.endswith(b"\n"):
        # A line cut short when a run was killed mid-write: drop it, that item is asked again.
        raw = raw[: raw.rfind(b"\n") + 1]
        path.write_bytes(raw)
    lines = raw.decode("utf-8").splitlines()
    if not lines:
        return {}
    try:
        found = json.loads(lines[0])
    except ValueError:
        found = None
    if not isinstance(found, dict) or found.get("tatblimp_forced_choice") != RESULTS_FORMAT:
        raise EndpointError(f"{path}: not a tatblimp forced-choice results file; choose another results path")
    for key in ("model", "benchmark_md5", "prompt", "system_prompt"):
        if found.get(key) != header[key]:
            raise EndpointError(
                f"{path} holds answers for a different {key.replace('_', ' ')} ({found.get(key)!r}, now {header[key]!r}); "
                "choose another results path"
            )
    texts = {}
    for number, line in enumerate(lines[1:], start=2):
        try:
            record = json.loads(line)
            k, text = record["item"], record["text"]
        except (ValueError, KeyError, TypeError):
            raise EndpointError(f"{path}:{number}: not a results record") from None
        if not isinstance(k, int) or not 0 <= k < items or not isinstance(text, str):
            raise EndpointError(f"{path}:{number}: item {k!r} is not one of the {items} items, or its text is not a string")
        texts[k] = text
    return texts


def _open_results(path: Path, header: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    sink = path.open("a", encoding="utf-8")
    if new:
        sink.write(json.dumps(header, ensure_ascii=False) + "\n")
        sink.flush()
    return sink


def _progress(enabled: bool, total: int, done: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="tatblimp forced choice", unit="item")
