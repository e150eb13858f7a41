"""TatBLiMP's metrics, from per-sentence log-probabilities.

- acc: share of pairs with logP(good) > logP(bad), strictly; a tie fails.
- acc_norm (primary): the same with each logP divided by the sentence's UTF-8 byte length.

Pairs whose log-probs are not finite (NaN or inf from a diverging model) are left out of the
metrics, counted, and flagged; the metrics over the remaining pairs are still given.

Each accuracy comes with its 95% Wilson interval (``acc_ci``, ``acc_norm_ci``), and ``to_dict`` carries
every pair's outcome of both metrics (``outcomes``; see ``stats.py``) so that two results can be
compared pair by pair.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..reading.edit import find_edit
from ..tokenized.cache import SentenceCache
from .group_metrics import GroupResult, group_result, grouped
from .stats import encode_outcomes, format_interval, run_lengths
from .token_results import add_token_fields


@dataclass
class PairResult:
    good_logprob: float
    bad_logprob: float
    good_tokens: int  # scored tokens (the prefix token is not scored)
    bad_tokens: int
    good_bytes: int
    bad_bytes: int
    phenomenon: str
    subtype: str | None
    good: str = ""  # the sentences ("" for a cache written before they were kept)
    bad: str = ""
    # Where scored again in float32 (``exact_decisions``): decided by these; the log-probs above stay the fast ones.
    float32_good_logprob: float | None = None
    float32_bad_logprob: float | None = None

    @property
    def finite(self) -> bool:
        """Both log-probs finite: a pair that is not is left out of the metrics."""
        return math.isfinite(self.good_logprob) and math.isfinite(self.bad_logprob)

    @property
    def rescored(self) -> bool:
        return self.float32_good_logprob is not None

    @property
    def passed(self) -> bool:
        good, bad = self._decided()
        return good > bad

    @property
    def passed_norm(self) -> bool:
        good, bad = self._decided()
        return good / self.good_bytes > bad / self.bad_bytes

    def _decided(self) -> tuple[float, float]:
        return (self.float32_good_logprob, self.float32_bad_logprob) if self.rescored else (self.good_logprob, self.bad_logprob)


@dataclass
class Results:
    """All of one evaluation: overall, per phenomenon and subtype, and per pair (file order).

    Returned by ``evaluate``, ``Evaluator`` and the callback (``callback.last_results``). The headline numbers
    are properties: ``acc``, ``acc_norm`` (the primary metric), their 95% Wilson intervals ``acc_ci`` and
    ``acc_norm_ci``, and ``non_finite_pairs`` (pairs left out for NaN or inf log-probs).

    Attributes:
        overall: the metrics over all pairs with finite log-probs.
        phenomena: the same per phenomenon, by name, in file order.
        subtypes: the same per subtype.
        pairs: every pair's log-probs, token and byte counts, and outcome, in file order.
        benchmark_md5: the md5 of the file scored.
        benchmark_release: "TatBLiMP v1.0 (2026-06-19)" for the official file, else "modified (md5 ...)".
        benchmark_source: the path of the file scored.
        tokenizer: the tokenizer's name or path.
        tokens: scored tokens over all sentences (the prefix token excluded).
        bytes: UTF-8 bytes over all sentences.
        truncated_sentences: sentences cut to the model's context (with ``truncate``).
        same_token_pairs: pairs whose two sentences the tokenizer turns into the same token ids (flagged, not
            left out: acc ties there, acc_norm goes by the byte counts).
        selection: which pairs were scored when not all (``--limit``, ``--phenomena``); None: all.
        benchmark_fingerprint: what was scored, the bytes and the pairs (``identity.fingerprint``).
        benchmark_columns: a suite's column mapping; None: the known fields.
        run_info: how it was computed: the scoring method, seconds, padding and prefix sharing, retries, model.
        left_out: a suite's pairs that could not be scored (``{"file", "line", "reason"}``); None: not a suite.
        suites: the results of the other suites scored in the same pass, by name.
        pair_tokens: per-pair token log-probs, texts and edit spans, when asked for (``include_tokens``).

    Example:
        ```python
        results = evaluate(model, tokenizer, "test.jsonl")
        print(f"{results.acc_norm:.3f} {results.acc_norm_ci}")
        print(results.format_table())
        json.dump(results.to_dict(), open("results.json", "w"))
        ```
    """

    overall: GroupResult
    phenomena: dict[str, GroupResult]
    subtypes: dict[str, GroupResult]
    pairs: list[PairResult]
    benchmark_md5: str
    benchmark_release: str
    benchmark_source: str
    tokenizer: str
    tokens: int  # scored tokens over all sentences
    bytes: int  # UTF-8 bytes over all sentences
    truncated_sentences: int = 0
    same_token_pairs: list[int] = field(default_factory=list)
    selection: str | None = None  # which pairs were scored when not all (--limit, --phenomena); None: all
    run_info: dict[str, Any] = field(default_factory=dict)  # how it was computed: method, seconds, retries, model, ...
    # A suite's pairs that could not be scored, left out of every metric: {"file", "line", "reason"}; None: not a suite.
    left_out: list[dict[str, Any]] | None = None
    suites: dict[str, Results] = field(default_factory=dict)  # the other suites scored in the same pass, by name
    # Per-pair token log-probs, texts and edit spans (``token_results.PairTokens``), when asked for.
    pair_tokens: list[Any] | None = None
    # "1"/"0" a pair: the edit starts and ends on token boundaries in both sentences (``edit_tokens``); "": unknown.
    edit_aligned: str = ""
    benchmark_fingerprint: str = ""
    benchmark_columns: dict[str, str] | None = None

    @property
    def acc(self) -> float:
        return self.overall.acc

    @property
    def acc_norm(self) -> float:
        return self.overall.acc_norm

    @property
    def acc_ci(self) -> tuple[float, float]:
        return self.overall.acc_ci

    @property
    def acc_norm_ci(self) -> tuple[float, float]:
        return self.overall.acc_norm_ci

    @property
    def non_finite_pairs(self) -> int:
        return self.overall.non_finite

    @property
    def non_finite_sentences(self) -> int:
        """Sentences whose log-prob is NaN or inf."""
        return sum(not math.isfinite(p.good_logprob) for p in self.pairs) + sum(
            not math.isfinite(p.bad_logprob) for p in self.pairs
        )

    @property
    def partial(self) -> bool:
        """True when the metrics do not cover the whole benchmark: some pairs had non-finite log-probs and are
        left out, or only some were scored (``selection``)."""
        return self.overall.non_finite > 0 or self.selection is not None

    @property
    def bits_per_byte_good(self) -> float:
        """Bits per UTF-8 byte of the grammatical sentences."""
        finite = [p for p in self.pairs if math.isfinite(p.good_logprob)]
        return -sum(p.good_logprob for p in finite) / math.log(2) / max(sum(p.good_bytes for p in finite), 1)

    def to_dict(self) -> dict[str, Any]:
        """The JSON written by ``tatblimp score --output`` (with ``pair_tokens``: their fields in ``pairs[i]``)."""
        record = {
            "acc": self.acc,
            "acc_norm": self.acc_norm,
            "acc_ci": list(self.acc_ci),
            "acc_norm_ci": list(self.acc_norm_ci),
            "n": self.overall.n,
            "ties": self.overall.ties,
            "ties_norm": self.overall.ties_norm,
            "mean_margin": self.overall.mean_margin,
            "non_finite_pairs": self.overall.non_finite,
            "non_finite_sentences": self.non_finite_sentences,
            "partial": self.partial,
            "selection": self.selection,
            "truncated_sentences": self.truncated_sentences,
            "same_token_pairs": list(self.same_token_pairs),
            "bits_per_byte_good": self.bits_per_byte_good,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "tokens_per_byte": self.tokens / max(self.bytes, 1),
            "benchmark": self._benchmark_dict(),
            "tokenizer": self.tokenizer,
            "phenomena": {name: group.to_dict() for name, group in self.phenomena.items()},
            "subtypes": {name: group.to_dict() for name, group in self.subtypes.items()},
            "outcomes": self.outcomes(),
            "edit_tokens": self.edit_tokens(),
            "pairs": [self._pair_dict(i, pair) for i, pair in enumerate(self.pairs)],
            **self.run_info,
            **({"left_out": self.left_out} if self.left_out is not None else {}),
            **({"suites": {name: suite.suite_dict() for name, suite in self.suites.items()}} if self.suites else {}),
        }
        return record if self.pair_tokens is None else add_token_fields(record, self.pair_tokens)

    def edit_tokens(self) -> dict[str, Any]:
        """Per pair, compactly: ``aligned`` ("1" the edit is aligned with token boundaries, "0" not; None: unknown)
        and ``length_sign`` ("+" bad has more scored tokens than good, "0" as many, "-" fewer), in file order."""
        signs = "".join("+" if p.bad_tokens > p.good_tokens else "-" if p.bad_tokens < p.good_tokens else "0" for p in self.pairs)
        aligned = self.edit_aligned if len(self.edit_aligned) == len(self.pairs) else None
        return {"aligned": aligned, "length_sign": signs}

    def _pair_dict(self, index: int, pair: PairResult) -> dict[str, Any]:
        """One pair's JSON: its fields, outcomes, edit and critical region (``reading/edit.py``) and alignment."""
        aligned = self.edit_aligned[index] == "1" if len(self.edit_aligned) == len(self.pairs) else None
        edit = find_edit(pair.good, pair.bad).to_dict(pair.good, pair.bad)
        fields = {k: v for k, v in asdict(pair).items() if v is not None or not k.startswith("float32_")}
        for key in ("good_logprob", "bad_logprob", "float32_good_logprob", "float32_bad_logprob"):
            if isinstance(fields.get(key), float) and not math.isfinite(fields[key]):
                fields[key] = None  # standard JSON has no NaN or -Infinity (jq, JSON.parse); the outcome says "-"
        rescored = {"rescored": True} if pair.rescored else {}
        return {**fields, "passed": pair.passed, "passed_norm": pair.passed_norm, **rescored, **edit, "edit_aligned": aligned}

    def _benchmark_dict(self) -> dict[str, Any]:
        identity = {"release": self.benchmark_release, "md5": self.benchmark_md5, "source": self.benchmark_source}
        if self.benchmark_fingerprint:
            identity["fingerprint"] = self.benchmark_fingerprint
        if self.benchmark_columns is not None:
            identity["columns"] = dict(self.benchmark_columns)
        return identity

    def suite_dict(self) -> dict[str, Any]:
        """``to_dict`` of a suite's results, with its ``left_out`` pairs (the run's facts stay at the top level)."""
        return {k: v for k, v in self.to_dict().items() if k not in self.run_info}

    def outcomes(self) -> dict[str, Any]:
        """Every pair's outcome, compactly: ``acc`` and ``acc_norm`` are strings with one character per pair
        in file order ("1" passed, "0" failed or tied, "-" not finite, left out); ``phenomenon_runs`` is
        ``[[phenomenon, count], ...]`` in file order, the phenomenon of each character."""
        return {
            "acc": encode_outcomes(p.passed if p.finite else None for p in self.pairs),
            "acc_norm": encode_outcomes(p.passed_norm if p.finite else None for p in self.pairs),
            "phenomenon_runs": run_lengths(p.phenomenon for p in self.pairs),
        }

    def flat_metrics(self, prefix: str = "tatblimp") -> dict[str, float]:
        """Scalars for a logger: ``{prefix}/acc``, ``{prefix}/acc_norm``, ``{prefix}/{phenomenon}/acc``, ...

        The overall 95% intervals too: ``{prefix}/acc_ci_low``, ``{prefix}/acc_ci_high``, and the same for acc_norm.
        Each suite scored in the same pass under its own name (``{suite}/acc``, ...), as the callbacks log them.
        """
        metrics = {f"{prefix}/acc": self.acc, f"{prefix}/acc_norm": self.acc_norm}
        for metric, (low, high) in (("acc", self.acc_ci), ("acc_norm", self.acc_norm_ci)):
            metrics[f"{prefix}/{metric}_ci_low"], metrics[f"{prefix}/{metric}_ci_high"] = low, high
        for name, group in self.phenomena.items():
            metrics[f"{prefix}/{name}/acc"] = group.acc
            metrics[f"{prefix}/{name}/acc_norm"] = group.acc_norm
        if self.partial:  # flagged: the metrics above leave these pairs out
            metrics[f"{prefix}/partial"] = 1.0
        if self.overall.non_finite:
            metrics[f"{prefix}/non_finite_pairs"] = float(self.overall.non_finite)
            metrics[f"{prefix}/non_finite_sentences"] = float(self.non_finite_sentences)
            for name, group in self.phenomena.items():
                if group.non_finite:
                    metrics[f"{prefix}/{name}/non_finite_pairs"] = float(group.non_finite)
        if self.truncated_sentences:
            metrics[f"{prefix}/truncated_sentences"] = float(self.truncated_sentences)
        for name, suite in self.suites.items():
            metrics.update(suite.flat_metrics(name))
        return metrics

    def format_table(self) -> str:
        """A plain-text table like the benchmark card's: each phenomenon, then overall, with 95% intervals."""
        width = max(len(name) for name in [*self.phenomena, "overall"])
        dtype = f"  dtype: {self.run_info['dtype']}" if self.run_info.get("dtype") else ""
        if self.run_info.get("precision") not in (None, self.run_info.get("dtype")):  # autocast, or weights upcast
            dtype += f"  precision: {self.run_info['precision']}"
        if self.run_info.get("backend", "transformers") != "transformers":  # the default backend goes unsaid
            dtype = f"  backend: {self.run_info['backend']}{dtype}"
        lines = [f"{self.benchmark_release}{dtype}  tokenizer: {self.tokenizer}"]
        lines.append(f"{'phenomenon':<{width}}  {'n':>5}  {'acc':>6}  {'95% CI':<14}  {'acc_norm':>8}  {'95% CI':<14}")
        rule = "-" * (width + 59)

        def row(name: str, g: GroupResult) -> str:
            return (
                f"{name:<{width}}  {g.n:>5}  {g.acc:>6.4f}  {format_interval(g.acc_ci):<14}  "
                f"{g.acc_norm:>8.4f}  {format_interval(g.acc_norm_ci):<14}"
            )

        lines += [rule, *(row(name, group) for name, group in self.phenomena.items()), rule, row("overall", self.overall)]
        o = self.overall
        if o.ties or o.ties_norm:
            lines.append(f"ties (counted as failures): {o.ties} raw, {o.ties_norm} normalised")
        exact = self.run_info.get("exact_decisions")
        if exact:  # scored below float32, every decision float32's
            lines.append(
                f"decisions as float32 makes them: {exact['rescored_pairs']} pairs within rounding "
                f"({exact['bound_per_token']:.2g} nats per token) scored again in float32"
            )
        if o.non_finite:
            bad = ", ".join(f"{name} {g.non_finite}" for name, g in self.phenomena.items() if g.non_finite)
            lines.append(
                f"WARNING: {o.non_finite} pairs ({self.non_finite_sentences} sentences) had non-finite log-probs "
                f"and are left out ({bad})"
            )
        if self.truncated_sentences:
            lines.append(f"WARNING: {self.truncated_sentences} sentences were cut to the model's context")
        if self.same_token_pairs:
            lines.append(
                f"WARNING: {len(self.same_token_pairs)} pairs have the same token ids for both sentences (acc ties, "
                "acc_norm by byte counts); see same_token_pairs in the JSON"
            )
        if self.left_out:
            reasons = sorted({entry["reason"] for entry in self.left_out})
            lines.append(f"{len(self.left_out)} pairs left out of the metrics ({'; '.join(reasons)}); see left_out in the JSON")
        for name, suite in self.suites.items():
            lines += ["", f"suite {name}: {suite.benchmark_source}", suite.format_table()]
        return "\n".join(lines)

    def phenomenon_table(self) -> tuple[list[str], list[list[Any]]]:
        """(columns, rows) of the per-phenomenon results, then an ``overall`` row, e.g. for a wandb Table.

        Columns: phenomenon, n, acc, acc CI, acc_norm, acc_norm CI (95% Wilson, as "[low, high]"),
        mean margin (nats), ties (raw).
        """
        columns = ["phenomenon", "n", "acc", "acc CI", "acc_norm", "acc_norm CI", "mean margin", "ties"]
        rows = [
            [name, g.n, g.acc, format_interval(g.acc_ci), g.acc_norm, format_interval(g.acc_norm_ci), g.mean_margin, g.ties]
            for name, g in [*self.phenomena.items(), ("overall", self.overall)]
        ]
        return columns, rows


def subtype_groups(
    phenomenon_index: np.ndarray, subtype_index: np.ndarray, phenomena: list[str], subtypes: list[str]
) -> tuple[np.ndarray, list[str]]:
    """Each pair's subtype group (-1: none) and the groups' names, in name order: the subtype's label, or
    ``phenomenon/label`` where the label is found under several phenomena (TatBLiMP's ``past``, of passives and of
    suspended_affixation), so that a group never pools two phenomena's pairs."""
    kinds = sorted({(int(p), int(s)) for p, s in zip(phenomenon_index, subtype_index) if s >= 0})
    shared = {s for _, s in kinds if sum(t == s for _, t in kinds) > 1}
    name = {(p, s): f"{phenomena[p]}/{subtypes[s]}" if s in shared else subtypes[s] for p, s in kinds}
    names = sorted(name.values())
    group = {kind: names.index(label) for kind, label in name.items()}
    return np.array([group.get((int(p), int(s)), -1) for p, s in zip(phenomenon_index, subtype_index)]), names


def compute_results(cache: SentenceCache, logprobs, run_info: dict[str, Any] | None = None, rescored=None) -> Results:
    """Metrics from per-sentence log-probs in cache order (sentence 2*i good, 2*i+1 bad). ``rescored``: ``(log-probs,
    pairs)`` from ``exact_decisions``, the pairs (a boolean per pair) decided by those log-probs (float32) instead."""
    logprobs = np.asarray(logprobs.cpu() if hasattr(logprobs, "cpu") else logprobs, dtype=np.float64)
    good, bad = logprobs[0::2], logprobs[1::2]
    decided, rescored = (logprobs, np.zeros(len(good), bool)) if rescored is None else map(np.asarray, rescored)
    decided_good, decided_bad = np.where(rescored, decided[0::2], good), np.where(rescored, decided[1::2], bad)
    byte_lengths = cache.byte_lengths.cpu().numpy()
    good_bytes, bad_bytes = byte_lengths[0::2], byte_lengths[1::2]
    tokens = np.asarray(cache.lengths) - 1
    phenomenon_index = cache.phenomenon_index.cpu().numpy()
    subtype_index = cache.subtype_index.cpu().numpy()

    def group(mask: np.ndarray) -> GroupResult:
        return group_result(decided_good[mask], decided_bad[mask], good_bytes[mask], bad_bytes[mask])

    overall, phenomena = grouped(group, phenomenon_index, cache.phenomena)
    return Results(
        overall=overall,
        phenomena=phenomena,
        subtypes=grouped(group, *subtype_groups(phenomenon_index, subtype_index, cache.phenomena, cache.subtypes))[1],
        pairs=[
            PairResult(
                good_logprob=float(good[i]),
                bad_logprob=float(bad[i]),
                good_tokens=int(tokens[2 * i]),
                bad_tokens=int(tokens[2 * i + 1]),
                good_bytes=int(good_bytes[i]),
                bad_bytes=int(bad_bytes[i]),
                phenomenon=cache.phenomena[phenomenon_index[i]],
                subtype=cache.subtypes[subtype_index[i]] if subtype_index[i] >= 0 else None,
                good=cache.sentences[2 * i] if cache.sentences else "",
                bad=cache.sentences[2 * i + 1] if cache.sentences else "",
                float32_good_logprob=float(decided_good[i]) if rescored[i] else None,
                float32_bad_logprob=float(decided_bad[i]) if rescored[i] else None,
            )
            for i in range(len(good))
        ],
        benchmark_md5=cache.benchmark_md5,
        benchmark_release=cache.benchmark_release,
        benchmark_source=cache.benchmark_source,
        tokenizer=cache.tokenizer_name,
        tokens=int(tokens.sum()),
        bytes=int(byte_lengths.sum()),
        truncated_sentences=len(cache.truncated),
        same_token_pairs=list(cache.same_token_pairs),
        selection=cache.benchmark_selection,
        run_info=dict(run_info or {}),
        benchmark_fingerprint=cache.benchmark_fingerprint,
        benchmark_columns=cache.benchmark_columns,
        edit_aligned=cache.edit_aligned,
    )
