"""The Python entry points: ``evaluate`` for one score, ``Evaluator`` for repeated scoring in a loop."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .engine import distributed
from .engine.exact_decisions import decide_exactly
from .engine.kept_scorer import scorer_for
from .engine.memory_budget import check_sizes
from .engine.model_checks import weights_label
from .engine.precision import check_precision, precision_name
from .engine.scored_spans import Spans
from .engine.scoring import Scorer, ScoringMethod, unwrap_model
from .engine.vllm_scoring import BACKENDS, VllmOptions, VllmScorer, engine_tokenizer, is_vllm_engine
from .engine.word_surprisal import add_region_surprisal
from .reading.data import Benchmark
from .reading.option_types import check_flags
from .reading.suites import Suite, check_suites, load_suite
from .results.metrics import Results, compute_results
from .results.provenance import provenance
from .results.token_results import pair_tokens
from .tokenized.cache import SentenceCache, build_cache, concat_caches
from .tokenized.edit_tokens import cut_byte_lengths
from .tokenized.tokenization import check_prefix_token_id, check_tokenizer

logger = logging.getLogger(__name__)


class Evaluator:
    """Holds the tokenized benchmark and a scorer, so each evaluation is a forward pass and nothing more.

    The benchmark is read and tokenized at the first call, on the model's device, and kept; each call
    scores every pair with the model it is given.

    Example:
        In a custom training loop:

        ```python
        evaluator = Evaluator(tokenizer, data="test.jsonl")
        for step in ...:
            if step % 500 == 0:
                results = evaluator(model)
                print(step, results.acc_norm)
        ```

    More minimal-pair suites (BLiMP, TurBLiMP, MultiBLiMP, your own; see ``suites``) go into the same
    cache and the same forward sweep, sentences that start alike sharing their positions across suites:

    ```python
    evaluator = Evaluator(tokenizer, data="test.jsonl", suites={"blimp": "blimp/data"})
    results = evaluator(model)  # results.suites["blimp"] is a full Results, with left_out
    results = evaluator(model, suites=[])  # TatBLiMP alone this time (a big suite scored less often)
    ```

    Args:
        tokenizer: a Hugging Face tokenizer or a ``SentencePieceTokenizer``; not needed with ``cache``.
        data: a ``Benchmark``, a JSONL path, or None for ``TATBLIMP_DATA`` / the Hub dataset.
        cache: an already built ``SentenceCache``; it is moved to the model's device.
        prefix_token_id: the token put before every sentence (default: BOS, else EOS).
        allow_modified: accept a benchmark file that is not the official release.
        memory_budget: extra bytes one evaluation may use (default: from free device memory). This and
            ``truncate`` and ``method`` may be changed between calls (``evaluator.memory_budget = ...``): the
            next call makes a scorer with them; ``data``, ``tokenizer`` and ``prefix_token_id`` too, and the next
            call tokenizes the benchmark again.
        truncate: cut sentences longer than the model's context instead of raising.
        method: force a scoring method (a ``ScoringMethod``, or a layout: "tree", "packed", "padded");
            default: chosen and checked by the scorer.
        head_method: force how the LM head gives log-probs ("tiles" or "chunks:N"); default: timed at the
            first evaluation, the fastest exact one kept (``engine/head_choice.py``).
        row_length: positions per row (default: ``scoring.DEFAULT_ROW_LENGTH``, at least the longest sentence).
        cuda_graphs: on a CUDA device, replay the plan's forward calls as CUDA graphs (``engine/cuda_graphs.py``;
            the same numbers, bit for bit); False: launch them one by one, as without graphs.
        compile: ``torch.compile`` the scoring forward for the plan's shapes (``engine/compiled_forward.py``); off by
            default, since the first compile takes about a minute on a GPU (see the long-runs guide).
        cache_path: a safetensors file to load the cache from, or to save it to once built (each suite's
            next to it, as ``<stem>.<name><suffix>``).
        suites: more suites to score in the same pass, ``{name: path or Suite}`` (a path is read with
            ``suites.load_suite``); their results are in ``results.suites[name]``.
        include_tokens: also give each pair's token log-probs, token texts and edit span
            (``Results.pair_tokens``, see ``token_results``); the texts need ``tokenizer``.
        backend: "transformers" (the default: the model is a ``torch.nn.Module``) or "vllm": the model is
            a folder or Hub id that a vLLM engine is started for (with ``vllm_options``), or a ``vllm.LLM``
            (taken as vLLM's whatever ``backend`` says); see ``vllm_scoring``.
        vllm_options: the engine's options (``vllm_scoring.VllmOptions``) with ``backend="vllm"`` and a path.
        spans: token sequences scored on their last tokens only, in the same pass (``scored_spans.Spans``:
            lm-evaluation-harness's requests, ``harness.in_training``); after each call ``span_scores`` holds
            each one's ``(log-prob, is_greedy)``.
        precision: what the model computes in while scored (``engine/precision.py``): "auto" (the default: the
            autocast dtype where it trains under autocast, as the Trainer's ``bf16=True`` does, else its weights'
            dtype), "float32", "bfloat16" or "float16"; recorded as ``run_info["precision"]``.
        exact_decisions: below float32, score again in float32 the pairs whose margin is within rounding, and decide
            them by that (``engine/exact_decisions.py``; ``run_info["exact_decisions"]``, ``pairs[i].rescored``).

    Raises:
        ValueError: neither ``tokenizer`` nor ``cache`` is given, ``spans`` with a prebuilt cache or vLLM, an
            unknown ``precision``, or an option of the wrong kind (``tokenizer`` a path, ``suites`` not
            ``{name: path or Suite}``, a flag that is not True or False, a size or ``prefix_token_id`` that is not a
            whole number), named with its value.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        data: Benchmark | str | os.PathLike | None = None,
        *,
        cache: SentenceCache | None = None,
        prefix_token_id: int | None = None,
        allow_modified: bool = False,
        memory_budget: int | None = None,
        truncate: bool = False,
        method: ScoringMethod | str | None = None,
        head_method: str | None = None,
        row_length: int | None = None,
        cuda_graphs: bool = True,
        compile: bool = False,
        cache_path: str | os.PathLike | None = None,
        suites: Mapping[str, Suite | str | os.PathLike] | None = None,
        include_tokens: bool = False,
        backend: str = "transformers",
        vllm_options: VllmOptions | None = None,
        spans: Spans | None = None,
        precision: str = "auto",
        exact_decisions: bool = True,
    ):
        if tokenizer is None and cache is None:
            raise ValueError("Evaluator needs a tokenizer or a prebuilt cache")
        if (suites or spans) and cache is not None:
            raise ValueError(f"{'suites' if suites else 'spans'}= needs a tokenizer, not a prebuilt cache")
        if spans and backend != "transformers":
            raise ValueError("spans= are scored by the transformers backend only")
        check_sizes(memory_budget, row_length)
        check_tokenizer(tokenizer)
        check_prefix_token_id(prefix_token_id)
        check_suites(suites)
        check_flags(
            allow_modified=allow_modified,
            truncate=truncate,
            cuda_graphs=cuda_graphs,
            compile=compile,
            include_tokens=include_tokens,
            exact_decisions=exact_decisions,
        )
        self.tokenizer = tokenizer
        self.data = data
        self.cache = cache
        self.prefix_token_id = prefix_token_id
        self.allow_modified = allow_modified
        self.memory_budget = memory_budget
        self.truncate = truncate
        self.method = method
        self.head_method = head_method
        self.row_length = row_length
        self.cuda_graphs, self.compile = cuda_graphs, compile
        self.cache_path = cache_path
        self.suites = {name: s if isinstance(s, Suite) else load_suite(name, s) for name, s in (suites or {}).items()}
        self._parts: list[tuple[str | None, SentenceCache, int]] = []  # (suite name or None, its cache, first sentence)
        self.include_tokens = include_tokens
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.vllm_options = vllm_options
        self._scorer: Scorer | VllmScorer | None = None
        self.spans = spans
        self.precision = check_precision(precision)
        self.exact_decisions = exact_decisions
        self._spans_start = 0  # the first span's index in the fused cache
        self.span_scores: list[tuple[float, bool]] = []  # the latest call's (log-prob, is_greedy) of each span

    def prepare(self, model: torch.nn.Module) -> Scorer:
        """Build (or move) the cache to the model's device and set up the scorer; done once per model."""

        def build(device: torch.device) -> SentenceCache:
            sources = [
                (None, self.data, self.cache_path),
                *((n, s, _suite_cache_path(self.cache_path, n)) for n, s in self.suites.items()),
            ]
            caches = [
                build_cache(
                    self.tokenizer,
                    data,
                    device="cpu",  # the parts stay on the host for the results; the fused cache goes to the device
                    prefix_token_id=self.prefix_token_id,
                    allow_modified=self.allow_modified,
                    cache_path=path,
                )
                for _, data, path in sources
            ]
            starts = [0, *torch.tensor([c.num_sentences for c in caches]).cumsum(0).tolist()]
            # The parts keep their labels and byte lengths for the results; their token ids live in the fused cache only.
            self._parts = [
                (name, replace(cache, token_ids=cache.token_ids.new_empty(0), _host_lengths=cache.lengths), start)
                for (name, _, _), cache, start in zip(sources, caches, starts)
            ]
            if self.spans:  # last, with the padding token of the others; no results of their own
                self._spans_start = starts[-1]
                caches.append(self.spans.cache(caches[0].prefix_token_id))
            fused = concat_caches(caches) if len(caches) > 1 else caches[0]
            return replace(fused, span_tokens=tuple(self.spans.scored) if self.spans else ()).to(device)

        options = dict(memory_budget=self.memory_budget, truncate=self.truncate, method=self.method, head_method=self.head_method)
        options["precision"] = check_precision(self.precision)
        if self.row_length is not None:
            options["row_length"] = self.row_length
        options.update(cuda_graphs=self.cuda_graphs, compile=self.compile)
        scorer = scorer_for(self, model, build, **options)
        scorer.keep_token_logprobs = self.include_tokens
        return scorer

    def close(self) -> None:
        """Let the last model's scorer go; a vLLM engine this evaluator started is shut down (the tokenized cache stays)."""
        close = getattr(self._scorer, "close", None)
        if close is not None:
            close()
        self._scorer = None

    def _region_surprisal(self, records, model, cache) -> None:
        """With ``include_tokens``: each pair's critical-region surprisal (``engine/word_surprisal.py``), a pass of its
        own, run by every process alike (the unwrapped model's forward holds no collective); not for a model sharded
        over the processes (FSDP, ZeRO-3), whose forward is one, and which the pass's calls would leave out of step."""
        if self.tokenizer is None or not isinstance(model, torch.nn.Module):
            return
        if distributed.world()[1] > 1 and distributed.is_sharded(model):
            logger.warning("tatblimp: no critical-region surprisal for a model sharded over processes (FSDP, ZeRO-3)")
            return
        add_region_surprisal(records, unwrap_model(model), cache, self.tokenizer)  # in scoring_mode, as every pass

    def __call__(self, model: torch.nn.Module, suites: list[str] | None = None, *, weights: str | None = None) -> Results:
        """Score every pair with ``model`` and return the results.

        Under ``torch.distributed`` every process calls this; each scores a share of the batches
        and all of them return the same results. A failure on one process raises on all of them.

        Args:
            model: a causal LM (``AutoModelForCausalLM``), bare or wrapped in DDP, FSDP, ``torch.compile``
                or PEFT; it is scored in eval mode without gradients and put back in the mode it was in.
                With ``backend="vllm"``: a model folder or Hub id, or a ``vllm.LLM``.
            suites: the names of the suites to score this time (default: all); TatBLiMP is always scored.
            weights: the ``weights_label`` of ``model``'s weights as they are now, when the caller has just taken
                it (the training callbacks): not hashed again. None: taken here.

        Returns:
            The metrics overall, per phenomenon and subtype, and per pair.

        Raises:
            BenchmarkError: the benchmark file cannot be read, is malformed, or is not the official release
                (without ``allow_modified``).
            TokenizationError: no prefix token can be found, or a sentence encodes to no tokens.
            ScoringError: the model cannot score the benchmark (weights on the meta device, a vocabulary
                smaller than the tokenizer's, a sentence longer than its context without ``truncate``).
            PeerFailure: under ``torch.distributed``, scoring failed on another process.
        """
        with distributed.shared_failures():  # the other processes are about to check in
            scorer = self.prepare(model)
        if not self._parts:  # a prebuilt cache: TatBLiMP alone
            logprobs, run_info = timed_score(scorer, weights=weights)
            run_info.update(cache_bytes=scorer.cache.nbytes, prefix_token_id=scorer.cache.prefix_token_id)
            results = compute_results(scorer.cache, logprobs, run_info, self._decide_exactly(scorer, logprobs, run_info))
            if self.include_tokens:
                results.pair_tokens = pair_tokens(scorer.cache, scorer.token_logprobs(), self.tokenizer)
                self._region_surprisal(results.pair_tokens, model, scorer.cache)
            return results
        if isinstance(suites, str):
            raise ValueError(f"suites= takes a list of suite names, got the string {suites!r}: suites=[{suites!r}]")
        wanted = list(self.suites) if suites is None else list(suites)
        unknown = sorted(set(wanted) - set(self.suites))
        if unknown:
            raise ValueError(f"unknown suites {unknown}; this evaluator has {sorted(self.suites)}")
        parts = [part for part in self._parts if part[0] is None or part[0] in wanted]
        chosen = None
        if len(parts) < len(self._parts):
            chosen = [s for _, cache, start in parts for s in range(start, start + cache.num_sentences)]
            chosen += range(self._spans_start, scorer.cache.num_sentences) if self.spans else []
        logprobs, run_info = timed_score(scorer, chosen, weights)
        run_info.update(cache_bytes=scorer.cache.nbytes, prefix_token_id=scorer.cache.prefix_token_id)
        exact = self._decide_exactly(scorer, logprobs, run_info, chosen)
        if self.spans:
            span_logprobs = logprobs[self._spans_start :].tolist()
            self.span_scores = list(zip(span_logprobs, scorer.spans.greedy(), strict=True))
        results = None
        for name, cache, start in parts:
            end = start + cache.num_sentences
            cut = [s - start for s in scorer.cache.truncated if start <= s < end]
            # Token counts as scored: a sentence cut to the model's context counts its kept tokens.
            scored = replace(cache, truncated=cut, _host_lengths=scorer.cache.lengths[start:end])
            if cut:  # per byte of the text scored: the kept tokens' (acc_norm of a pair cut before its edit ties)
                scored = replace(scored, byte_lengths=self._scored_bytes(scored, scorer.cache, start))
            rescored = exact and (exact[0][start:end], exact[1][start // 2 : end // 2])
            part = compute_results(scored, logprobs[start:end], run_info, rescored)
            if self.include_tokens:  # TatBLiMP's and each suite's, from their sentences of the fused cache
                part.pair_tokens = self._pair_tokens(scorer, model, cache, start)
            if name is None:
                results = part
                if isinstance(self.data, Suite):  # a suite scored alone
                    results.left_out = [dict(entry) for entry in self.data.left_out]
            else:
                part.left_out = [dict(entry) for entry in self.suites[name].left_out]
                results.suites[name] = part
        return results

    def _pair_tokens(self, scorer, model, part: SentenceCache, start: int) -> list:
        """``include_tokens``' records of the pairs of ``part``, whose sentences start at ``start`` in the scorer's
        fused cache, with their critical-region surprisal."""
        end = start + part.num_sentences
        first = int(scorer.cache.offsets[start])
        own = replace(
            scorer.cache,
            token_ids=scorer.cache.token_ids[first : int(scorer.cache.offsets[end])],
            offsets=scorer.cache.offsets[start : end + 1] - first,
            sentences=part.sentences,
            _host_lengths=None,
        )
        records = pair_tokens(own, scorer.token_logprobs()[start:end], self.tokenizer)
        self._region_surprisal(records, model, own)
        return records

    def _scored_bytes(self, part: SentenceCache, fused: SentenceCache, start: int) -> torch.Tensor:
        """``part``'s byte lengths, its cut sentences' those their kept tokens cover (``cut_byte_lengths``); the whole
        sentences' where the tokenizer gives no character offsets, said so."""
        found = None if self.tokenizer is None else cut_byte_lengths(self.tokenizer, part, fused, start)
        if found is None:
            logger.warning(
                "tatblimp: no character offsets from this tokenizer: acc_norm of a cut sentence divides by its whole bytes"
            )
        return part.byte_lengths if found is None else found

    def _decide_exactly(self, scorer, logprobs, run_info, sequences=None) -> tuple | None:
        """``(log-probs, rescored pairs)`` to decide by (``exact_decisions.decide_exactly``), recorded in ``run_info``."""
        exact = decide_exactly(scorer, logprobs, sequences) if self.exact_decisions and isinstance(scorer, Scorer) else None
        if exact is None:
            return None
        run_info["exact_decisions"] = exact[2]
        return exact[0], exact[1]


def timed_score(
    scorer: Scorer, sequences: range | list[int] | None = None, weights: str | None = None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``scorer.score(sequences)``, and how it was computed: the method, seconds, padding and sharing, retries,
    ``weights``, the label (``model_checks.weights_label``) of the weights it measured (given: the caller's label
    of them, taken just before; it hashes every weight), and what made it (``provenance``: versions, dtype,
    device, date), and the ``backend`` that scored."""
    if isinstance(scorer, VllmScorer):
        start = time.perf_counter()
        logprobs = scorer.score(sequences)
        seconds = time.perf_counter() - start
        info = {"backend": "vllm", "scoring_method": "vllm", "seconds": seconds, "startup_seconds": scorer.startup_seconds}
        return logprobs, {**info, "weights": None, **provenance(), **scorer.describe()}
    if weights is None:
        weights = weights_label(scorer.lm)  # before: the weights measured
    start = time.perf_counter()
    logprobs = scorer.score() if sequences is None else scorer.score(sequences)  # as before when all are scored
    seconds = time.perf_counter() - start
    layout = scorer.layout(sequences=sequences)
    return logprobs, {
        "backend": "transformers",
        "scoring_method": str(scorer.method),
        "head_method": None if scorer.head_method is None else str(scorer.head_method),
        "head_choice": scorer.head_choice,
        "seconds": seconds,
        "padding_share": layout.padding_share,
        "saved_by_prefix_sharing": layout.saved_by_prefix_sharing,
        "oom_retries": scorer.oom_retries,
        "method_replacements": scorer.method_replacements,
        "weights": weights,
        **provenance(scorer.model),
        "precision": precision_name(scorer.precision),  # what the forwards computed in (``dtype``: the weights')
    }


def evaluate(
    model: torch.nn.Module, tokenizer: Any = None, data: Benchmark | str | os.PathLike | None = None, **options
) -> Results:
    """Score ``model`` on TatBLiMP (or another minimal-pair file) once.

    ``options`` are those of ``Evaluator`` (``suites={"blimp": PATH}`` among them). For repeated scoring keep an ``Evaluator``, which
    tokenizes only once.

    Args:
        model: a causal LM (``AutoModelForCausalLM``), on the device it should be scored on; with
            ``backend="vllm"`` a model folder or Hub id, or a ``vllm.LLM``.
        tokenizer: its Hugging Face tokenizer, or a ``SentencePieceTokenizer`` for a model trained on raw
            sentencepiece ids; not needed with ``cache=``, nor with a ``vllm.LLM`` (``llm.get_tokenizer()``).
        data: a ``Benchmark``, a JSONL path, or None for ``$TATBLIMP_DATA``, else the Hub dataset
            ``ilchats/TatBLiMP``.
        **options: keyword arguments of ``Evaluator`` (``prefix_token_id``, ``allow_modified``,
            ``memory_budget``, ``truncate``, ``method``, ``cuda_graphs``, ``compile``, ``cache``, ``cache_path``,
            ``include_tokens``, ``suites``, ``backend``, ``vllm_options``, ``precision``).

    Returns:
        The metrics overall, per phenomenon and subtype, and per pair.

    Raises:
        BenchmarkError: the benchmark file cannot be read, is malformed, or is not the official release.
        TokenizationError: no prefix token can be found, or a sentence encodes to no tokens.
        ScoringError: the model cannot score the benchmark (see ``Evaluator.__call__``).

    Example:
        ```python
        results = evaluate(model, tokenizer, "test.jsonl")
        print(results.acc_norm, results.phenomena["binding"].acc_norm)
        ```
    """
    if tokenizer is None and options.get("cache") is None and is_vllm_engine(model):
        tokenizer = engine_tokenizer(model)  # the one the engine loaded
    evaluator = Evaluator(tokenizer, data, **options)
    try:
        return evaluator(model)
    finally:
        evaluator.close()  # a vLLM engine started for this one call


def _suite_cache_path(cache_path: str | os.PathLike | None, name: str) -> Path | None:
    """Where suite ``name``'s tokenized cache is kept beside TatBLiMP's ``cache_path``."""
    if cache_path is None:
        return None
    path = Path(cache_path)
    return path.with_name(f"{path.stem}.{name}{path.suffix}")
