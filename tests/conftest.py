"""Shared fixtures: the real benchmark from ../shared, small tokenizers and tiny random Llamas."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TATBLIMP_SHARED", REPO.parent / "shared"))
DATA = SHARED / "tatblimp" / "test.jsonl"
CORPUS = SHARED / "tatar-corpus" / "train.txt"
SPM_MODEL = SHARED / "tokenizers" / "kypchak_unigram_48k.model"
BLIMP = SHARED / "blimp" / "data"

# The test models are tiny: one thread is as fast, and two threads on a busy 2-core machine are many times slower.
torch.set_num_threads(1)


def load_module(path: Path, name: str | None = None):
    """The Python file at ``path`` (a benchmark, an example, a docs hook) imported as a module of its own."""
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    if not DATA.exists():
        raise pytest.UsageError(f"the benchmark is not at {DATA}; set TATBLIMP_SHARED to the shared/ folder")


def write_pairs(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def records() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="session")
def small_data(tmp_path_factory, records) -> Path:
    """Three pairs of each phenomenon (48 pairs): a modified benchmark, quick to score."""
    seen: dict[str, int] = {}
    subset = []
    for record in records:
        if seen.get(record["phenomenon"], 0) < 3:
            seen[record["phenomenon"]] = seen.get(record["phenomenon"], 0) + 1
            subset.append(record)
    return write_pairs(tmp_path_factory.mktemp("data") / "small.jsonl", subset)


def train_bpe(vocab_size: int = 800, bos: bool = True, lines: int = 4000):
    """A byte-level BPE tokenizer trained on the shared Tatar corpus, wrapped as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = CORPUS.read_text(encoding="utf-8").splitlines()[:lines]
    tokenizer.train_from_iterator(text, trainer)
    kwargs = {"pad_token": "<pad>", "eos_token": "</s>"}
    if bos:
        kwargs["bos_token"] = "<s>"
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **kwargs)


@pytest.fixture(scope="session")
def bpe_tokenizer():
    return train_bpe()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, bpe_tokenizer):
    """A tiny random Llama and the BPE tokenizer saved in one folder, as `tatblimp score` reads a model."""
    folder = tmp_path_factory.mktemp("model")
    tiny_llama(len(bpe_tokenizer)).save_pretrained(folder)
    bpe_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def eos_only_tokenizer():
    return train_bpe(bos=False)


# A minimal chat template: "A" and "B" after the generation prompt's newline are single byte-level tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_tokenizer(bpe_tokenizer):
    """A copy of ``bpe_tokenizer`` with ``CHAT_TEMPLATE``, for the forced-choice protocol."""
    import copy

    tokenizer = copy.deepcopy(bpe_tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def local_tasks(tmp_path_factory):
    """A folder of the local lm-evaluation-harness tasks (``harness_tasks.write_tasks``: BLiMP subset, MC, rolling)."""
    from harness_tasks import write_tasks

    return write_tasks(tmp_path_factory.mktemp("tasks"), BLIMP, CORPUS)


def tiny_llama(vocab_size: int, seed: int = 0, hidden: int = 32, layers: int = 2, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    options = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config = LlamaConfig(**{**options, **overrides})
    model = LlamaForCausalLM(config)
    # Random init gives near-uniform predictions; larger weights make log-probs differ clearly between tokens.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.5)
    return model.eval()


def reference_logprobs(model, sentences_ids: list[list[int]]) -> list[float]:
    """The definition, computed plainly: one sentence at a time, full log-softmax in float64."""
    values = []
    with torch.no_grad():
        for ids in sentences_ids:
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits[0, :-1].double()
            values.append(float(logits.log_softmax(-1).gather(-1, x[0, 1:, None]).sum()))
    return values


def ignore_tree_masks(monkeypatch) -> None:
    """Make every model drop a custom 4D mask and build its own causal one, as some architectures do."""
    import transformers.masking_utils as masking_utils

    preprocess = masking_utils._preprocess_mask_arguments

    def drop_4d_masks(config, inputs_embeds, attention_mask, *args, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return preprocess(config, inputs_embeds, attention_mask, *args, **kwargs)

    monkeypatch.setattr(masking_utils, "_preprocess_mask_arguments", drop_4d_masks)


def peak_allocation(prof) -> int:
    """The peak of the bytes allocated and not yet freed during a ``torch.profiler.profile(profile_memory=True)``."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
    current = peak = 0
    for _, size in sorted(events):
        current += size
        peak = max(peak, current)
    return peak
