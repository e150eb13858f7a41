"""Critical-region surprisal in bits: the words an edit touches, given the words before them.

The scorer reads each scored token's log-prob only; the probability of a word also needs, where the
tokenizer marks word starts, how likely the next token is to start a new word, before the region and after
it (``tokenized/word_marks.py``). This module runs its own pass for that: sentences a few at a time, the
model's body over each, and the head only at the positions a region needs (its tokens' contexts and the
one after it), so memory is bounded by the batch, not by the benchmark:

    bits = -(sum of the region tokens' log p + log p(B | after) - log p(B | before)) / ln 2

with ``p(B | before)`` taken as 1 where the region starts the sentence and its first token carries no
mark (GPT-2-style BPE), and no correction at all for the kinds that need none.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from ..reading.edit import find_edit
from ..tokenized.edit_tokens import token_spans
from ..tokenized.word_marks import WordMarks, word_marking
from .model_state import scoring_mode

logger = logging.getLogger(__name__)

__all__ = ["add_region_surprisal", "region_surprisal_bits"]

LN2 = math.log(2)


def _head(lm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    logits = lm.get_output_embeddings()(hidden).double()
    cap = getattr(getattr(lm, "config", None), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def region_surprisal_bits(
    lm: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    regions: Sequence[tuple[int, int] | None],
    marks: WordMarks,
    pad_id: int,
    batch_sentences: int = 16,
) -> list[float | None]:
    """Each sequence's critical-region surprisal in bits (None where its region is None or empty).

    Args:
        lm: a causal LM with ``base_model`` and ``get_output_embeddings()``.
        sequences: token ids as scored, the prefix token first.
        regions: ``(i, j)``: the region's tokens, half-open over the scored tokens (the prefix not counted).
        marks: the tokenizer's word marks.
        pad_id: fills the rows of shorter sequences (masked out).
        batch_sentences: sequences per forward call.

    ``lm`` runs in ``model_state.scoring_mode``: eval mode without gradients, each module back in its own mode after.
    """
    with scoring_mode(lm):
        return _region_surprisal_bits(lm, sequences, regions, marks, pad_id, batch_sentences)


def _region_surprisal_bits(lm, sequences, regions, marks, pad_id, batch_sentences) -> list[float | None]:
    device = lm.get_output_embeddings().weight.device
    boundary = torch.tensor(marks.boundary_ids, dtype=torch.long, device=device) if marks.corrected else None
    starts = set(marks.boundary_ids)
    results: list[float | None] = [None] * len(sequences)
    wanted = [k for k, region in enumerate(regions) if region is not None and region[0] < region[1]]
    for start in range(0, len(wanted), batch_sentences):
        chunk = wanted[start : start + batch_sentences]
        width = max(len(sequences[k]) for k in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, k in enumerate(chunk):
            ids[row, : len(sequences[k])] = torch.tensor(list(sequences[k]))
            mask[row, : len(sequences[k])] = 1
        hidden = lm.base_model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).last_hidden_state
        totals = []  # float64 on the device: read back once per chunk, not once per sentence
        for row, k in enumerate(chunk):
            i, j = regions[k]
            # Input position p predicts scored token p (the prefix at input 0 predicts scored token 0).
            logprobs = _head(lm, hidden[row, i : j + 1].to(device)).log_softmax(-1)
            targets = torch.tensor(list(sequences[k][i + 1 : j + 1]), device=device)
            total = logprobs[: j - i].gather(-1, targets[:, None]).sum()
            if boundary is not None:
                after = logprobs[j - i, boundary].logsumexp(0)
                first_unmarked = i == 0 and int(sequences[k][1]) not in starts
                total = total + (after if first_unmarked else after - logprobs[0, boundary].logsumexp(0))
            totals.append(total)
        for k, total in zip(chunk, torch.stack(totals).tolist(), strict=True):
            results[k] = -total / LN2
    return results


def add_region_surprisal(records: Sequence, lm: torch.nn.Module, cache, tokenizer) -> None:
    """Set each pair's ``critical_region_tokens`` and ``critical_region_bits`` (``token_results.PairTokens``).

    ``cache`` is the ``SentenceCache`` the records were made from. A sentence whose tokens here differ from the
    cache's (cut to the model's context) gets None; a model or tokenizer this cannot read leaves every pair's
    None, with a warning: the scores are there all the same.
    """
    try:
        marks = word_marking(tokenizer)
        sequences = [cache.sentence(s) for s in range(cache.num_sentences)]
        spans = token_spans(tokenizer, cache.sentences, [sequence[1:] for sequence in sequences])
        regions: list[tuple[int, int] | None] = []
        for pair in range(cache.num_pairs):
            edit = find_edit(cache.sentences[2 * pair], cache.sentences[2 * pair + 1])
            for s, region in ((2 * pair, edit.good_region), (2 * pair + 1, edit.bad_region)):
                inside = spans[s].inside(region) if spans[s].ids == list(sequences[s][1:]) else []
                regions.append((inside[0], inside[-1] + 1) if inside else None)
        bits = region_surprisal_bits(lm, sequences, regions, marks, cache.prefix_token_id)
    except Exception as err:  # a model without base_model, a tokenizer without offsets: no region surprisal
        logger.warning("tatblimp: no critical-region surprisal (%s: %s)", type(err).__name__, err)
        return
    for pair, record in enumerate(records):
        good, bad = regions[2 * pair], regions[2 * pair + 1]
        record.critical_region_tokens = {"good": list(good) if good else None, "bad": list(bad) if bad else None}
        record.critical_region_bits = {"good": bits[2 * pair], "bad": bits[2 * pair + 1], "word_marks": marks.kind}
