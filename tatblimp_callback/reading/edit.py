"""The edit of a minimal pair, in characters: where the two sentences differ, and the whole words that covers.

- **The edit** is the half-open character span between the longest common prefix and the longest common
  suffix of the good and bad sentences, in each of the two. The suffix is taken from what the prefix leaves
  (it never overlaps the prefix), so an insertion has an empty span in the sentence without it:
  ``китап`` / ``китаплар`` gives ``[5, 5)`` in the good sentence and ``[5, 8)`` (``лар``) in the bad one.
- **The critical region** is the run of whole words the edit touches, in each sentence: a word is a maximal
  run of non-whitespace characters (``str.isspace``), so punctuation attached to a word belongs to it
  (``укыйм.`` is one word). A non-empty edit touches the words it overlaps; an empty one (the point where the
  other sentence has more) touches the word it is in or at either end of. An edit made of whitespace only,
  between two words (``a  b`` / ``a b``), touches no word: its region is the empty span at the edit.

Spans are ``(start, end)`` character offsets into the sentence (Python string indices), for every suite.
The token-level view of the same pair (which tokens the edit cuts) is in ``tokenized/edit_tokens.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Edit", "critical_region", "find_edit"]

Span = tuple[int, int]


@dataclass(frozen=True)
class Edit:
    """A pair's edit and critical region in each sentence, as half-open character spans."""

    good: Span
    bad: Span
    good_region: Span
    bad_region: Span

    def to_dict(self, good: str, bad: str) -> dict[str, Any]:
        """The spans and the text they hold: ``{"edit": {...}, "critical_region": {...}}`` (per-pair JSON)."""
        return {
            "edit_chars": {
                "good": list(self.good),
                "bad": list(self.bad),
                "good_text": good[slice(*self.good)],
                "bad_text": bad[slice(*self.bad)],
            },
            "critical_region": {
                "good": list(self.good_region),
                "bad": list(self.bad_region),
                "good_text": good[slice(*self.good_region)],
                "bad_text": bad[slice(*self.bad_region)],
            },
        }


def find_edit(good: str, bad: str) -> Edit:
    """The edit of the pair (``good``, ``bad``) and its critical region in each sentence."""
    limit = min(len(good), len(bad))
    prefix = 0
    while prefix < limit and good[prefix] == bad[prefix]:
        prefix += 1
    suffix = 0
    while suffix < limit - prefix and good[-1 - suffix] == bad[-1 - suffix]:
        suffix += 1
    good_span, bad_span = (prefix, len(good) - suffix), (prefix, len(bad) - suffix)
    return Edit(good_span, bad_span, critical_region(good, good_span), critical_region(bad, bad_span))


def critical_region(text: str, span: Span) -> Span:
    """The whole words of ``text`` that ``span`` touches, as one span (the empty ``span`` itself when none)."""
    start, end = span
    words = []
    position = 0
    for word in text.split():
        word_start = text.index(word, position)
        position = word_start + len(word)
        touches = word_start < end and start < position if start < end else word_start <= start <= position
        if touches:
            words.append((word_start, position))
    if not words:
        return (start, start)
    return (words[0][0], words[-1][1])
