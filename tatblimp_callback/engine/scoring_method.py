"""How a model's scores are computed (the row layout and the LM head), how the fastest correct one
is found, and when it is checked again.

The method is chosen by scoring a sample of sequences with each candidate, fastest first, and
comparing with a plain one-sequence-at-a-time forward of the whole model (``matches``). It is
checked again at the first evaluation after the weights have moved appreciably (their fingerprint
by more than ``MOVED``, relative) and then every ``RECHECK_EVERY`` evaluations, because a model that
misreads positions or masks can look right while its weights are still near their initialisation. Until that first
move, never while the weights have not moved at all since the check (as far as their fingerprint shows).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import distributed
from .model_checks import relative_change, tree_mask_dtype

logger = logging.getLogger(__name__)

LAYOUTS = ("tree", "packed", "padded")
HEADS = ("tiled", "full_logits")
RECHECK_EVERY = 10
MOVED = 0.01
# Allowed |fast - reference| per compared value: RELATIVE_TOLERANCE[dtype] x (|reference| +
# LOGIT_SCALE x its scored tokens). The first term is rounding relative to the log-prob itself; the
# second stands for the logits that rounding acts on, which a confident (near-zero) log-prob hides.
# Measured (2-layer Llama, 2026-11-30): padded rows and the reference differ by at most 3% of this
# allowance in float32 and bf16; a forward that drops position ids, once trained, by 4.5x (bf16)
# to over 100x (float32) of it.
RELATIVE_TOLERANCE = {torch.float64: 2e-6, torch.float32: 2e-6, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}
TF32_TOLERANCE = 2.0**-10  # float32 matmuls on a GPU that allows TF32 keep 10 mantissa bits, as float16 does
LOGIT_SCALE = 8.0


@dataclass(frozen=True)
class ScoringMethod:
    """How scores are computed: ``layout`` "tree", "packed" or "padded" rows (see ``packing``), and
    ``head`` "tiled" (hidden states x LM head, tile by tile: ``tiled_head``) or "full_logits" (the
    model's own forward and logits)."""

    layout: str
    head: str

    def __post_init__(self):
        if self.layout not in LAYOUTS or self.head not in HEADS:
            raise ValueError(f"unknown scoring method {self.layout!r}, {self.head!r}: layouts {LAYOUTS}, heads {HEADS}")

    def __str__(self) -> str:
        return f"{self.layout} rows, {'tiled head' if self.head == 'tiled' else 'full logits'}"


def forced_method(lm: torch.nn.Module, method, head: str) -> ScoringMethod | None:
    """``method`` as given to a scorer: None (chosen by the check), a ``ScoringMethod``, or a layout's name with ``head``.

    Raises:
        ValueError: a method of another type, an unknown layout, or one the model declared it cannot take (a
            ``CallableLM``'s ``layouts``): its rows would be scored wrong, with nothing to say so.
    """
    if method is None:
        return None
    if isinstance(method, str):
        if method not in LAYOUTS:
            raise ValueError(f"unknown scoring method {method!r}: one of {LAYOUTS} (or a ScoringMethod)")
        method = ScoringMethod(method, head)
    if not isinstance(method, ScoringMethod):
        raise ValueError(f"method must be a layout name {LAYOUTS}, a ScoringMethod or None, got {method!r}")
    declared = getattr(lm, "supported_layouts", None)
    if declared is not None and method.layout not in declared:
        raise ValueError(f"method {method.layout!r}: the model declares the layouts {declared} only (CallableLM layouts=)")
    return method


def layouts_to_try(lm: torch.nn.Module) -> list[str]:
    """Row layouts, fastest first; prefix trees need an attention that takes a 4D mask."""
    layouts = list(LAYOUTS) if tree_mask_dtype(lm) else ["packed", "padded"]
    declared = getattr(lm, "supported_layouts", None)  # a callable model's own word (``callable_model.CallableLM``)
    return layouts if declared is None else [layout for layout in layouts if layout in declared]


def first_matching_method(
    lm: torch.nn.Module, heads: list[str], matches: Callable[[ScoringMethod], bool], consensus: Callable[[bool], bool] = bool
) -> ScoringMethod | None:
    """The fastest method for which ``matches(method)`` holds (layouts fastest first, then ``heads``), or None.

    A method that raises (an attention that rejects a 4D mask, say) does not match, unless it is
    the last resort, padded rows, whose error is the model's own. Under ``torch.distributed`` the error is announced
    to the other processes at their next check-in (``distributed.shared_failures``), so that the method fails on all
    of them and they try the next one in step; kept to itself, it left them in other collectives (a gloo abort).
    """
    for layout in layouts_to_try(lm):
        for head in heads:
            method = ScoringMethod(layout, head)
            try:
                with distributed.shared_failures():
                    matched = matches(method)
            except (RuntimeError, ValueError, TypeError, IndexError) as error:
                if isinstance(error, torch.OutOfMemoryError) or layout == "padded":
                    raise
                logger.warning("tatblimp: %s failed for this model (%s)", method, error)
                matched = False
            if consensus(matched):
                logger.info("tatblimp: scoring with %s", method)
                return method
            logger.warning("tatblimp: %s disagrees with a plain forward for this model", method)
    return None


def relative_tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """The rounding allowance, relative, of a model computing in ``dtype`` on ``device``."""
    if dtype == torch.float32 and device.type == "cuda" and cuda_matmul_allows_tf32():
        return TF32_TOLERANCE
    return RELATIVE_TOLERANCE.get(dtype, RELATIVE_TOLERANCE[torch.float16])


def cuda_matmul_allows_tf32() -> bool:
    """Whether float32 matmuls on a GPU may round to TF32, read through the API the settings came from.

    transformers' ``enable_tf32`` sets the new ``torch.backends.fp32_precision``; after that the legacy
    ``torch.get_float32_matmul_precision()`` raises (torch 2.9+), while the per-backend setting answers.
    """
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch 2.9+: "ieee", "tf32", or "none" (then the global setting decides)
        precision = matmul.fp32_precision
        if precision == "none":
            precision = getattr(torch.backends, "fp32_precision", "none")
        if precision != "none":
            return precision == "tf32"
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # settings of both APIs mixed, none of them for CUDA matmuls: torch's default, IEEE
        return False


def agree(values: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor, rtol: float) -> bool:
    """Whether ``values`` equal ``reference`` within ``rtol`` x (|reference| + ``LOGIT_SCALE`` x ``tokens``),
    and are non-finite in the same places.

    ``tokens``: how many token log-probs each value sums (broadcast against ``values``).
    """
    finite = torch.isfinite(reference)
    if not torch.equal(torch.isfinite(values), finite):
        return False
    allowed = rtol * (reference.abs() + LOGIT_SCALE * tokens)
    return bool(((values - reference).abs() <= allowed)[finite].all())


class RecheckSchedule:
    """When to compare the chosen method with a plain forward again: at the first evaluation whose weights
    moved by more than ``MOVED`` (relative) from those it was checked on, then every ``RECHECK_EVERY`` evaluations.
    Until that first move, not at all while the weights' fingerprint is still, bit for bit, the one it was checked on
    (frozen weights: the harness model's calls, a model scored again unchanged): a check would find what the last
    one found.

    The weights' fingerprint is given as a function, called only while the first move is awaited: after it, an
    evaluation costs no read of the weights (on a GPU, no copy to the host) to decide.
    """

    def __init__(self):
        self.fingerprint: torch.Tensor | None = None
        self.since_check = 0
        self.waiting_for_change = True

    def checked(self, fingerprint: Callable[[], torch.Tensor]) -> None:
        self.since_check = 0
        self.fingerprint = fingerprint() if self.waiting_for_change else None

    def due(self, fingerprint: Callable[[], torch.Tensor]) -> bool:
        """Whether this evaluation (one call per evaluation) should check the method again."""
        self.since_check += 1
        if self.waiting_for_change:
            change = relative_change(fingerprint(), self.fingerprint)
            if change > MOVED:
                self.waiting_for_change = False
                return True
            if change == 0:
                return False
        return self.since_check >= RECHECK_EVERY


def sample_sequences(lengths: list[int], pairs: int) -> list[int]:
    """A few pairs spread over the length range, long ones included: both sequences of each, so
    that prefix-tree rows share (and branch off) a prefix as they do in a full evaluation. None of none."""
    if not lengths:
        return []
    by_length = sorted(range(len(lengths)), key=lambda s: lengths[s])
    picks = {by_length[round(i * (len(by_length) - 1) / (pairs - 1))] for i in range(pairs)}
    return sorted(picks | {s ^ 1 for s in picks if s ^ 1 < len(lengths)})


def reference_readout(forward, cache, sequences: list[int]) -> torch.Tensor:
    """One sequence at a time, the whole model (``forward``), full log-softmax: the definition, computed plainly.

    Sentences: each one's log-prob; prompts (``cache.answer_ids``): each answer's after the prompt.
    """
    rows = []
    answers = list(cache.answer_ids)
    for s in sequences:
        ids = cache.token_ids[cache.offsets[s] : cache.offsets[s + 1]].unsqueeze(0)
        inputs = ids if answers else ids[:, :-1]  # a sentence's last token is a target only
        logprobs = forward(input_ids=inputs, use_cache=False).logits[0].float().log_softmax(-1)
        if answers:
            rows.append(logprobs[-1, answers].double())
        else:
            rows.append(logprobs.gather(-1, ids[0, 1:, None]).double().sum())
    return torch.stack(rows).to(cache.device)
