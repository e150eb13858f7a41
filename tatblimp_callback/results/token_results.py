"""Token-level results: each scored token's log-prob and text, and where the two sentences of a pair differ.

The engine already computes every token's log-prob (``Scorer.token_logprobs``); this module turns
them into per-pair records:

- ``good_token_logprobs`` / ``bad_token_logprobs``: one float per scored token (the prefix token is
  not scored), in order; Python's ``sum()`` of a list is the sentence's log-prob exactly;
- ``good_tokens_text`` / ``bad_tokens_text``: each token's piece of the sentence text (joined, they
  give the decoded sentence; a token holding only part of a UTF-8 character has the empty string,
  the token that completes the character carries it);
- ``edit``: ``{"good": [start, end], "bad": [start, end]}``, the half-open span of scored tokens
  between the longest common token prefix and the longest common token suffix of the two sentences.

The margin logP(good) - logP(bad) then splits into three parts: before the edit (the same tokens
in the same context: zero up to rounding), at the edit, and after it (the same tokens in another
context: spill-over). ``edit_margins`` gives, overall and per phenomenon, the mean of each part and
the share of the margin that comes from the edit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..engine.packing import TokenSequences

__all__ = ["PairTokens", "add_token_fields", "edit_margins", "edit_span", "format_edit_margins", "pair_tokens", "token_texts"]


@dataclass
class PairTokens:
    """One pair's token-level record (the keys ``tatblimp score --include-tokens`` adds to ``pairs[i]``)."""

    good_token_logprobs: list[float]
    bad_token_logprobs: list[float]
    good_tokens_text: list[str]
    bad_tokens_text: list[str]
    edit: dict[str, list[int]]  # {"good": [start, end], "bad": [start, end]}, half-open, over the scored tokens
    # The critical region's tokens ({"good": [i, j], "bad": [i, j]}) and its surprisal in bits, word-start
    # corrected ({"good": bits, "bad": bits, "word_marks": kind}; ``engine/word_surprisal.py``); None: not computed.
    critical_region_tokens: dict[str, Any] | None = None
    critical_region_bits: dict[str, Any] | None = None

    def margin_parts(self) -> tuple[float, float, float]:
        """(before, at, after) the edit: logP(good) - logP(bad) over each part's tokens, in nats.

        Their sum is the margin up to rounding; "before" compares the same tokens in the same
        context and is zero up to rounding.
        """
        (gs, ge), (bs, be) = self.edit["good"], self.edit["bad"]
        good, bad = self.good_token_logprobs, self.bad_token_logprobs
        return (
            math.fsum(good[:gs]) - math.fsum(bad[:bs]),
            math.fsum(good[gs:ge]) - math.fsum(bad[bs:be]),
            math.fsum(good[ge:]) - math.fsum(bad[be:]),
        )


def edit_span(good: Sequence[int], bad: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The half-open spans of ``good`` and ``bad`` between their longest common prefix and suffix.

    The suffix is taken from what the prefix leaves, so the spans never overlap it: for an
    insertion (``bad`` = ``good`` with tokens added) the good span is empty. Indices are over the
    sequences given (the scored tokens, prefix token excluded).

    Returns:
        ((good_start, good_end), (bad_start, bad_end)).
    """
    prefix = 0
    limit = min(len(good), len(bad))
    while prefix < limit and good[prefix] == bad[prefix]:
        prefix += 1
    suffix = 0
    while suffix < limit - prefix and good[len(good) - 1 - suffix] == bad[len(bad) - 1 - suffix]:
        suffix += 1
    return (prefix, len(good) - suffix), (prefix, len(bad) - suffix)


def token_texts(tokenizer: Any, ids: Sequence[int], sentence: str | None = None) -> list[str]:
    """Each token's piece of the decoded text, so that ``"".join(pieces)`` is the decoded sentence.

    A token is given the characters its decoding adds to the text before it; a token ending
    inside a UTF-8 character (byte-level BPE) adds none, and the one completing it adds the whole
    character. ``tokenizer`` is a Hugging Face tokenizer or a ``SentencePieceTokenizer``. Given the ``sentence``, a
    space the tokenizer put before it (``add_prefix_space``) is taken off the first pieces, so that they join to it.
    """
    pieces = _decoded_pieces(tokenizer, ids)
    extra = len("".join(pieces)) - len(sentence or "")
    if sentence is not None and extra > 0 and "".join(pieces)[extra:] == sentence and not "".join(pieces)[:extra].strip():
        for k, piece in enumerate(pieces):
            taken = min(extra, len(piece))
            pieces[k], extra = piece[taken:], extra - taken
            if not extra:
                break
    return pieces


def _decoded_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """``token_texts`` of the decoded text as it is."""
    if hasattr(tokenizer, "decode"):

        def decode(part: Sequence[int]) -> str:
            return tokenizer.decode(list(part), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    else:
        decode = tokenizer.processor.decode
    pieces, previous = [], ""
    for end in range(1, len(ids) + 1):
        text = decode(ids[:end])
        stable = text.rstrip("\ufffd") if end < len(ids) else text  # an unfinished character decodes as U+FFFD
        if not stable.startswith(previous):  # a decoder that rewrites earlier text (spaces): keep what it gives now
            previous = previous[: len(stable)]
        pieces.append(stable[len(previous) :])
        previous = stable
    return pieces


def pair_tokens(cache, token_logprobs: list[list[float]], tokenizer: Any = None) -> list[PairTokens]:
    """Per-pair token records from a sentence cache and ``Scorer.token_logprobs()`` (cache order).

    Args:
        cache: the ``SentenceCache`` scored (sentence ``2*i`` good, ``2*i + 1`` bad).
        token_logprobs: each sentence's scored tokens' log-probs.
        tokenizer: decodes the token pieces; None leaves the text lists empty.

    Returns:
        One ``PairTokens`` per pair, in file order.
    """
    if len(token_logprobs) != cache.num_sentences:
        raise ValueError(f"{len(token_logprobs)} token lists for {cache.num_sentences} sentences")
    sentences = TokenSequences(cache.token_ids, cache.offsets)
    texts = cache.sentences or [None] * cache.num_sentences
    records = []
    for pair in range(cache.num_pairs):
        good_ids, bad_ids = sentences[2 * pair][1:], sentences[2 * pair + 1][1:]
        good_span, bad_span = edit_span(good_ids, bad_ids)
        records.append(
            PairTokens(
                good_token_logprobs=token_logprobs[2 * pair],
                bad_token_logprobs=token_logprobs[2 * pair + 1],
                good_tokens_text=token_texts(tokenizer, good_ids, texts[2 * pair]) if tokenizer is not None else [],
                bad_tokens_text=token_texts(tokenizer, bad_ids, texts[2 * pair + 1]) if tokenizer is not None else [],
                edit={"good": list(good_span), "bad": list(bad_span)},
            )
        )
    return records


def edit_margins(tokens: Sequence[PairTokens], phenomena: Sequence[str]) -> dict[str, Any]:
    """Overall and per phenomenon: the mean margin and its parts before, at and after the edit (nats).

    ``edit_share`` is the mean part at the edit over the mean margin: 1 when the whole preference
    is decided at the edited tokens, below 1 when the tokens after the edit add to it (spill-over),
    above 1 when they pull the other way; None when the mean margin is 0. Pairs with a non-finite
    log-prob are left out, as the metrics leave them out.
    """
    groups: dict[str, list[tuple[float, float, float]]] = {"overall": []}
    for record, name in zip(tokens, phenomena):
        parts = record.margin_parts()
        if all(math.isfinite(part) for part in parts):
            groups["overall"].append(parts)
            groups.setdefault(name, []).append(parts)

    def summary(parts: list[tuple[float, float, float]]) -> dict[str, Any]:
        n = len(parts)
        before, at, after = (math.fsum(column) / n for column in zip(*parts)) if n else (math.nan,) * 3
        margin = before + at + after
        return {
            "n": n,
            "mean_margin": margin,
            "mean_before_edit": before,
            "mean_at_edit": at,
            "mean_after_edit": after,
            "edit_share": at / margin if n and margin != 0 else None,
        }

    overall = summary(groups.pop("overall"))
    return {**overall, "phenomena": {name: summary(parts) for name, parts in groups.items()}}


def format_edit_margins(margins: dict[str, Any]) -> str:
    """``edit_margins`` as a plain-text table: per phenomenon, then overall, the margin's parts in nats."""
    rows = [*margins["phenomena"].items(), ("overall", margins)]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'margin (nats)':<{width}}  {'n':>5}  {'margin':>8}  {'at edit':>8}  {'after':>8}  {'edit share':>10}"]
    for name, row in rows:
        share = "-" if row["edit_share"] is None else f"{row['edit_share']:.2f}"
        lines.append(
            f"{name:<{width}}  {row['n']:>5}  {row['mean_margin']:>8.3f}  {row['mean_at_edit']:>8.3f}  "
            f"{row['mean_after_edit']:>8.3f}  {share:>10}"
        )
    return "\n".join(lines)


def add_token_fields(record: dict[str, Any], tokens: Sequence[PairTokens]) -> dict[str, Any]:
    """``record`` (``Results.to_dict()``) with each pair's token fields in ``pairs[i]`` and ``edit_margins``."""
    if len(tokens) != len(record["pairs"]):
        raise ValueError(f"{len(tokens)} token records for {len(record['pairs'])} pairs")
    record["pairs"] = [{**pair, **asdict(extra)} for pair, extra in zip(record["pairs"], tokens)]
    record["edit_margins"] = edit_margins(tokens, [pair["phenomenon"] for pair in record["pairs"]])
    surprisal = region_surprisal_means(tokens, [pair["phenomenon"] for pair in record["pairs"]])
    if surprisal is not None:
        record["critical_region_surprisal"] = surprisal
    return record


def region_surprisal_means(tokens: Sequence[PairTokens], phenomena: Sequence[str]) -> dict[str, Any] | None:
    """Overall and per phenomenon: the mean critical-region surprisal (bits) of good and bad and of bad minus good,
    over the pairs where both are known; None when no pair has it."""
    groups: dict[str, list[tuple[float, float]]] = {"overall": []}
    for record, name in zip(tokens, phenomena):
        bits = record.critical_region_bits
        if bits and bits["good"] is not None and bits["bad"] is not None:
            groups["overall"].append((bits["good"], bits["bad"]))
            groups.setdefault(name, []).append((bits["good"], bits["bad"]))
    if not groups["overall"]:
        return None

    def summary(values: list[tuple[float, float]]) -> dict[str, Any]:
        n = len(values)
        good, bad = (math.fsum(column) / n for column in zip(*values))
        return {"n": n, "mean_good_bits": good, "mean_bad_bits": bad, "mean_difference_bits": bad - good}

    overall = summary(groups.pop("overall"))
    return {**overall, "phenomena": {name: summary(values) for name, values in groups.items()}}
