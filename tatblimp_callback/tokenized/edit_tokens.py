"""How a tokenizer cuts each pair's edit: the figures of ``tatblimp tokenizers``, from token character offsets.

Each sentence is tokenized as it is scored (``tokenization.encode_plain``: no special token, the prefix token
not counted), and each token gets its character span from the tokenizer itself: the offset mapping of a
Hugging Face fast tokenizer (or of a ``JsonTokenizer``), and for a raw SentencePiece model the spans its
encoder reports (``SentencePieceText`` pieces, bytes turned into characters). Whitespace is trimmed off
each span, so that ``Ġкитап`` and ``▁китап`` cover ``китап``: whitespace belongs to no token (a token of
whitespace alone, SentencePiece's lone ``▁``, has the empty span where the next character starts). A byte-level
token that holds part of a character covers the whole character; a SentencePiece byte-fallback piece
that does not complete its character covers nothing (an empty span where the character starts).

Per pair, against the edit of ``reading/edit.py``:

- a **token boundary** of a sentence is a character position no token's span strictly contains;
- the edit is **aligned** when its start and end are both token boundaries, in both sentences;
- the tokens **inside the edit** overlap its span (an empty span where the edit is: those at it);
- the critical region is **one token** when exactly one token overlaps it, in both sentences;
- the **token difference** is bad's scored tokens minus good's (the length confound of raw acc: with
  more tokens a sentence tends to have a lower log-prob);
- **identical ids**: the two sentences have the same token ids (acc ties);
- **flagged** tokens inside the edit are unknown tokens or byte-fallback pieces (``<0xNN>``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..reading.edit import Edit, find_edit
from .tokenization import TokenizationError, inserted_special_ids, tokenizer_name

__all__ = ["PairEditTokens", "TokenSpans", "edit_alignment", "pair_edit_tokens", "summarise_edit_tokens", "token_spans"]

BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
Span = tuple[int, int]


@dataclass(frozen=True)
class TokenSpans:
    """One sentence's scored tokens: ids, character spans (whitespace trimmed), pieces, unknown/byte flags."""

    ids: list[int]
    spans: list[Span]
    pieces: list[str]
    flagged: list[bool]

    def boundary(self, position: int) -> bool:
        """No token's span strictly contains ``position``."""
        return not any(start < position < end for start, end in self.spans)

    def inside(self, span: Span) -> list[int]:
        """Indices of the tokens in ``span``: overlapping it, or (an empty token span) starting in it; for an
        empty ``span``, the token it falls strictly inside, if any."""
        a, b = span
        return [i for i, (s, e) in enumerate(self.spans) if ((s < b and a < e) if s < e else a <= s < b)]


def token_spans(tokenizer: Any, sentences: Sequence[str], expected: Sequence[Sequence[int]] | None = None) -> list[TokenSpans]:
    """Each sentence's scored tokens with their character spans; the ids are ``encode_plain``'s.

    A transformers fast tokenizer is read through its ``backend_tokenizer`` (transformers' own call costs as much
    again); given ``expected`` (each sentence's ids as ``encode_plain`` gives them), a sentence whose backend ids
    differ sends every sentence through transformers' call instead.
    """
    if hasattr(tokenizer, "processor"):  # a raw SentencePiece model
        raw = [_sentencepiece_tokens(tokenizer.processor, text) for text in sentences]
    elif hasattr(tokenizer, "encodings"):  # a JsonTokenizer
        raw = [(e.ids, e.offsets, e.tokens) for e in tokenizer.encodings(sentences)]
    else:
        if not getattr(tokenizer, "is_fast", False):
            raise TokenizationError(f"{tokenizer_name(tokenizer)}: character offsets need a fast tokenizer (tokenizer.json)")
        encodings = tokenizer.backend_tokenizer.encode_batch(list(sentences), add_special_tokens=False)
        raw = [(e.ids, e.offsets, e.tokens) for e in encodings]
        special = inserted_special_ids(tokenizer)
        if expected is not None and any(list(e.ids)[_kept(e.ids, special)] != list(ids) for e, ids in zip(encodings, expected)):
            encoded = tokenizer(list(sentences), add_special_tokens=False, return_offsets_mapping=True)
            raw = [
                (ids, offsets, tokenizer.convert_ids_to_tokens(ids))
                for ids, offsets in zip(encoded["input_ids"], encoded["offset_mapping"])
            ]
    special = inserted_special_ids(tokenizer)
    unknown = getattr(tokenizer, "unk_token_id", None)
    result = []
    for text, (ids, offsets, pieces) in zip(sentences, raw):
        keep = _kept(ids, special)
        ids, offsets, pieces = list(ids)[keep], list(offsets)[keep], list(pieces)[keep]
        if hasattr(tokenizer, "processor"):
            flags = [tokenizer.processor.is_unknown(i) or tokenizer.processor.is_byte(i) for i in ids]
        else:
            flags = [i == unknown or bool(BYTE_PIECE.fullmatch(p)) for i, p in zip(ids, pieces)]
        result.append(TokenSpans(list(ids), [_trim(text, *span) for span in offsets], list(pieces), flags))
    return result


def cut_byte_lengths(tokenizer: Any, part, fused, start: int):
    """``part``'s byte lengths (a ``SentenceCache``'s tensor), those of its sentences cut to a model's context
    (``part.truncated``) the UTF-8 bytes up to the end of their last kept token: the text their log-prob covers. The
    kept tokens are ``fused``'s (the scored cache, ``part``'s sentences from ``start`` on, each after its prefix
    token). None where the tokenizer gives no character offsets, or its tokens are not the kept ones."""
    texts = [part.sentences[s] for s in part.truncated]
    kept = [fused.sentence(start + s)[1:] for s in part.truncated]
    try:
        found = token_spans(tokenizer, texts)
    except TokenizationError:
        return None
    if any(spans.ids[: len(ids)] != list(ids) for spans, ids in zip(found, kept)):
        return None
    byte_lengths = part.byte_lengths.clone()
    for s, text, spans, ids in zip(part.truncated, texts, found, kept):
        byte_lengths[s] = len(text[: spans.spans[len(ids) - 1][1]].encode("utf-8")) if ids else 0
    return byte_lengths


def _kept(ids: Sequence[int], special: set[int]) -> slice:
    """The ids ``encode_plain`` keeps: a special token at either end taken off."""
    return slice(1 if ids and ids[0] in special else 0, len(ids) - 1 if len(ids) > 1 and ids[-1] in special else len(ids))


def _sentencepiece_tokens(processor: Any, text: str) -> tuple[list[int], list[Span], list[str]]:
    """ids, character spans and pieces of a raw SentencePiece encoding (its pieces' byte offsets as characters)."""
    char_at = {}
    position = 0
    for index, char in enumerate(text):
        char_at[position] = index
        position += len(char.encode("utf-8"))
    char_at[position] = len(text)
    proto = processor.encode(text, return_type="proto")
    return (
        [p.id for p in proto.pieces],
        [(char_at[p.begin], char_at[p.end]) for p in proto.pieces],
        [p.piece for p in proto.pieces],
    )


def _trim(text: str, start: int, end: int) -> Span:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end)


@dataclass(frozen=True)
class PairEditTokens:
    """One pair's figures (``tatblimp tokenizers --include-pairs``)."""

    good_edit_tokens: int
    bad_edit_tokens: int
    aligned: bool
    region_one_token: bool
    token_difference: int  # bad's scored tokens minus good's
    identical_ids: bool
    flagged_at_edit: int  # unknown or byte-fallback tokens inside the edit, both sentences
    good_tokens: int
    bad_tokens: int


def pair_edit_tokens(edit: Edit, good: TokenSpans, bad: TokenSpans) -> PairEditTokens:
    """The figures of one pair from its edit and its two sentences' token spans."""
    good_inside, bad_inside = good.inside(edit.good), bad.inside(edit.bad)
    aligned = all(tokens.boundary(p) for tokens, span in ((good, edit.good), (bad, edit.bad)) for p in span)
    return PairEditTokens(
        good_edit_tokens=len(good_inside),
        bad_edit_tokens=len(bad_inside),
        aligned=aligned,
        region_one_token=len(good.inside(edit.good_region)) == 1 and len(bad.inside(edit.bad_region)) == 1,
        token_difference=len(bad.ids) - len(good.ids),
        identical_ids=good.ids == bad.ids,
        flagged_at_edit=sum(good.flagged[i] for i in good_inside) + sum(bad.flagged[i] for i in bad_inside),
        good_tokens=len(good.ids),
        bad_tokens=len(bad.ids),
    )


def edit_tokens_of_pairs(
    tokenizer: Any, pairs: Sequence[Any], expected: Sequence[Sequence[int]] | None = None
) -> list[PairEditTokens]:
    """``pair_edit_tokens`` of each pair (objects with ``good`` and ``bad`` sentences), in order; ``expected``: as
    ``token_spans`` takes it, good then bad."""
    spans = token_spans(tokenizer, [s for pair in pairs for s in (pair.good, pair.bad)], expected)
    return [pair_edit_tokens(find_edit(p.good, p.bad), spans[2 * i], spans[2 * i + 1]) for i, p in enumerate(pairs)]


def edit_alignment(tokenizer: Any, pairs: Sequence[Any], expected: Sequence[Sequence[int]] | None = None) -> str:
    """One character per pair: "1" the edit is aligned, "0" it is not (see the module docstring)."""
    return "".join("1" if facts.aligned else "0" for facts in edit_tokens_of_pairs(tokenizer, pairs, expected))


def summarise_edit_tokens(
    facts: Sequence[PairEditTokens], phenomena: Sequence[str], byte_lengths: Sequence[int]
) -> dict[str, Any]:
    """Overall and per phenomenon: the figures' means and shares (``tatblimp tokenizers``' JSON).

    ``byte_lengths``: each pair's two sentences' UTF-8 bytes together, for tokens per byte.
    """
    groups: dict[str, list[int]] = {}
    for index, name in enumerate(phenomena):
        groups.setdefault(name, []).append(index)

    def summary(indices: Sequence[int]) -> dict[str, Any]:
        rows = [facts[i] for i in indices]
        n = len(rows)
        share = (lambda count: count / n) if n else (lambda count: float("nan"))
        difference = [r.token_difference for r in rows]
        return {
            "n": n,
            "tokens_per_byte": sum(r.good_tokens + r.bad_tokens for r in rows) / max(sum(byte_lengths[i] for i in indices), 1),
            "mean_edit_tokens_good": share(sum(r.good_edit_tokens for r in rows)),
            "mean_edit_tokens_bad": share(sum(r.bad_edit_tokens for r in rows)),
            "edit_aligned": share(sum(r.aligned for r in rows)),
            "region_one_token": share(sum(r.region_one_token for r in rows)),
            "mean_token_difference": share(sum(difference)),
            "bad_longer": share(sum(d > 0 for d in difference)),
            "same_length": share(sum(d == 0 for d in difference)),
            "bad_shorter": share(sum(d < 0 for d in difference)),
            "identical_ids": sum(r.identical_ids for r in rows),
            "flagged_pairs": sum(r.flagged_at_edit > 0 for r in rows),
            "flagged_tokens": sum(r.flagged_at_edit for r in rows),
        }

    return {**summary(range(len(facts))), "phenomena": {name: summary(indices) for name, indices in groups.items()}}


def pair_dicts(facts: Sequence[PairEditTokens]) -> list[dict[str, Any]]:
    return [asdict(f) for f in facts]
