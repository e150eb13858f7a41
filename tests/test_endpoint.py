"""The chat-completions client (the real openai client), against a loopback server that answers from a real tiny chat model."""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from conftest import tiny_llama, write_pairs
from tatblimp_callback.chat.endpoint import ChatClient, EndpointError, EndpointRejected, evaluate_endpoint, parse_answer
from tatblimp_callback.chat.forced_choice import evaluate_forced_choice
from tatblimp_callback.cli import main


@pytest.fixture(scope="module")
def ep_data(records, tmp_path_factory):
    """The first pair of each phenomenon: 16 pairs, 32 items."""
    firsts = {}
    for record in records:
        firsts.setdefault(record["phenomenon"], record)
    return write_pairs(tmp_path_factory.mktemp("ep") / "ep.jsonl", list(firsts.values()))


@pytest.fixture(scope="module")
def model(chat_tokenizer):
    return tiny_llama(len(chat_tokenizer), max_position_embeddings=512)


class ChatServer:
    """An OpenAI-style ``/v1/chat/completions`` server on 127.0.0.1 that generates with a tiny model.

    Greedy ``model.generate`` on the chat-templated messages; with vLLM's ``guided_choice`` in the
    request, generation is restricted to those answers' tokens. ``fault(number, body)`` may return
    ``(status, body_bytes)`` to answer a request (numbered from 0) with something else. Every error
    reply carries ``Retry-After-Ms: 10``, as a loaded server says when to come back: the openai
    client honours it, which keeps the tests' retries short.
    """

    def __init__(self, model, tokenizer, fault=None):
        self.model, self.tokenizer, self.fault = model, tokenizer, fault
        self.requests: list[dict] = []
        self.authorizations: list[str | None] = []  # the Authorization header of each request
        self.replies: dict[str, str] = {}  # user message -> generated text
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def generate(self, body: dict) -> str:
        inputs = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, return_tensors="pt")
        choices = body.get("guided_choice")
        allowed = self.tokenizer.convert_tokens_to_ids(choices) if choices else None
        with self.lock, torch.no_grad():
            output = self.model.generate(
                **inputs,
                max_new_tokens=1 if choices else body["max_tokens"],
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
                prefix_allowed_tokens_fn=(lambda batch, ids: allowed) if choices else None,
            )
        return self.tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    number = len(server.requests)
                    server.requests.append(body)
                    server.authorizations.append(self.headers.get("Authorization"))
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                try:
                    status, payload = self._answer(body, number)
                finally:
                    with server.lock:  # before replying: the client may send its next request at once
                        server.in_flight -= 1
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    if status != 200:
                        self.send_header("Retry-After-Ms", "10")
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

            def _answer(self, body, number) -> tuple[int, bytes]:
                fault = server.fault(number, body) if server.fault else None
                if fault is not None:
                    status, payload = fault
                else:
                    if self.path != "/v1/chat/completions" or body.get("model") != "tiny-chat":
                        status, payload = 404, b'{"error": "no such model or path"}'
                    else:
                        text = server.generate(body)
                        server.replies[body["messages"][-1]["content"]] = text
                        reply = {
                            "object": "chat.completion",
                            "model": body["model"],
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                        }
                        status, payload = 200, json.dumps(reply).encode()
                return status, payload

        return Handler


GUIDED = {"guided_choice": ["A", "B"]}


@pytest.fixture(scope="module")
def local(model, chat_tokenizer, ep_data):
    return evaluate_forced_choice(model, chat_tokenizer, ep_data, allow_modified=True)


def test_parse_answer_is_strict():
    assert [parse_answer(t) for t in ("A", " B\n", "A.", "B. ")] == ["A", "B", "A", "B"]
    assert [parse_answer(t) for t in ("a", "AB", "A or B", "Answer: A", "**A**", "", None, "A..")] == [None] * 8


def test_endpoint_answers_equal_local_forced_choice(model, chat_tokenizer, ep_data, local):
    with ChatServer(model, chat_tokenizer) as server:
        client = ChatClient(server.url, "tiny-chat", extra_body=GUIDED)
        results = evaluate_endpoint(client, ep_data, concurrency=4, allow_modified=True)
    assert len(server.requests) == 32 and server.requests[0]["max_tokens"] == 8 and server.requests[0]["temperature"] == 0.0
    assert results.overall.unparsed == 0 and results.overall.items == 32
    # Greedy generation restricted to A/B picks the letter with the higher log-prob: the local decision.
    assert [i.answer for i in results.items] == [i.answer for i in local.items]
    assert (results.accuracy, results.both_orders, results.a_share) == (local.accuracy, local.both_orders, local.a_share)
    assert results.run_info["retries"] == 0 and 1 <= server.most_in_flight <= 4


def test_free_generation_is_parsed_strictly_and_counted(model, chat_tokenizer, ep_data):
    with ChatServer(model, chat_tokenizer) as server:
        results = evaluate_endpoint(
            ChatClient(server.url, "tiny-chat", max_tokens=3), ep_data, concurrency=3, allow_modified=True
        )
    # Each item's answer is exactly the parse of what the model generated for that prompt.
    texts = [server.replies[item_prompt] for item_prompt in _user_messages(ep_data)]
    assert [i.text for i in results.items] == texts
    parsed = [parse_answer(t) for t in texts]
    assert results.overall.unparsed == sum(p is None for p in parsed) > 0
    right = [p == "AB"[k % 2] for k, p in enumerate(parsed)]
    assert results.accuracy == pytest.approx(sum(right) / 32)
    assert results.both_orders == pytest.approx(sum(right[k] and right[k + 1] for k in range(0, 32, 2)) / 16)


def _user_messages(data) -> list[str]:
    from tatblimp_callback.chat.forced_choice import all_item_messages
    from tatblimp_callback.reading.data import load_benchmark

    return [m[-1]["content"] for m in all_item_messages(load_benchmark(data, allow_modified=True))]


def test_408_429_and_5xx_are_retried(model, chat_tokenizer, ep_data, local):
    statuses = {0: 500, 1: 408, 2: 429, 3: 502}
    fault = lambda number, body: (statuses[number], b"overloaded") if number in statuses else None  # noqa: E731
    with ChatServer(model, chat_tokenizer, fault) as server:
        client = ChatClient(server.url, "tiny-chat", extra_body=GUIDED)
        results = evaluate_endpoint(client, ep_data, concurrency=1, allow_modified=True)
    # One at a time: the first item is refused four times, then answered.
    assert len(server.requests) == 36 and client.retries == 4 and results.run_info["retries"] == 4
    assert server.requests[4] == server.requests[0]
    assert [i.answer for i in results.items] == [i.answer for i in local.items]


def test_a_reply_slower_than_the_timeout_is_retried(model, chat_tokenizer, ep_data):
    answer_a = json.dumps({"choices": [{"message": {"role": "assistant", "content": "A"}}]}).encode()

    def fault(number, body):  # every reply "A" at once, without the model, except the first
        if number == 0:
            time.sleep(3.0)  # the client gave up on this attempt after 1 s
        return 200, answer_a

    with ChatServer(model, chat_tokenizer, fault) as server:
        client = ChatClient(server.url, "tiny-chat", timeout=1.0)
        results = evaluate_endpoint(client, ep_data, concurrency=1, allow_modified=True)
    assert len(server.requests) == 33 and client.retries == 1
    assert server.requests[1] == server.requests[0]
    assert [i.answer for i in results.items] == ["A"] * 32 and results.accuracy == 0.5


def test_garbage_replies_are_counted_unparsed(model, chat_tokenizer, ep_data, local):
    prompts = _user_messages(ep_data)
    html, chatty = prompts[3], prompts[10]

    def fault(number, body):
        content = body["messages"][-1]["content"]
        if content == html:
            return 200, b"<html>502 bad gateway</html>"
        if content == chatty:
            return 200, json.dumps({"choices": [{"message": {"content": "I think the answer is A"}}]}).encode()
        return None

    with ChatServer(model, chat_tokenizer, fault) as server:
        results = evaluate_endpoint(ChatClient(server.url, "tiny-chat", extra_body=GUIDED), ep_data, allow_modified=True)
    assert results.overall.unparsed == 2 and results.flat_metrics()["tatblimp_fc/unparsed"] == 2.0
    assert results.items[3].text == "<html>502 bad gateway</html>" and results.items[3].note == "unparsed"
    assert results.items[10].answer is None and not results.items[10].correct
    local_right = [i.correct for i in local.items]
    expected = [right and k not in (3, 10) for k, right in enumerate(local_right)]
    assert results.accuracy == pytest.approx(sum(expected) / 32)
    assert "2 items with replies that are not A or B, counted as wrong" in results.format_table()


def test_results_file_resumes_failed_items(model, chat_tokenizer, ep_data, local, tmp_path):
    results_path = tmp_path / "answers.jsonl"
    prompts = _user_messages(ep_data)
    broken = set(prompts[:6])  # items 0-5 fail on every attempt in the first run
    fault = lambda number, body: (503, b"down") if body["messages"][-1]["content"] in broken else None  # noqa: E731
    with ChatServer(model, chat_tokenizer, fault) as server:
        client = ChatClient(server.url, "tiny-chat", extra_body=GUIDED, max_retries=2)
        with pytest.raises(
            EndpointError, match=r"6 of 32 items failed \(item 0: .*giving up after 3 attempts; last error HTTP 503"
        ):
            evaluate_endpoint(client, ep_data, results_path=results_path, concurrency=4, allow_modified=True)
    assert len(server.requests) == 26 + 6 * 3
    lines = results_path.read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[0])["model"] == "tiny-chat" and len(lines) == 1 + 26
    # A run killed mid-write leaves half a line; it is dropped and that item asked again.
    with results_path.open("a", encoding="utf-8") as handle:
        handle.write('{"item": 31, "pair": 15, "te')
    with ChatServer(model, chat_tokenizer) as server:
        results = evaluate_endpoint(
            ChatClient(server.url, "tiny-chat", extra_body=GUIDED), ep_data, results_path=results_path, allow_modified=True
        )
    assert len(server.requests) == 6 and results.run_info["resumed_items"] == 26 and results.run_info["requests"] == 6
    assert [i.answer for i in results.items] == [i.answer for i in local.items]
    assert len(results_path.read_text(encoding="utf-8").splitlines()) == 1 + 32
    # The file belongs to one model and prompt.
    with pytest.raises(EndpointError, match="holds answers for a different model"):
        evaluate_endpoint(ChatClient("http://127.0.0.1:9/v1", "other"), ep_data, results_path=results_path, allow_modified=True)
    # ... and one setting of what changes the answers: a rerun without guided_choice (or with another max_tokens)
    # added free-text answers beside the guided ones, with no word.
    for other in (
        ChatClient("http://127.0.0.1:9/v1", "tiny-chat"),
        ChatClient("http://127.0.0.1:9/v1", "tiny-chat", extra_body=GUIDED, max_tokens=1),
    ):
        with pytest.raises(EndpointError, match=r"holds answers for a different (extra body|max tokens)"):
            evaluate_endpoint(other, ep_data, results_path=results_path, allow_modified=True)


def test_a_rejected_request_stops_the_run(model, chat_tokenizer, ep_data):
    with ChatServer(model, chat_tokenizer) as server:
        client = ChatClient(server.url, "no-such-model")
        with pytest.raises(EndpointRejected, match=r"/v1/chat/completions answered HTTP 404: \{\"error\": \"no such model"):
            evaluate_endpoint(client, ep_data, concurrency=2, allow_modified=True)
    # Not retried, and the items not yet sent are not asked.
    assert len(server.requests) < 32 and client.retries == 0


def test_connection_refused_is_retried_then_reported(ep_data):
    with socket.socket() as probe:  # a free port with nothing listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = ChatClient(f"http://127.0.0.1:{port}/v1", "m", max_retries=1, timeout=5)
    # All 32 at once: each waits its one backoff (about 0.5 s) in parallel.
    with pytest.raises(EndpointError, match=r"32 of 32 items failed .*giving up after 2 attempts; last error APIConnectionError"):
        evaluate_endpoint(client, ep_data, concurrency=32, allow_modified=True)
    assert client.retries == 32


SECRET = "sk-tatblimp-test-0123456789abcdef"


def test_api_key_is_sent_but_never_printed_or_logged(model, chat_tokenizer, ep_data, tmp_path, caplog, capsys):
    def fault(number, body):
        return (503, b"busy") if number == 0 else (401, b'{"error": "invalid key"}') if number == 2 else None

    caplog.set_level(logging.DEBUG)  # every logger, the openai client's and its transport's included
    with ChatServer(model, chat_tokenizer, fault) as server:
        client = ChatClient(server.url, "tiny-chat", api_key=SECRET, extra_body=GUIDED)
        with pytest.raises(EndpointRejected, match="answered HTTP 401") as failure:
            evaluate_endpoint(client, ep_data, concurrency=1, results_path=tmp_path / "answers.jsonl", allow_modified=True)
    assert server.authorizations[:3] == [f"Bearer {SECRET}"] * 3
    assert "Retrying request" in caplog.text  # the client's debug log was captured, and it holds no key
    captured = capsys.readouterr()
    printed = [
        caplog.text,
        captured.out,
        captured.err,
        str(failure.value),
        repr(client),
        (tmp_path / "answers.jsonl").read_text(),
    ]
    assert not [text for text in printed if SECRET in text]


def test_base_url_and_key_from_the_environment(model, chat_tokenizer, ep_data, local, monkeypatch):
    with ChatServer(model, chat_tokenizer) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.url)
        monkeypatch.setenv("OPENAI_API_KEY", SECRET)
        client = ChatClient(None, "tiny-chat", extra_body=GUIDED)
        results = evaluate_endpoint(client, ep_data, allow_modified=True)
        assert client.endpoint == server.url + "/chat/completions"
        assert set(server.authorizations) == {f"Bearer {SECRET}"}
        # A key given explicitly wins; with none at all, keyless servers get a placeholder.
        ChatClient(None, "tiny-chat", api_key="sk-other").ask([{"role": "user", "content": "A or B?"}])
        monkeypatch.delenv("OPENAI_API_KEY")
        ChatClient(server.url, "tiny-chat").ask([{"role": "user", "content": "A or B?"}])
    assert server.authorizations[-2:] == ["Bearer sk-other", "Bearer EMPTY"]
    assert [i.answer for i in results.items] == [i.answer for i in local.items]


def test_a_key_variable_named_and_unset_sends_no_other_key(model, chat_tokenizer, ep_data, monkeypatch, capsys):
    """``--api-key-env MY_SERVER_KEY`` unset: the client fell back to ``$OPENAI_API_KEY``, sending that key to
    whatever server ``--endpoint`` names."""
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    monkeypatch.delenv("MY_SERVER_KEY", raising=False)
    with ChatServer(model, chat_tokenizer) as server:
        command = ["score", "--endpoint", server.url, "--model-name", "tiny-chat", "--protocol", "forced-choice"]
        command += ["--data", str(ep_data), "--allow-modified", "--limit", "1", "--extra-body", json.dumps(GUIDED)]
        assert main([*command, "--api-key-env", "MY_SERVER_KEY"]) == 0, capsys.readouterr().err
        assert set(server.authorizations) == {"Bearer EMPTY"}
        assert main(command) == 0  # the default variable is $OPENAI_API_KEY itself
        assert server.authorizations[-1] == f"Bearer {SECRET}"


def test_options_the_forced_choice_endpoint_would_ignore_are_refused(ep_data, capsys):
    """A suite (TatBLiMP was scored instead, exit 0) and a local model's options (ignored) with forced choice."""
    command = ["score", "--endpoint", "http://127.0.0.1:9/v1", "--model-name", "m", "--protocol", "forced-choice"]
    command += ["--data", str(ep_data), "--allow-modified"]
    assert main([*command, "--suite", f"blimp={ep_data}"]) == 1
    assert "--suite: the forced-choice protocol scores TatBLiMP's pairs only" in capsys.readouterr().err
    assert main([*command, "--dtype", "bfloat16", "--tokenizer", str(ep_data.parent)]) == 1
    assert "--tokenizer, --dtype: options of a model loaded here; an --endpoint's server runs its own" in capsys.readouterr().err
    logprob = [*command[:5], "--data", str(ep_data), "--allow-modified", "--tokenizer", str(ep_data.parent)]  # its ids: kept
    assert main([*logprob, "--truncate", "--memory-budget-mb", "1"]) == 1
    assert "--memory-budget-mb, --truncate: options of a model loaded here" in capsys.readouterr().err


def test_without_openai_the_error_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "openai", None)  # what `import openai` does where it is not installed
    with pytest.raises(ImportError, match=r"pip install 'tatblimp-callback\[endpoint\]'"):
        ChatClient("http://127.0.0.1:9/v1", "m")
    assert main(["score", "--endpoint", "http://127.0.0.1:9/v1", "--model-name", "m", "--protocol", "forced-choice"]) == 1
    assert "needs the openai client: pip install 'tatblimp-callback[endpoint]'" in capsys.readouterr().err


def test_cli_endpoint_end_to_end(model, chat_tokenizer, ep_data, local, tmp_path, capsys):
    out, answers = tmp_path / "ep.json", tmp_path / "answers.jsonl"
    with ChatServer(model, chat_tokenizer) as server:
        command = ["score", "--endpoint", server.url, "--model-name", "tiny-chat", "--protocol", "forced-choice"]
        command += ["--data", str(ep_data), "--allow-modified", "--results", str(answers)]
        code = main([*command, "--extra-body", json.dumps(GUIDED), "--concurrency", "4", "--output", str(out)])
        assert code == 0, capsys.readouterr().err
        assert "32 items (16 pairs x 2 orderings)" in capsys.readouterr().out
        payload = json.loads(out.read_text(encoding="utf-8"))
        assert payload["accuracy"] == local.accuracy and payload["both_orders"] == local.both_orders
        assert payload["model"] == "tiny-chat" and payload["requests"] == 32
        # Rerun: every answer is in the results file, so nothing is asked (with the same settings: see above).
        assert main([*command, "--extra-body", json.dumps(GUIDED)]) == 0
        assert len(server.requests) == 32
    assert main(["score", "--endpoint", server.url, "--protocol", "forced-choice", "--data", str(ep_data)]) == 1
    assert "--endpoint needs --model-name" in capsys.readouterr().err


def test_cli_endpoint_defaults_to_openai_base_url(model, chat_tokenizer, ep_data, local, monkeypatch, capsys):
    with ChatServer(model, chat_tokenizer) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.url)
        command = ["score", "--model-name", "tiny-chat", "--protocol", "forced-choice", "--data", str(ep_data)]
        assert main([*command, "--allow-modified", "--extra-body", json.dumps(GUIDED)]) == 0, capsys.readouterr().err
    assert len(server.requests) == 32 and "32 items (16 pairs x 2 orderings)" in capsys.readouterr().out
