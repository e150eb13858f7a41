"""The endpoint's results file under interruption and unusual replies: Ctrl-C in a real ``tatblimp score``
process against a real loopback server, and line separators inside the replies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tatblimp_callback
from tatblimp_callback.chat.endpoint import ChatClient, evaluate_endpoint
from tatblimp_callback.cli import main
from test_endpoint import ChatServer


def reply(text: str) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}, ensure_ascii=False).encode()


def answer_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().decode("utf-8").split("\n")[1:] if line]


@pytest.mark.slow
def test_ctrl_c_sends_nothing_more_and_keeps_every_answer(small_data, tmp_path):
    answers = tmp_path / "answers.jsonl"
    answered = []

    def slow_answer(number, body):  # a 0.5 s server, as a loaded API is
        time.sleep(0.5)
        answered.append(number)
        return 200, reply("A")

    def score(url: str) -> list[str]:
        options = ["--endpoint", url, "--model-name", "tiny-chat", "--protocol", "forced-choice", "--data", str(small_data)]
        return ["score", *options, "--allow-modified", "--results", str(answers), "--concurrency", "2"]

    # A shell without job control starts background jobs with SIGINT ignored, and a child inherits that: the
    # child puts back Python's own handler, as a terminal user's process has it.
    start = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); from tatblimp_callback.cli import main"
    python = [sys.executable, "-c", f"{start}; sys.exit(main(sys.argv[1:]))"]
    with ChatServer(None, None, slow_answer) as server:
        command = [*python, *score(server.url)]
        package_root = str(Path(tatblimp_callback.__file__).parents[1])  # the package this test imported
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 240
        while len(answered) < 4 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert len(answered) >= 4, process.communicate()[1][-2000:]
        process.send_signal(signal.SIGINT)
        sent_before = len(server.requests)
        _, err = process.communicate(timeout=60)
        sent = len(server.requests)
    assert process.returncode == 130, err[-2000:]
    # 96 items, 2 at a time: at most the 2 requests on their way when Ctrl-C came (and one sent as it came).
    assert sent - sent_before <= 2 and sent < 10, (sent_before, sent)
    # Every answer the server gave was waited for and saved; a rerun asks only the rest.
    saved = answer_lines(answers)
    assert sorted(r["item"] for r in saved) == sorted(set(r["item"] for r in saved)) and len(saved) == len(answered) == sent
    assert f"{len(saved)} answers are in" in err
    with ChatServer(None, None, lambda number, body: (200, reply("A"))) as server:
        assert main(score(server.url)) == 0
        assert len(server.requests) == 96 - len(saved)


def test_line_separators_in_replies_keep_the_results_file_readable(small_data, tmp_path):
    separators = ["\u2028", "\u2029", "\u0085", "\x0c"]

    def odd_reply(number, body):
        return 200, reply(f"A{separators[number % 4]}then more")

    answers = tmp_path / "answers.jsonl"
    with ChatServer(None, None, odd_reply) as server:
        first = evaluate_endpoint(ChatClient(server.url, "tiny-chat"), small_data, results_path=answers, allow_modified=True)
        again = evaluate_endpoint(ChatClient(server.url, "tiny-chat"), small_data, results_path=answers, allow_modified=True)
    assert len(server.requests) == 96 and again.run_info["requests"] == 0 and again.run_info["resumed_items"] == 96
    assert [i.text for i in again.items] == [i.text for i in first.items]
    assert {i.text[1] for i in again.items} == set(separators) and first.overall.unparsed == 96
