"""Choosing the scoring method at the first evaluation, and checking it again when it is due.

The check compares the fast readout of a sample of sequences with a plain forward of the whole
model (``scoring_method.reference_readout``), for each candidate method, fastest first. It is told
how to compute both, and whether a layout's forward reads position ids, by the functions it is
given: it calls nothing above it.

Below float32 (``precision``) the plain forward is itself rounded, and on a GPU its rounding changes with the
batch's shape, so two correct methods may differ by more than any fixed allowance. There the check also
computes the sample in float32 (the same weights upcast for that forward only), and a method that does not
match the plain forward within the allowance is still accepted when it is as close to that float32 truth as
the plain forward is (``precision.within_plain_rounding``). The chosen method's error against the truth, per
scored token, is kept (``rounding``): the bound that ``exact_decisions`` rescores pairs within.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from . import distributed
from .model_checks import ScoringError, weight_fingerprint
from .precision import per_token_error, within_plain_rounding
from .scoring_method import (
    LOGIT_SCALE,
    RELATIVE_TOLERANCE,
    RecheckSchedule,
    ScoringMethod,
    agree,
    first_matching_method,
    layouts_to_try,
)

logger = logging.getLogger(__name__)


class MethodCheck:
    """The scoring method in use, chosen and re-checked against a plain forward on ``sample``.

    Args:
        lm: the causal LM (its layouts to try, its weights' fingerprint).
        method: a method given by the caller (never checked), or None to choose one.
        sample: the sequences compared.
        heads: the heads the model allows, fastest first.
        reference: the plain readout of sequences (``[len(sample)]`` or ``[len(sample), answers]``).
        readout: a method's readout of the sample.
        reads_positions: whether the model's forward reads the position ids of a layout's rows.
        tokens: how many token log-probs each compared value sums.
        rtol: the rounding allowance (``scoring_method.relative_tolerance``).
        truth: the sample's plain forward in float32 (weights upcast), where the model is scored below float32;
            None in float32, where the plain forward is the truth.
    """

    def __init__(
        self,
        lm: torch.nn.Module,
        method: ScoringMethod | None,
        *,
        sample: list[int],
        heads: Callable[[], list[str]],
        reference: Callable[[list[int]], torch.Tensor],
        readout: Callable[[ScoringMethod, list[int]], torch.Tensor],
        reads_positions: Callable[[ScoringMethod, list[int]], bool],
        tokens: torch.Tensor,
        rtol: Callable[[], float],
        truth: Callable[[list[int]], torch.Tensor] | None = None,
    ):
        self.lm, self.method, self.sample = lm, method, sample
        self.heads, self.reference, self.readout, self.probe = heads, reference, readout, reads_positions
        self.tokens, self.rtol, self.truth = tokens, rtol, truth
        self._truth: torch.Tensor | None = None  # the float32 truth of the sample, for the latest comparison
        self._errors: dict[ScoringMethod, torch.Tensor] = {}  # per-token errors against it, per method compared
        self.rounding: torch.Tensor | None = None  # the chosen method's per-token errors on the sample (below float32)
        self.given = method is not None  # by the caller: used as it is
        self.checked = False
        self.recheck = RecheckSchedule()
        self.reads_positions: dict[str, bool] = {}  # layout -> whether the forward reads its position ids
        self.replacements = 0  # methods that failed a later check and were replaced

    def when_due(self) -> ScoringMethod:
        """The method to score with: chosen at the first evaluation, checked again when the schedule says so (every process alike)."""
        if self.given:
            return self.method
        if self.method is None or not self.checked:
            self.method = self.choose()
            return self.method
        fingerprint = functools.cache(lambda: weight_fingerprint(self.lm))  # read only if the schedule asks, once
        if distributed.all_agree(not self.recheck.due(fingerprint)):
            return self.method
        reference = self._reference()
        if not torch.isfinite(reference).any():
            return self.method  # diverged: nothing to compare with until it recovers
        if not distributed.all_agree(self.matches(self.method, reference)):
            logger.warning("tatblimp: %s no longer matches a plain forward of this model; choosing the method again", self.method)
            self.replacements += 1
        elif not distributed.all_agree(all(self.reads_positions.values())):
            # Faster layouts were ruled out because the outputs ignored position ids; weights that
            # made attention blind to positions (say, zero query weights) may have trained since.
            self.reads_positions.clear()
        else:
            self.recheck.checked(fingerprint)
            self.rounding = self._errors.get(self.method)
            return self.method
        self.method = self.choose(reference)
        return self.method

    def choose(self, reference: torch.Tensor | None = None) -> ScoringMethod:
        """The fastest method whose readout matches a plain forward on the sample."""
        if reference is None:
            # Every process's plain forward, or all stop here: a failure met inside the readouts below reads as that
            # method's, and the other processes would go on to the next method without the one that failed.
            with distributed.shared_failures():
                reference = self._reference()
            distributed.check_in()
        heads = self.heads()
        if not torch.isfinite(reference).any():
            # A diverged model leaves nothing to compare: use the fastest method for now and check
            # again at the next evaluation, rather than keep a choice that was never tested.
            logger.warning("tatblimp: the model's log-probs are not finite; scoring method unchecked until they are")
            self.checked = False
            return ScoringMethod(layouts_to_try(self.lm)[0], heads[0])

        def matches(method: ScoringMethod) -> bool:
            return self.forward_reads_positions(method) and self.matches(method, reference)

        method = first_matching_method(self.lm, heads, matches, consensus=distributed.all_agree)
        if method is None:
            raise ScoringError("no scoring method matches a plain forward of this model; its logits may be non-deterministic")
        self.checked = True
        self.recheck.checked(lambda: weight_fingerprint(self.lm))
        self.rounding = self._errors.get(method)
        return method

    def measured_rounding(self) -> torch.Tensor | None:
        """The method's per-token errors against the float32 truth on the sample, as last measured (at the check, or
        now where the method was given); None without a truth (in float32, or tensor parallel). Call it in the
        scoring precision."""
        if self.truth is None or self.method is None:
            return None
        if self.rounding is None:
            truth = self.truth(self.sample)
            values = self.readout(self.method, self.sample).to(truth.dtype)
            tokens = self.tokens.to(truth.device, truth.dtype)
            self.rounding = per_token_error(values, truth, tokens if truth.dim() == 1 else torch.ones_like(truth)).flatten()
        return self.rounding

    def _reference(self) -> torch.Tensor:
        """The sample's plain forward in the model's precision; below float32 its float32 truth is taken too."""
        self._errors = {}
        self._truth = None if self.truth is None else self.truth(self.sample)
        return self.reference(self.sample)

    def matches(self, method: ScoringMethod, reference: torch.Tensor) -> bool:
        """Whether ``method``'s readout of the sample equals the plain forward's within the allowance or, below
        float32, is as close to the float32 truth as the plain forward is."""
        values = self.readout(method, self.sample).to(reference.dtype)
        tokens = self.tokens.to(reference.device, reference.dtype)
        tokens = tokens if reference.dim() == 1 else torch.ones_like(reference)
        if self._truth is None:
            return agree(values, reference, tokens, self.rtol())
        truth = self._truth.to(reference.device, reference.dtype)
        self._errors[method] = per_token_error(values, truth, tokens).flatten()
        scale = truth.abs() + LOGIT_SCALE * tokens
        return agree(values, reference, tokens, self.rtol()) or within_plain_rounding(
            values, reference, truth, scale, RELATIVE_TOLERANCE[torch.float32]
        )

    def forward_reads_positions(self, method: ScoringMethod) -> bool:
        """Whether the model's forward reads the position ids that tree and packed rows depend on (padded rows do not)."""
        if method.layout == "padded":
            return True
        if method.layout not in self.reads_positions:
            reads = self.probe(method, self.sample)
            if not reads:
                logger.warning("tatblimp: this model's forward ignores position_ids, so %s rows cannot be used", method.layout)
            self.reads_positions[method.layout] = reads
        return self.reads_positions[method.layout]
