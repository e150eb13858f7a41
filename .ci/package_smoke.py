"""Use an installed tatblimp-callback the way a user does; run by check_package.sh inside a fresh venv.

    python package_smoke.py base WORK_DIR BENCHMARK      no extras: every public name, --help, `tatblimp score`
    python package_smoke.py plot WORK_DIR BENCHMARK      with [plot]: curves drawn to a PNG
    python package_smoke.py endpoint WORK_DIR BENCHMARK  with [endpoint]: `tatblimp score --endpoint` on a loopback server

Any failure raises, so the script exits non-zero. It must run from outside the checkout, so that
the installed package is the one imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import import_module, metadata
from pathlib import Path

BIN = Path(sys.executable).parent


def tatblimp(*args: str) -> str:
    """Run the installed ``tatblimp`` command; its output, or an error with its stderr."""
    done = subprocess.run([str(BIN / "tatblimp"), *args], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"tatblimp {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def check_installed() -> None:
    package = import_module("tatblimp_callback")
    where = Path(package.__file__).resolve()
    if Path(sys.prefix).resolve() not in where.parents:
        raise SystemExit(f"imported tatblimp_callback from {where}, not from the venv {sys.prefix}")
    if package.__version__ != metadata.version("tatblimp-callback"):
        raise SystemExit(f"__version__ {package.__version__} but the wheel is {metadata.version('tatblimp-callback')}")
    if not (where.parent / "py.typed").is_file():
        raise SystemExit("py.typed is not installed")


def check_public_names() -> None:
    namespace: dict = {}
    exec("from tatblimp_callback import *", namespace)
    package = import_module("tatblimp_callback")
    missing = [name for name in package.__all__ if name not in namespace or getattr(package, name, None) is None]
    if missing:
        raise SystemExit(f"public names that do not import: {missing}")
    print(f"{len(package.__all__)} public names import, version {package.__version__}")


def make_tiny_model(work: Path, benchmark: Path) -> Path:
    """A random tiny Llama and a byte-level BPE tokenizer trained on the benchmark's sentences, saved as a user saves them."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()

    records = [json.loads(line) for line in benchmark.read_text(encoding="utf-8").splitlines()]
    sentences = [r[key] for r in records for key in ("good", "bad")]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(sentences, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    folder = work / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def check_base(work: Path, benchmark: Path) -> None:
    check_installed()
    check_public_names()
    help_text = tatblimp("--help")
    if not all(command in help_text for command in ("score", "sweep", "compare")):
        raise SystemExit(f"tatblimp --help lists no score/sweep/compare:\n{help_text}")
    model = make_tiny_model(work, benchmark)
    output = work / "score.json"
    table = tatblimp("score", str(model), "--data", str(benchmark), "--device", "cpu", "--output", str(output))
    scored = json.loads(output.read_text(encoding="utf-8"))
    if scored["n"] != 1248 or len(scored["phenomena"]) != 16 or not 0 <= scored["acc_norm"] <= 1 or "acc_norm" not in table:
        raise SystemExit(
            f"unexpected score output: n {scored['n']}, acc_norm {scored['acc_norm']}, {len(scored['phenomena'])} phenomena"
        )
    print(f"tatblimp score on a tiny random Llama: acc {scored['acc']:.3f}, acc_norm {scored['acc_norm']:.3f}")
    try:
        import openai  # noqa: F401
    except ImportError:  # as it should be without [endpoint]: the error names the extra
        from tatblimp_callback import ChatClient

        try:
            ChatClient("http://127.0.0.1:9/v1", "m")
        except ImportError as err:
            if "tatblimp-callback[endpoint]" not in str(err):
                raise SystemExit(f"the error without openai does not name the extra: {err}") from err
        else:
            raise SystemExit("ChatClient worked without openai installed")
    else:
        print("note: openai came with the base dependencies, so the missing-extra error was not checked")


def check_plot(work: Path, benchmark: Path) -> None:
    from tatblimp_callback.results.curves import plot_curves

    scored = json.loads((work / "score.json").read_text(encoding="utf-8"))  # the base check's
    metrics = {"tatblimp/acc_norm": scored["acc_norm"]}
    metrics.update({f"tatblimp/{name}/acc_norm": group["acc_norm"] for name, group in scored["phenomena"].items()})
    picture = work / "curves.png"
    plot_curves([{"step": 0, **metrics}, {"step": 10, **metrics}], picture)
    if not picture.read_bytes().startswith(b"\x89PNG"):
        raise SystemExit(f"{picture} is not a PNG")
    print(f"plot extra: drew {picture.name}, {picture.stat().st_size} bytes")


class AlwaysA(BaseHTTPRequestHandler):
    """A chat-completions server that answers every prompt with "A"."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        payload = json.dumps({"object": "chat.completion", "choices": [{"index": 0, "message": {"content": "A"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def check_endpoint(work: Path, benchmark: Path) -> None:
    subset = work / "forty_pairs.jsonl"
    subset.write_text("".join(benchmark.read_text(encoding="utf-8").splitlines(keepends=True)[:40]), encoding="utf-8")
    server = ThreadingHTTPServer(("127.0.0.1", 0), AlwaysA)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        output = work / "endpoint.json"
        tatblimp(
            "score", "--endpoint", url, "--model-name", "always-a", "--protocol", "forced-choice",
            "--data", str(subset), "--allow-modified", "--results", str(work / "answers.jsonl"), "--output", str(output),
        )  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    scored = json.loads(output.read_text(encoding="utf-8"))
    # "A" is right exactly when the good sentence is shown first: half the 80 items.
    if scored["accuracy"] != 0.5 or scored["requests"] != 80:
        raise SystemExit(f"unexpected endpoint result: accuracy {scored['accuracy']}, {scored['requests']} requests")
    print(f"endpoint extra: {scored['requests']} requests through openai {metadata.version('openai')}, accuracy 0.5")


if __name__ == "__main__":
    mode, work_dir, data = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    {"base": check_base, "plot": check_plot, "endpoint": check_endpoint}[mode](work_dir, data)
