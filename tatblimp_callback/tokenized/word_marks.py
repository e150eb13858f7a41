"""How a tokenizer marks words, for the probability of a word (Pimentel & Meister 2024, "How to compute the
probability of a word").

The probability of a word is not the product of its tokens' probabilities when tokens carry the word's
leading space: ``Ġкитап`` also says that the word before it has ended, and ``китап`` followed by ``лар``
is another word. With word-start marks, the probability of the words ``w`` after a context ``c`` is

    p(w | c) = p(tokens of w | c) * p(B | c, w) / p(B | c)

where ``p(B | ...)`` is the probability that the next token starts a new word: the summed probability of
the tokens that start one, and of the end-of-sequence token. Kinds (``word_marking``):

- ``"start"``: a mark on word-initial tokens: byte-level BPE's ``Ġ``, SentencePiece's (and Metaspace's)
  ``▁``. When the sentence's first token carries no mark (GPT-2-style BPE, no prefix space), every token
  may start the first word and ``p(B | c)`` is 1 there.
- ``"continuation"``: a mark on word-internal tokens (WordPiece's ``##``): the tokens without it start a
  word. The words are the tokenizer's own (its pre-tokenizer splits punctuation off), so after a word any
  unmarked token (a word or a punctuation mark) counts as its end.
- ``"end"``: a mark on word-final tokens (BPE with ``</w>``): the last token of a word says that it ends,
  so the product of the tokens' probabilities is the word's, and no correction is made.
- ``"none"``: no mark found (a character model, a custom tokenizer): no correction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .tokenization import inserted_special_ids

__all__ = ["WordMarks", "word_marking"]


@dataclass(frozen=True)
class WordMarks:
    """A tokenizer's word marks: ``kind``, the ``mark`` itself, and the ids after which a new word starts."""

    kind: str  # "start", "continuation", "end" or "none"
    mark: str = ""
    boundary_ids: tuple[int, ...] = field(default=(), repr=False)  # start a word (and EOS); "start"/"continuation" only

    @property
    def corrected(self) -> bool:
        return self.kind in ("start", "continuation")


def _pieces(tokenizer: Any) -> list[str]:
    if hasattr(tokenizer, "processor"):
        return [tokenizer.processor.id_to_piece(i) for i in range(len(tokenizer))]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.get_vocab(with_added_tokens=True) if backend is not None else tokenizer.get_vocab()
    pieces = [""] * (max(vocab.values()) + 1)
    for piece, index in vocab.items():
        pieces[index] = piece
    return pieces


def _kind_of(tokenizer: Any) -> tuple[str, str]:
    if hasattr(tokenizer, "processor"):  # raw SentencePiece
        return "start", "▁"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "none", ""
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") == "WordPiece":
        return "continuation", model.get("continuing_subword_prefix") or "##"
    if model.get("end_of_word_suffix"):
        return "end", model["end_of_word_suffix"]
    parts = [spec.get("pre_tokenizer"), spec.get("decoder")]
    found = []
    while parts:
        part = parts.pop()
        if not part:
            continue
        parts += part.get("pretokenizers") or part.get("decoders") or []
        kind = part.get("type")
        if kind == "ByteLevel":
            found.append("Ġ")
        elif kind == "Metaspace":
            found.append(part.get("replacement") or "▁")
        elif kind == "Replace" and (part.get("pattern") or {}).get("String") == "▁":
            found.append("▁")
    return ("start", found[0]) if found else ("none", "")


def word_marking(tokenizer: Any) -> WordMarks:
    """The word marks of a Hugging Face fast tokenizer, a ``JsonTokenizer`` or a raw ``SentencePieceTokenizer``."""
    kind, mark = _kind_of(tokenizer)
    if kind not in ("start", "continuation"):
        return WordMarks(kind, mark)
    special = inserted_special_ids(tokenizer) | {getattr(tokenizer, "pad_token_id", None)} - {None}
    pieces = _pieces(tokenizer)
    if kind == "start":
        starts = {i for i, piece in enumerate(pieces) if piece.startswith(mark)}
    else:
        starts = {i for i, piece in enumerate(pieces) if piece and not piece.startswith(mark)}
    starts -= special
    if tokenizer.eos_token_id is not None:
        starts.add(int(tokenizer.eos_token_id))
    return WordMarks(kind, mark, tuple(sorted(starts)))
