"""Loading a model and its tokenizer from a folder or the Hub, with errors that say what is missing.

Shared by the commands that load a model (``tatblimp score`` and ``tatblimp sweep``), with the
options they have in common. A name that is not an existing folder or file is taken as a Hub id
only if it can be one; ``/data/my-model``, ``./x``, ``a/b/c`` that do not exist, and ``runs/nope`` where
``runs`` is a local folder, are "no such folder" at once, not a Hub error after its retries; without network, a
Hub id that is not in the local cache fails at once too (``reading/hub.py``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..reading.hub import hub_cached, hub_unreachable, unreachable_message
from ..reading.option_types import natural_int, positive_int
from ..tokenized.tokenization import SentencePieceTokenizer
from .adapters import adapter_base_model, is_adapter_folder, load_adapter_model
from .backends import add_backend_arguments, uses_vllm
from .checkpoints import run_folder_message
from .outputs import quiet_progress_bars
from .placement import add_placement_arguments, placement_options

DTYPES = ("auto", "float32", "bfloat16", "float16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that loads and scores a model."""
    parser.add_argument("--data", help="benchmark JSONL (default: $TATBLIMP_DATA, else the Hub dataset ilchats/TatBLiMP)")
    parser.add_argument("--allow-modified", action="store_true", help="accept a file that is not the official release")
    parser.add_argument("--tokenizer", help="tokenizer folder or raw SentencePiece .model (default: the model's)")
    parser.add_argument("--prefix-token-id", type=natural_int, help="token put before each sentence (default: BOS, else EOS)")
    parser.add_argument("--device", type=device_name, default=None, help="cpu, cuda, cuda:1, mps (default: cuda if available)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weights dtype (default: float32)")
    parser.add_argument(
        "--precision",
        choices=DTYPES,  # engine/precision.PRECISIONS, without importing torch for --help
        help="what scoring computes in: auto (the weights' dtype; default), float32 (bf16 weights upcast a layer at a "
        "time), bfloat16 or float16 (autocast); recorded in the results",
    )
    parser.add_argument("--memory-budget-mb", type=positive_int, help="extra memory one evaluation may use")
    parser.add_argument("--truncate", action="store_true", help="cut sentences longer than the model's context")
    parser.add_argument(
        "--head-method",
        type=head_method,
        metavar="M",
        help="how the LM head gives log-probs: tiles or chunks:N (default: timed at the first evaluation, the fastest kept)",
    )
    parser.add_argument(
        "--row-length", type=positive_int, metavar="N", help="positions per row of the forward calls (default: 256)"
    )
    add_placement_arguments(parser)
    add_backend_arguments(parser)


def model_options_given(args: argparse.Namespace) -> list[str]:
    """The options of ``add_model_arguments`` that ``args`` holds at other than their defaults, as ``--names``, but
    ``--data`` and ``--allow-modified`` (which also name the benchmark a command reads without a model)."""
    options = argparse.ArgumentParser(add_help=False)
    add_model_arguments(options)
    defaults = vars(options.parse_args([]))
    return [
        action.option_strings[0]
        for action in options._actions
        if action.dest not in ("data", "allow_modified") and getattr(args, action.dest, None) != defaults[action.dest]
    ]


def check_folder_or_hub_id(name: str | os.PathLike, what: str) -> Path | None:
    """The folder ``name`` names, or None when it is a Hub id; FileNotFoundError when it is neither.

    ``what`` ("model", "tokenizer") goes into the error message.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    path = Path(name)
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"{name}: a file, not a {what} folder")
    first = Path(path.parts[0]) if len(path.parts) > 1 and not path.is_absolute() and path.parts[0] != ".." else None
    if first is not None and first.is_dir():  # runs/nope next to a folder runs/: a mistyped path, not a Hub id
        raise FileNotFoundError(f"{name}: no such {what} folder (not taken as a Hub id: {first} is a local folder)")
    try:
        validate_repo_id(str(name))
    except HFValidationError:
        raise FileNotFoundError(f"{name}: no such {what} folder") from None
    unreachable = hub_unreachable()  # no network and not in the Hub cache: say so now, not after a minute of retries
    if unreachable and not hub_cached(str(name)):
        raise FileNotFoundError(unreachable_message(str(name), unreachable))
    return None


@quiet_progress_bars()  # transformers' "Loading weights" bar, on every command's terminal
def load_model(name_or_path: str | os.PathLike, device: str | None = None, dtype: str = "float32", **placement):
    """A causal LM from a folder saved with ``save_pretrained`` or a Hub id, in eval mode on ``device``; a
    folder with a PEFT adapter only (``adapters``) is loaded on its base model as a ``PeftModel``.

    Args:
        name_or_path: the model's folder or Hub id.
        device: None: cuda if available, else cpu. Not used with ``device_map`` or ``tp_plan``, which
            place the weights themselves.
        dtype: one of ``DTYPES``.
        **placement: ``device_map``, ``max_memory``, ``offload_folder``, ``tp_plan``, ``trust_remote_code``,
            ``revision``, ``attn_implementation`` (``placement.from_pretrained_options``).

    Raises:
        FileNotFoundError: a folder that does not exist or holds no ``config.json``.
        OSError: a Hub id that cannot be loaded.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from .placement import from_pretrained_options

    folder = check_folder_or_hub_id(name_or_path, "model")
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    if folder is not None and is_adapter_folder(folder):  # a LoRA checkpoint: loaded on its base model, placed as asked
        options = from_pretrained_options(**placement)
        model = load_adapter_model(folder, torch_dtype, **options)
        if "device_map" in options:
            return model.eval()  # placed by accelerate's dispatch (peft's, for the adapter's weights)
        return model.to(device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
    if folder is not None and not (folder / "config.json").is_file():
        message = run_folder_message(folder) or f"{folder}: no config.json; not a model folder saved with save_pretrained"
        raise FileNotFoundError(message)
    if folder is not None:
        from ..engine.model_checks import check_causal_config

        check_causal_config(folder)
    options = from_pretrained_options(**placement)
    try:
        model = _from_folder_or_hub(AutoModelForCausalLM.from_pretrained, name_or_path, folder, dtype=torch_dtype, **options)
    except ValueError as err:
        if "custom code" not in str(err) or options["trust_remote_code"]:
            raise
        raise ValueError(
            f"{name_or_path}: the model's architecture is Python code in its folder or repository; read it, then pass "
            "--trust-remote-code (trust_remote_code=True) to run it"
        ) from err
    except Exception as err:
        damaged = damaged_weight_file(folder) if folder is not None else None
        if damaged is None:
            raise
        raise OSError(f"{damaged[0]}: cannot be read, the weights file is damaged or incomplete ({damaged[1]})") from err
    if "device_map" in options or "distributed_config" in options:
        return model.eval()  # placed by accelerate's dispatch or by the tensor-parallel plan
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device).eval()


def damaged_weight_file(folder: Path) -> tuple[Path, str] | None:
    """The first weights file of ``folder`` that cannot be opened, and why; None when every one opens.

    Reads headers only (safetensors) or maps the file (torch ``.bin``), so it is cheap next to a load.
    """
    import torch
    from safetensors import safe_open

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(os.fspath(path), framework="pt") as handle:
                handle.keys()
        except Exception as err:
            return path, str(err).splitlines()[0] if str(err) else type(err).__name__
    for path in sorted(folder.glob("*.bin")):
        try:
            torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:
            return path, str(err).splitlines()[0] if str(err) else type(err).__name__
    return None


def device_name(text: str) -> str:
    """``--device``: a device torch knows, and, for CUDA, that this machine has (torch's own errors name no option)."""
    import torch  # at parse time only where the option is given

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is no device: cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            f"{text!r}: no CUDA device here (torch {torch.__version__}); --device cpu runs on the CPU"
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def head_method(text: str) -> str:
    """``--head-method``: ``tiles`` or ``chunks:N``, refused by the parser otherwise (``HeadMethod.parse``)."""
    from ..engine.head_choice import HeadMethod  # at parse time only where the option is given: torch loads with it

    try:
        HeadMethod.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def load_tokenizer(name_or_path: str | os.PathLike, **hub_options) -> Any:
    """A raw ``SentencePieceTokenizer`` for a ``.model`` file, else ``AutoTokenizer.from_pretrained``.

    The tokenizer's ``name_or_path`` is ``name_or_path`` as given, so results name the tokenizer used.
    ``hub_options`` (``revision``, ``trust_remote_code``) go to ``AutoTokenizer.from_pretrained``.
    """
    path = Path(name_or_path)
    if path.is_file() and path.suffix == ".model":
        return SentencePieceTokenizer(name_or_path)
    if path.suffix == ".model" and not path.exists():
        raise FileNotFoundError(f"{name_or_path}: no such SentencePiece model file")
    if path.is_file():
        raise FileNotFoundError(f"{name_or_path}: a file; give the tokenizer's folder, or a SentencePiece .model file")
    folder = check_folder_or_hub_id(name_or_path, "tokenizer")
    if folder is not None and not has_tokenizer_files(folder):
        raise FileNotFoundError(f"{folder} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    hub_options = {key: value for key, value in hub_options.items() if value}
    tokenizer = _from_folder_or_hub(AutoTokenizer.from_pretrained, name_or_path, folder, **hub_options)
    tokenizer.name_or_path = str(name_or_path)
    return tokenizer


def _from_folder_or_hub(from_pretrained, name_or_path, folder: Path | None, **kwargs):
    unreachable = hub_unreachable() if folder is None else None  # no network: the Hub cache only, at once
    try:
        return from_pretrained(name_or_path, **kwargs, **({"local_files_only": True} if unreachable else {}))
    except OSError as err:
        if folder is not None:
            raise
        if unreachable:
            raise FileNotFoundError(unreachable_message(str(name_or_path), unreachable)) from err
        raise OSError(f"{name_or_path}: no such folder, and not loadable from the Hub: {err}") from err


def has_tokenizer_files(folder: str | os.PathLike) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def tokenizer_source(model: str, tokenizer: str | None) -> str:
    """Where a command's tokenizer comes from: ``--tokenizer`` if given, else the model's own folder or Hub id.

    Checks ``model`` first, so that a missing model folder is reported as such.
    """
    model_folder = check_folder_or_hub_id(model, "model")
    if model_folder is not None and (message := run_folder_message(model_folder)):
        raise FileNotFoundError(message)  # not "has no tokenizer", then with --tokenizer "no config.json"
    if tokenizer is not None:
        return tokenizer
    if model_folder is not None and not has_tokenizer_files(model_folder):
        base = adapter_base_model(model_folder) if is_adapter_folder(model_folder) else None
        if base is not None and (not Path(base).is_dir() or has_tokenizer_files(base)):
            return base  # a PEFT adapter saved without its tokenizer: its base model's
        raise FileNotFoundError(
            f"the model folder {model} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "pass --tokenizer with a tokenizer folder, a Hub id or a SentencePiece .model file"
        )
    return model


def load_from_args(args: argparse.Namespace, model_dir: str):
    """(tokenizer source, tokenizer, model) for ``model_dir`` with the loader options in ``args``.

    ``--revision`` and ``--trust-remote-code`` apply to the tokenizer too when it comes from the model.
    With ``--backend vllm`` the model is not loaded here: its ``model_dir`` is what vLLM starts an engine for.
    """
    source = tokenizer_source(model_dir, args.tokenizer)
    placement = placement_options(args)
    hub_options = {"revision": placement["revision"], "trust_remote_code": placement["trust_remote_code"]}
    tokenizer = load_tokenizer(source, **(hub_options if source == model_dir else {}))
    if uses_vllm(args):
        return source, tokenizer, model_dir
    return source, tokenizer, load_model(model_dir, args.device, args.dtype, **placement)
