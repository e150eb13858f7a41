"""Pair decisions as float32 would make them, at low-precision cost (``exact_decisions``, on below float32).

In bf16 some pair decisions are rounding, not grammar: a pair whose margin (logP(good) - logP(bad), or the
per-byte margin of acc_norm) is smaller than what rounding can move it by may fall either way. The method
check already has the sample in both precisions (``method_check.MethodCheck.rounding``): the scoring method's
error against the float32 truth of the same weights, per scored token, for this model at this step (measured
again whenever the method is re-checked). A pair is close when its margin is within ``SAFETY`` x the largest of
those per-token errors x the pair's scored tokens (per byte for acc_norm: each sentence's tokens over its bytes);
close pairs are scored again in float32 by the method in use (the weights upcast a module at a time, the LM head's
whole for the pass, ``precision.computing_in``) and their decisions replace the low-precision ones. The per-sentence
log-probs stay the fast ones; the rescored pairs are named.

Under ``torch.distributed`` every process has the same log-probs (summed over processes) and takes the union of
the close pairs of all (one reduction), then every process rescores all of them, in lockstep: a sharded model's
(FSDP1, FSDP2, ZeRO-3) forward is a collective, and every process runs the same rescoring forwards.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from . import distributed
from .model_state import scoring_mode
from .precision import computing_in, precision_name

SAFETY = 2.0  # times the largest per-token error of the sample: sentences beyond it, and a margin's two errors adding up


def close_pairs(
    logprobs: torch.Tensor, tokens: torch.Tensor, byte_lengths: torch.Tensor, bound: float, sequences: Sequence[int]
) -> list[int]:
    """The pairs (sentences ``2i``, ``2i+1``; of ``sequences``, both of a pair) whose raw or per-byte margin is within
    ``bound`` nats per scored token of zero, by their tokens; pairs with a non-finite log-prob are left out."""
    chosen = set(sequences)
    good = torch.tensor([s for s in sorted(chosen) if s % 2 == 0 and s + 1 in chosen], dtype=torch.long)
    if not len(good):
        return []
    g, b = logprobs[good].double(), logprobs[good + 1].double()
    tg, tb = tokens[good].double(), tokens[good + 1].double()
    bg, bb = byte_lengths[good].double(), byte_lengths[good + 1].double()
    raw = (g - b).abs() <= bound * (tg + tb)
    norm = (g / bg - b / bb).abs() <= bound * (tg / bg + tb / bb)
    close = (raw | norm) & torch.isfinite(g) & torch.isfinite(b)
    return (good[close] // 2).tolist()


def rounding_bound(errors: torch.Tensor | None) -> float | None:
    """``SAFETY`` x the largest per-token error of the sample (None where nothing was measured)."""
    if errors is None or not errors.numel():
        return None
    return SAFETY * float(errors.max())


def decide_exactly(scorer, logprobs: torch.Tensor, sequences: Sequence[int] | None = None) -> tuple | None:
    """``(log-probs, rescored, record)``: ``logprobs`` (the scorer's latest, float64, on the CPU; of ``sequences``,
    default all) with the close pairs' sentences scored again in float32; which pairs those are (a boolean per pair of
    the cache); and what was done (``precision``, ``bound_per_token``, ``rescored_pairs``, ``seconds``).

    None where the scorer computes in float32 or more, scores forced-choice prompts, or has no float32 truth to
    measure its rounding with (a tensor-parallel model). Spans (``scored_spans``) are not pairs: never rescored.
    """
    if scorer.precision.itemsize >= 4 or scorer.cache.answer_ids or scorer.check.truth is None:
        return None
    start = time.perf_counter()
    device = scorer.cache.device
    with scoring_mode(scorer.model), computing_in(scorer.lm, scorer.precision, device, weights=scorer.compute_dtype):
        errors = scorer.check.measured_rounding()
    bound = rounding_bound(errors)
    if bound is None:
        return None
    cache = scorer.cache
    pair_sentences = cache.num_sentences - len(cache.span_tokens)
    sequences = range(pair_sentences) if sequences is None else [s for s in sequences if s < pair_sentences]
    tokens = torch.tensor(cache.lengths) - 1
    pairs = close_pairs(logprobs, tokens, cache.byte_lengths.cpu(), bound, sequences)
    # The same pairs on every process: the union of what each found (their log-probs are the same already).
    mask = torch.zeros(cache.num_sentences // 2, dtype=torch.float64, device=device)
    mask[pairs] = 1.0
    rescored = distributed.sum_over_processes(mask).cpu() > 0
    pairs = torch.nonzero(rescored).flatten().tolist()
    decided = logprobs.clone()
    if pairs:
        rescore = sorted(s for p in pairs for s in (2 * p, 2 * p + 1))
        # The method in use; a tiled head reads its weight itself: upcast whole for the pass (one matrix).
        head = scorer.lm.get_output_embeddings() if scorer.method.head == "tiled" else None
        with scoring_mode(scorer.model), computing_in(scorer.lm, torch.float32, device, head=head, weights=scorer.compute_dtype):
            decided[rescore] = scorer.check.readout(scorer.method, rescore).double().cpu()
    record = {
        "precision": precision_name(scorer.precision),
        "bound_per_token": bound,
        "rescored_pairs": len(pairs),
        "seconds": time.perf_counter() - start,
    }
    return decided, rescored, record
