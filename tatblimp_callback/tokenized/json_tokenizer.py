"""A Hugging Face ``tokenizer.json`` read with the ``tokenizers`` library alone, without transformers or torch.

``tatblimp tokenizers`` looks at tokenizations only, so it loads no model and needs no torch (importing
transformers' ``AutoTokenizer`` imports torch, seconds on a CPU). ``JsonTokenizer`` gives what
``tokenization.py`` asks of a tokenizer (BOS, EOS, the special tokens it may insert, ``encode_batch``) and
each token's character offsets; for a folder saved by transformers (``tokenizer.json`` with
``tokenizer_config.json`` or ``special_tokens_map.json``), its ids are the ids ``AutoTokenizer`` gives with
``add_special_tokens=False`` (tested). A tokenizer without a ``tokenizer.json`` (a slow-only tokenizer) is
not read here: the error says to convert it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["JsonTokenizer"]

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
EXTRA_SPECIAL_NAMES = ("additional_special_tokens", "extra_special_tokens")


def _special_id(key: str) -> property:
    """The id of the special token the config names ``key`` (``bos_token``): None without one, as in transformers."""
    return property(lambda self: self._ids.get(key), doc=f"The id of the {key.removesuffix('_token')} token, or None.")


class JsonTokenizer:
    """A ``tokenizers.Tokenizer`` with its special tokens named as transformers names them."""

    def __init__(self, backend: Any, special_tokens: dict[str, str], extra_special: Sequence[str] = (), name: str = ""):
        self.backend_tokenizer = backend
        self.name_or_path = name
        self._ids = {key: backend.token_to_id(token) for key, token in special_tokens.items()}
        extra = {backend.token_to_id(token) for token in extra_special}
        self.all_special_ids = sorted(({*self._ids.values()} | extra) - {None})

    @classmethod
    def from_folder(cls, folder: str | os.PathLike, name: str | None = None) -> JsonTokenizer:
        """The tokenizer saved in ``folder`` (its ``tokenizer.json`` and special-token files)."""
        from tokenizers import Tokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{folder}: no tokenizer.json; save the tokenizer with a fast tokenizer (transformers' save_pretrained) "
                "or give its SentencePiece .model file"
            )
        config: dict[str, Any] = {}
        for file_name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins, as in transformers
            if (folder / file_name).is_file():
                config.update(json.loads((folder / file_name).read_text(encoding="utf-8")))
        named = {key: _content(config[key]) for key in SPECIAL_NAMES if config.get(key) is not None}
        extra = [_content(token) for key in EXTRA_SPECIAL_NAMES for token in _listed(config.get(key))]
        return cls(Tokenizer.from_file(str(path)), named, extra, name if name is not None else str(folder))

    bos_token_id = _special_id("bos_token")
    eos_token_id = _special_id("eos_token")
    unk_token_id = _special_id("unk_token")
    pad_token_id = _special_id("pad_token")

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.encodings(texts)]

    def encodings(self, texts: Sequence[str]) -> list[Any]:
        """The ``tokenizers.Encoding`` of each text (ids, tokens, character offsets), no special tokens added."""
        return self.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)


def _content(token: Any) -> str:
    return token["content"] if isinstance(token, dict) else str(token)


def _listed(value: Any) -> list[Any]:
    if isinstance(value, dict):  # transformers 5's extra_special_tokens may map names to tokens
        return list(value.values())
    return list(value or [])
