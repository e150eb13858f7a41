"""The pre-tokenized benchmark: every sequence's token ids and byte length as tensors on one device.

Built once (tokenization is the slow part on a CPU), then scored any number of times. One type
holds both protocols' sequences and says what the scorer reads from them:

- sentences (``build_cache``): every next token after the prefix token. Sentence ``2*i`` is pair
  ``i``'s grammatical sentence and ``2*i + 1`` its ungrammatical one;
- forced-choice prompts (``forced_choice.build_prompt_cache``, ``answer_ids`` set): the log-probs
  of the answer tokens after the last position. Prompt ``2*i`` shows pair ``i`` good first,
  ``2*i + 1`` bad first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..reading.data import Benchmark, load_benchmark
from .edit_tokens import edit_alignment
from .tokenization import encode_sentences, resolve_prefix_token_id, tokenizer_fingerprint, tokenizer_name

logger = logging.getLogger(__name__)

# 2: only special tokens the tokenizer inserted are stripped (an ordinary prefix token is kept); older caches are rebuilt.
# 3: the pairs' sentences are kept (for the results' per-pair rows).
# 4: each pair's edit alignment is kept (``edit_tokens.edit_alignment``).
CACHE_FORMAT = 4


@dataclass
class SentenceCache:
    """Token ids of all sentences (or forced-choice prompts), flat, with offsets, byte lengths and pair labels.

    ``token_ids[offsets[s]:offsets[s + 1]]`` is sentence ``s``, prefix token first (a prompt
    carries its chat template's own tokens instead).
    """

    token_ids: torch.Tensor  # [total tokens] int64
    offsets: torch.Tensor  # [sentences + 1] int64
    byte_lengths: torch.Tensor  # [sentences] int64, UTF-8 bytes of the text
    phenomenon_index: torch.Tensor  # [pairs] int64, into ``phenomena``
    subtype_index: torch.Tensor  # [pairs] int64, into ``subtypes``; -1 where a pair has none
    phenomena: list[str]
    subtypes: list[str]
    prefix_token_id: int  # put before every sentence; it also pads rows (prompts: the tokenizer's pad token)
    tokenizer_name: str
    fingerprint: str
    benchmark_source: str
    benchmark_md5: str
    benchmark_release: str
    benchmark_selection: str | None = None  # which pairs of the file, when not all (``Benchmark.select``)
    benchmark_fingerprint: str = ""  # what was scored: bytes and pairs (``identity.fingerprint``)
    benchmark_columns: dict[str, str] | None = None  # a suite's column mapping (None: the known fields)
    truncated: list[int] = field(default_factory=list)  # sentences cut to fit the model's context
    # Pairs whose two sentences differ as text but not as token ids (a tokenizer that folds whitespace or
    # compatibility characters): the model cannot tell them apart; acc ties, acc_norm goes by the byte counts.
    same_token_pairs: list[int] = field(default_factory=list)
    # Forced choice: the answer tokens whose log-probs are read after each prompt; empty: every next token is read.
    answer_ids: tuple[int, ...] = ()
    prompt: str | None = None  # forced choice: the user message template and the system message
    system_prompt: str | None = None
    sentences: list[str] = field(default_factory=list)  # the pairs' sentences, good then bad (sentence 2*i: pair i's good)
    # One character a pair, "1" where the edit starts and ends on token boundaries in both sentences, "0" where not
    # (``edit_tokens.edit_alignment``); "" when the tokenizer gives no character offsets (or for prompts).
    edit_aligned: str = ""
    # Spans: the last ``len(span_tokens)`` sequences are scored on their last ``span_tokens[k]`` tokens only
    # (lm-evaluation-harness's requests, ``engine/scored_spans.py``); their last token is a target only, so they
    # may be one token longer than the model's context, as the harness cuts its windows. Never cut.
    span_tokens: tuple[int, ...] = ()
    _host_lengths: list[int] | None = field(default=None, repr=False)

    def __post_init__(self):
        self.answer_ids = tuple(self.answer_ids)  # a list when read back from a saved cache
        self.span_tokens = tuple(self.span_tokens)

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    @property
    def num_sentences(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_pairs(self) -> int:
        return self.num_sentences // 2

    @property
    def lengths(self) -> list[int]:
        """Tokens per sentence, prefix included (a host-side list, computed once)."""
        if self._host_lengths is None:
            self._host_lengths = (self.offsets[1:] - self.offsets[:-1]).tolist()
        return self._host_lengths

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors (the cache's size on its device)."""
        return sum(getattr(self, name).nbytes for name in _TENSOR_FIELDS)

    def sentence(self, index: int) -> list[int]:
        return self.token_ids[self.offsets[index] : self.offsets[index + 1]].tolist()

    def to(self, device: torch.device | str) -> SentenceCache:
        """This cache with its tensors on ``device``."""
        return replace(self, **{name: getattr(self, name).to(device) for name in _TENSOR_FIELDS})

    def cut_to(self, max_tokens: int) -> SentenceCache:
        """A copy with every sentence longer than ``max_tokens`` cut to its first ``max_tokens`` tokens (spans never)."""
        pieces, cut = [], []
        sentences = self.num_sentences - len(self.span_tokens)
        for s, n in enumerate(self.lengths):
            start = int(self.offsets[s])
            keep = n if s >= sentences else min(n, max_tokens)
            pieces.append(self.token_ids[start : start + keep])
            if keep < n:
                cut.append(s)
        lengths = torch.tensor([p.numel() for p in pieces], dtype=torch.long, device=self.device)
        return replace(
            self,
            token_ids=torch.cat(pieces),
            offsets=torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]),
            truncated=sorted(set(self.truncated) | set(cut)),
            _host_lengths=None,
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write the cache as safetensors; metadata (names, fingerprint) goes in the header."""
        from safetensors.torch import save_file

        tensors = {name: getattr(self, name).detach().cpu().contiguous() for name in _TENSOR_FIELDS}
        metadata = {"format": str(CACHE_FORMAT), "fields": json.dumps(self._metadata_fields())}
        # Written aside and renamed: several processes (one per GPU, maybe on several hosts of a shared
        # filesystem, where process ids repeat) may save the same path at once.
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)  # e.g. under an output_dir not made yet
        partial = f"{os.fspath(path)}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.partial"
        save_file(tensors, partial, metadata=metadata)
        os.replace(partial, path)

    @classmethod
    def load(cls, path: str | os.PathLike, device: torch.device | str = "cpu") -> SentenceCache:
        from safetensors import safe_open

        with safe_open(os.fspath(path), framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != str(CACHE_FORMAT):
                raise ValueError(f"{path}: not a tatblimp cache of format {CACHE_FORMAT}")
            tensors = {name: handle.get_tensor(name).to(device) for name in _TENSOR_FIELDS}
        return cls(**json.loads(metadata["fields"]), **tensors)

    def _metadata_fields(self) -> dict[str, Any]:
        return {
            "phenomena": self.phenomena,
            "subtypes": self.subtypes,
            "prefix_token_id": self.prefix_token_id,
            "tokenizer_name": self.tokenizer_name,
            "fingerprint": self.fingerprint,
            "benchmark_source": self.benchmark_source,
            "benchmark_md5": self.benchmark_md5,
            "benchmark_release": self.benchmark_release,
            "benchmark_selection": self.benchmark_selection,
            "benchmark_fingerprint": self.benchmark_fingerprint,
            "benchmark_columns": self.benchmark_columns,
            "truncated": list(self.truncated),
            "same_token_pairs": list(self.same_token_pairs),
            "answer_ids": list(self.answer_ids),
            "prompt": self.prompt,
            "system_prompt": self.system_prompt,
            "sentences": list(self.sentences),
            "edit_aligned": self.edit_aligned,
        }


_TENSOR_FIELDS = ("token_ids", "offsets", "byte_lengths", "phenomenon_index", "subtype_index")


def cache_fingerprint(benchmark: Benchmark, tokenizer: Any, prefix_token_id: int) -> str:
    """Identifies the (data, tokenizer, prefix) a cache was built from; the data by ``Benchmark.fingerprint``
    (bytes, column mapping and selection alike)."""
    key = f"{CACHE_FORMAT}:{benchmark.fingerprint}:{tokenizer_fingerprint(tokenizer)}:{prefix_token_id}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def build_cache(
    tokenizer: Any,
    data: Benchmark | str | os.PathLike | None = None,
    *,
    device: torch.device | str = "cpu",
    prefix_token_id: int | None = None,
    allow_modified: bool = False,
    cache_path: str | os.PathLike | None = None,
) -> SentenceCache:
    """Tokenize every sentence of the benchmark once and put the tensors on ``device``.

    ``data`` is a ``Benchmark`` or anything ``load_benchmark`` accepts. With ``cache_path``, a
    cache saved there for the same data, tokenizer and prefix token is loaded instead of
    tokenizing, and a newly built cache is saved there.
    """
    benchmark = data if isinstance(data, Benchmark) else load_benchmark(data, allow_modified=allow_modified)
    prefix = resolve_prefix_token_id(tokenizer, prefix_token_id)
    fingerprint = cache_fingerprint(benchmark, tokenizer, prefix)
    if cache_path is not None and os.path.exists(cache_path):
        try:
            cached = SentenceCache.load(cache_path, device)
        except Exception:  # an unreadable or foreign file is rebuilt, never trusted
            cached = None
        if cached is not None and cached.fingerprint == fingerprint:
            # The same pairs and tokens, but this run's identity: the file may have moved, a selection kept them all.
            return replace(cached, **benchmark_identity(benchmark))

    sentences = benchmark.sentences
    encoded = encode_sentences(tokenizer, sentences, prefix)
    same = [i for i in range(len(benchmark.pairs)) if encoded[2 * i] == encoded[2 * i + 1]]
    if same:
        logger.warning(
            "tatblimp: %s: %d pairs have two sentences with the same token ids (the tokenizer folds what differs), "
            "so the model cannot tell them apart: acc ties, acc_norm goes by the byte counts; pairs %s",
            benchmark.source,
            len(same),
            ", ".join(f"#{i}" for i in same[:20]) + (", ..." if len(same) > 20 else ""),
        )
    cache = cache_from_token_lists(
        encoded,
        benchmark,
        sentences,
        prefix_token_id=prefix,
        tokenizer_name=tokenizer_name(tokenizer),
        fingerprint=fingerprint,
        same_token_pairs=same,
        edit_aligned=alignment_or_none(tokenizer, benchmark, [ids[1:] for ids in encoded]),
    )
    if cache_path is not None:
        save_or_warn(cache, cache_path)
    return cache.to(device)


def alignment_or_none(tokenizer: Any, benchmark: Benchmark, expected: list[list[int]]) -> str:
    """``edit_alignment`` of the benchmark's pairs (``expected``: their ids as cached, prefix token off); "" for a
    tokenizer that gives no character offsets."""
    try:
        return edit_alignment(tokenizer, benchmark.pairs, expected)
    except Exception as err:  # a slow tokenizer, a custom one: the scores do not need it
        logger.info("tatblimp: no edit alignment for %s (%s)", tokenizer_name(tokenizer), err)
        return ""


def save_or_warn(cache: SentenceCache, path: str | os.PathLike) -> bool:
    """Save ``cache`` to ``path`` (its folder made if missing); if it cannot be written, warn and return False.

    The file only saves tokenizing on the next run: a folder that cannot be made, a read-only path or a
    full disk must not fail the evaluation, which goes on with the cache in memory.
    """
    from safetensors import SafetensorError

    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        cache.save(path)
    except (OSError, SafetensorError) as err:
        logger.warning("tatblimp: cannot write the tokenized benchmark to %s (%s); it is kept in memory only", path, err)
        return False
    return True


def cache_from_token_lists(encoded: list[list[int]], benchmark: Benchmark, texts: list[str], **fields: Any) -> SentenceCache:
    """A cache (on the CPU) of these token lists, sequence ``k`` encoding ``texts[k]``, labelled with ``benchmark``'s pairs.

    ``fields``: the remaining ``SentenceCache`` fields (prefix token, tokenizer name, fingerprint, ...).
    """
    lengths = torch.tensor([len(ids) for ids in encoded], dtype=torch.long)
    phenomena = benchmark.phenomena
    subtypes = sorted({p.subtype for p in benchmark.pairs if p.subtype is not None})
    return SentenceCache(
        token_ids=torch.tensor([t for ids in encoded for t in ids], dtype=torch.long),
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        byte_lengths=torch.tensor([len(text.encode("utf-8")) for text in texts], dtype=torch.long),
        phenomenon_index=torch.tensor([phenomena.index(p.phenomenon) for p in benchmark.pairs], dtype=torch.long),
        subtype_index=torch.tensor(
            [subtypes.index(p.subtype) if p.subtype is not None else -1 for p in benchmark.pairs], dtype=torch.long
        ),
        phenomena=phenomena,
        subtypes=subtypes,
        sentences=benchmark.sentences,
        **benchmark_identity(benchmark),
        **fields,
    )


def benchmark_identity(benchmark: Benchmark) -> dict[str, Any]:
    """The fields that say which benchmark a cache's results belong to (its path, md5, release, selection,
    fingerprint, columns), always the current run's: a cache loaded from a file takes them from ``benchmark``,
    not from the run that saved it."""
    return {
        "benchmark_source": benchmark.source,
        "benchmark_md5": benchmark.md5,
        "benchmark_release": benchmark.release,
        "benchmark_selection": benchmark.selection,
        "benchmark_fingerprint": benchmark.fingerprint,
        "benchmark_columns": getattr(benchmark, "columns", None),
    }


def concat_caches(caches: list[SentenceCache]) -> SentenceCache:
    """One cache of the sequences of ``caches`` one after the other (for one fused pass over several suites).

    Token ids, offsets and byte lengths are concatenated; names, pair labels and truncation stay with the
    parts (the results of each part are computed from its own cache). All parts must share the prefix token.
    """
    first = caches[0]
    if len({cache.prefix_token_id for cache in caches}) > 1:
        raise ValueError("caches with different prefix tokens cannot be scored in one pass")
    starts = torch.tensor([0, *(int(c.offsets[-1]) for c in caches)], dtype=torch.long).cumsum(0)
    return replace(
        first,
        token_ids=torch.cat([c.token_ids for c in caches]),
        offsets=torch.cat([first.offsets[:1], *(c.offsets[1:] + start for c, start in zip(caches, starts.tolist()))]),
        byte_lengths=torch.cat([c.byte_lengths for c in caches]),
        phenomenon_index=first.phenomenon_index.new_empty(0),
        subtype_index=first.subtype_index.new_empty(0),
        phenomena=[],
        subtypes=[],
        fingerprint=":".join(c.fingerprint for c in caches),
        benchmark_source=", ".join(c.benchmark_source for c in caches),
        truncated=[],
        edit_aligned="".join(c.edit_aligned for c in caches) if all(c.edit_aligned for c in caches) else "",
        _host_lengths=None,
    )
