"""Turning sentences into the token ids that are scored.

Each sentence becomes ``[prefix] + ids(sentence)``: the prefix token (the tokenizer's BOS, else
its EOS, else one the caller names) is there so that the first real token is scored too. Special
tokens that a tokenizer inserts by itself are stripped first, so there is never a double BOS.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..reading.option_types import is_whole_number

logger = logging.getLogger(__name__)


class TokenizationError(ValueError):
    """The tokenizer cannot be used for scoring (no prefix token, an empty encoding, ...)."""


class SentencePieceTokenizer:
    """A raw SentencePiece ``.model`` used as is, so ids are exactly those the model was trained on.

    transformers 5 converts a ``.model`` file to a "fast" tokenizer whose ids can differ from
    raw sentencepiece; a model trained on raw ids must be scored with raw ids.
    """

    def __init__(self, model_file: str | os.PathLike):
        import sentencepiece as spm

        self.model_file = str(model_file)
        self.processor = spm.SentencePieceProcessor(model_file=self.model_file)
        self.name_or_path = self.model_file

    @property
    def bos_token_id(self) -> int | None:
        return _non_negative(self.processor.bos_id())

    @property
    def eos_token_id(self) -> int | None:
        return _non_negative(self.processor.eos_id())

    def __len__(self) -> int:
        return self.processor.get_piece_size()

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.processor.encode(list(texts))

    def fingerprint_bytes(self) -> bytes:
        return self.processor.serialized_model_proto()


def _non_negative(token_id: int) -> int | None:
    return token_id if token_id >= 0 else None


def check_tokenizer(tokenizer: Any) -> None:
    """Raise where ``tokenizer`` is a path or a name rather than a tokenizer: it is loaded by the caller
    (``tatblimp_callback.load_tokenizer``), never here.

    Raises:
        TokenizationError: naming what was given.
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        raise TokenizationError(
            f"tokenizer={str(tokenizer)!r} is a path or a name, not a tokenizer: load it first, with "
            "tatblimp_callback.load_tokenizer (a folder, a Hub id or a SentencePiece .model file)"
        )


def check_prefix_token_id(prefix_token_id) -> None:
    """Raise where ``prefix_token_id`` is neither None nor a whole number (``int()`` would have made 2.9 token 2).

    Raises:
        TokenizationError: naming the value.
    """
    if prefix_token_id is not None and not is_whole_number(prefix_token_id):
        raise TokenizationError(f"prefix_token_id must be a token id (a whole number) or None, got {prefix_token_id!r}")


def resolve_prefix_token_id(tokenizer: Any, prefix_token_id: int | None = None) -> int:
    """The caller's prefix token if given (a whole number), else the tokenizer's BOS, else its EOS.

    Raises:
        TokenizationError: no ``tokenizer``, or a path or a name (``check_tokenizer``), ``prefix_token_id`` is not a
            whole number, or neither it, a BOS nor an EOS token is there.
    """
    if tokenizer is None:
        raise TokenizationError("no tokenizer: pass the tokenizer the model was trained with")
    check_tokenizer(tokenizer)
    check_prefix_token_id(prefix_token_id)
    for candidate in (prefix_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    raise TokenizationError(
        f"tokenizer {tokenizer_name(tokenizer)} has neither a BOS nor an EOS token; "
        "pass prefix_token_id (tatblimp: --prefix-token-id)"
    )


def encode_sentences(tokenizer: Any, sentences: Sequence[str], prefix_token_id: int) -> list[list[int]]:
    """Token ids of each sentence, prefix token first; no special token that the tokenizer inserted.

    ``prefix_token_id`` may be an ordinary token (say "."): a sentence that starts or ends with it keeps it.
    """
    encoded = []
    for index, (sentence, ids) in enumerate(zip(sentences, encode_plain(tokenizer, sentences))):
        if not ids:
            raise TokenizationError(f"sentence {index} encodes to no tokens: {sentence!r}")
        encoded.append([prefix_token_id, *ids])
    return encoded


def encode_plain(tokenizer: Any, sentences: Sequence[str]) -> list[list[int]]:
    """Token ids of each sentence without special tokens.

    Asked for none, some tokenizers still add BOS/EOS; a special token at either end (see
    ``inserted_special_ids``) is taken off, as the sentence text itself never holds one.
    """
    if hasattr(tokenizer, "encode_batch"):
        raw = tokenizer.encode_batch(sentences)
    else:
        raw = tokenizer(list(sentences), add_special_tokens=False)["input_ids"]
    special = inserted_special_ids(tokenizer)
    stripped = []
    for ids in raw:
        ids = list(ids)
        if ids and ids[0] in special:
            ids = ids[1:]
        if ids and ids[-1] in special:
            ids = ids[:-1]
        stripped.append(ids)
    return stripped


def inserted_special_ids(tokenizer: Any) -> set[int]:
    """Ids of the special tokens a tokenizer may insert around a text (BOS, EOS, CLS, SEP, ...).

    Hugging Face tokenizers: ``all_special_ids`` but the unknown token, which stands for text, and the
    padding token, which encoding one text never adds (and which users sometimes set to an ordinary
    token); others (a raw SentencePiece model): BOS and EOS. Never an ordinary token chosen as the prefix.
    """
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    special -= {getattr(tokenizer, "unk_token_id", None), getattr(tokenizer, "pad_token_id", None)}
    return (special | {tokenizer.bos_token_id, tokenizer.eos_token_id}) - {None}


def tokenizer_name(tokenizer: Any) -> str:
    """The path or Hub name the tokenizer was loaded from; for one built in memory (the demo's, a Trainer's
    ``processing_class``), its class and fingerprint, since the class alone does not tell two apart."""
    name = getattr(tokenizer, "name_or_path", "")
    if name:
        return str(name)
    # transformers' class names (TokenizersBackend for every fast tokenizer) tell a reader nothing; the model does.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    kind = f"{type(backend.model).__name__} " if backend is not None else ""
    return f"a {kind}tokenizer built in memory ({len(tokenizer):,} tokens, fingerprint {tokenizer_fingerprint(tokenizer)})"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash that changes whenever the tokenizer would produce different ids."""
    digest = hashlib.sha256()
    if hasattr(tokenizer, "fingerprint_bytes"):
        digest.update(tokenizer.fingerprint_bytes())
    elif getattr(tokenizer, "backend_tokenizer", None) is not None:
        digest.update(tokenizer.backend_tokenizer.to_str().encode())
    else:
        digest.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(repr((tokenizer.bos_token_id, tokenizer.eos_token_id)).encode())
    return digest.hexdigest()[:16]


# -- faithful tokenization: raw SentencePiece vs a converted Hugging Face tokenizer ----------------

SENTENCEPIECE_FILE = "tokenizer.model"


def compare_tokenizations(a: Any, b: Any, sentences: Sequence[str]) -> int:
    """How many ``sentences`` the two tokenizers turn into different ids (special tokens stripped).

    Use it to check that a converted Hugging Face tokenizer gives the ids a model was trained on,
    e.g. ``compare_tokenizations(SentencePieceTokenizer("tokenizer.model"), hf_tokenizer, sentences)``.
    """
    return sum(x != y for x, y in zip(encode_plain(a, sentences), encode_plain(b, sentences)))


def check_sentencepiece_mismatch(folder: str | os.PathLike, tokenizer: Any, sentences: Sequence[str]) -> int | None:
    """Warn when ``folder`` holds a raw ``tokenizer.model`` whose ids differ from ``tokenizer``'s.

    transformers converts a SentencePiece model to a "fast" tokenizer whose ids can differ from
    raw sentencepiece; a model trained on raw ids then gets a wrong, lower score. Returns the
    number of sentences encoded differently, or None when there is nothing to compare (no
    ``tokenizer.model`` in the folder, or ``tokenizer`` is itself a raw SentencePiece model).
    """
    model_file = Path(folder) / SENTENCEPIECE_FILE
    if isinstance(tokenizer, SentencePieceTokenizer) or not model_file.is_file():
        return None
    try:
        raw = SentencePieceTokenizer(model_file)
    except Exception as err:  # not a SentencePiece model after all: nothing to compare, but say so
        logger.warning("tatblimp: %s is not a readable SentencePiece model (%s); tokenizations not compared", model_file, err)
        return None
    differing = compare_tokenizations(raw, tokenizer, sentences)
    if differing:
        logger.warning(
            "tatblimp: WARNING: the tokenizer %s gives different token ids from the raw SentencePiece model %s "
            "on %d of %d benchmark sentences. If the model was trained on raw sentencepiece ids, score it with "
            "--tokenizer %s (Python: SentencePieceTokenizer(%r)).",
            tokenizer_name(tokenizer),
            model_file,
            differing,
            len(sentences),
            model_file,
            str(model_file),
        )
    return differing
