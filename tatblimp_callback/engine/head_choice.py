"""Which way the LM head turns hidden states into log-probs, chosen by what each way costs on this machine.

The candidates (``HeadMethod``) give the same numbers up to rounding:

- ``tiles``: the engine's way before this choice existed (``tiled_head.head_logprobs``): tiles of contexts x
  vocabulary columns, each tile's log-sum-exp in place, the targets' logits as dot products; where a forward
  call's contexts and the whole vocabulary fit one tile (on a GPU the vocabulary always does) one float32
  ``log_softmax`` and a gather;
- ``chunks:N``: whole-vocabulary ``log_softmax`` over ``N`` contexts at a time, the targets gathered from it
  (``tiled_head.chunked_logprobs``), for the sizes of ``CHUNK_ROWS`` whose logits fit the memory budget.

``HeadChoice`` times them at the first evaluation on that evaluation's own contexts: the first forward
calls' contexts are cut into pieces, each piece scored by the next candidate in turn (twice round), and
what a piece gives is kept as the evaluation's output, so the timing costs only what the slower candidates
lose against the fastest. The pieces are sized from the bound up front: once the first piece (today's way)
and the first forward call's body are timed, the first evaluation's cost is estimated from its scored
positions, and each later piece gets an equal share of ``BOUND`` of that estimate, assuming it runs up to
``SLOWEST`` times as long as the fastest so far; a candidate whose smallest piece does not fit its share is
not timed. A candidate is kept only if its log-probs on a few contexts equal today's within the method
check's tolerance. ``head_method=`` forces one, untimed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import distributed
from .scoring_method import LOGIT_SCALE, relative_tolerance
from .tiled_head import chunked_logprobs, head_logprobs

logger = logging.getLogger(__name__)

# On a CPU a chunk's logits above glibc's mmap threshold (32 MiB at most) are new pages every time:
# 4,096 contexts of a 4K vocabulary took twice as long per context as 512 (2 cores, 2026-12-02).
CHUNK_ROWS = {"cpu": (256, 512, 1024), "cuda": (1024, 4096, 16384)}
BOUND = 0.10  # the timing may add at most this share to the first evaluation
SLOWEST = 2.0  # a piece's time is budgeted as if it ran this many times as long as the fastest candidate so far
ROUNDS = 2  # each candidate is timed this many times, alternated with the others; its best counts
CHECKED_CONTEXTS = 32  # contexts on which each candidate's log-probs are compared with today's
MIN_CHOICE_FLOPS = 4e9  # below this much head work in an evaluation, nothing is timed: today's way is kept


@dataclass(frozen=True)
class HeadMethod:
    """``kind`` "tiles" or "chunks"; ``rows``: contexts per chunk (chunks only)."""

    kind: str
    rows: int = 0

    @classmethod
    def parse(cls, name: str | HeadMethod) -> HeadMethod:
        """``"tiles"`` or ``"chunks:N"`` (N contexts a chunk, N >= 1)."""
        if isinstance(name, HeadMethod):
            return name
        kind, _, rows = str(name).partition(":")
        if kind == "tiles" and not rows:
            return cls("tiles")
        if kind == "chunks" and rows.isdigit() and int(rows) >= 1:
            return cls("chunks", int(rows))
        raise ValueError(f"unknown head method {name!r}: expected 'tiles' or 'chunks:N' (N contexts a chunk, e.g. 'chunks:1024')")

    def __str__(self) -> str:
        return "tiles" if self.kind == "tiles" else f"chunks:{self.rows}"


TILES = HeadMethod("tiles")


def candidates(device: torch.device, vocab: int, dtype: torch.dtype, memory_budget: int, max_contexts: int) -> list[HeadMethod]:
    """Today's tiles first, then the chunk sizes whose float32 logits fit the budget, each at most a forward
    call's contexts (``max_contexts``: a larger chunk is the same computation as one of that size)."""
    element = torch.finfo(dtype).bits // 8
    per_logit = element + (4 if element != 4 else 0) + 4  # the logits, a float32 copy, log_softmax's output
    fits = max(1, memory_budget // (vocab * per_logit))
    sizes = sorted({min(rows, fits, max_contexts) for rows in CHUNK_ROWS.get(device.type, CHUNK_ROWS["cuda"])})
    return [TILES] + [HeadMethod("chunks", rows) for rows in sizes]


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for ``device``'s work before a clock is read: that CUDA device's synchronize (with the head on
    another GPU than the current one, the current one's would time nothing), nothing elsewhere."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


@dataclass
class Timing:
    contexts: int = 0
    seconds: float = 0.0
    best_rate: float = float("inf")  # seconds a context, the best piece's
    pieces: int = 0
    exact: bool | None = None  # None until compared with today's way


@dataclass
class HeadChoice:
    """The head method in use: forced (``forced``), or chosen at the first evaluation by timing.

    ``record`` (after the choice) says what was chosen, why, and each candidate's timings: the results'
    provenance carries it.
    """

    forced: HeadMethod | None = None
    method: HeadMethod | None = None
    record: dict | None = None
    _plan: dict | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.forced is not None:
            self.method = self.forced
            self.record = {"head_method": str(self.forced), "chosen_by": "given"}

    @property
    def choosing(self) -> bool:
        return self._plan is not None

    def keep(self, method: HeadMethod, reason: str) -> None:
        """Use ``method`` without timing (a head too small to time, several processes)."""
        self.method, self._plan = method, None
        self.record = {"head_method": str(method), "chosen_by": reason}

    def begin(
        self, layout, prompts: bool, weight: torch.Tensor, dtype: torch.dtype, memory_budget: int, setup_seconds: float
    ) -> None:
        """At the first evaluation with the tiled head: time the head's candidates on its ``layout`` (``start``), or
        keep the tiles where the head's work is too small to time or several processes each would time their own.

        ``prompts``: forced-choice prompts (one context a row); ``weight``: the head's; ``dtype``: the model's (the
        method check's tolerance is its); ``setup_seconds``: what the evaluation spent before its first forward call.
        """
        contexts = len(layout.batches.rows.order) if prompts else layout.total_positions - layout.padded_positions
        if distributed.world()[1] > 1:
            self.keep(TILES, "several processes (each would time its own)")
        elif 2 * contexts * weight.shape[0] * weight.shape[1] < MIN_CHOICE_FLOPS:
            self.keep(TILES, "head work too small to time")
        else:
            largest = max(b.score_positions.numel() for b in layout.batches[:1]) if len(layout.batches) else 1
            methods = candidates(weight.device, weight.shape[0], weight.dtype, memory_budget, largest)
            sync = device_sync(weight.device)
            rtol = relative_tolerance(dtype, weight.device)
            self.start(methods, contexts, layout.total_positions, setup_seconds, rtol, sync)

    def start(self, methods: list[HeadMethod], contexts: int, positions: int, setup_seconds: float, rtol: float, sync) -> None:
        """Begin timing ``methods`` in this evaluation: ``contexts`` and ``positions`` are its totals,
        ``setup_seconds`` what it has spent before its first forward call (the method check)."""
        self._plan = {
            "queue": [m for _ in range(ROUNDS) for m in methods],
            "timings": {m: Timing() for m in methods},
            "contexts": contexts,
            "positions": positions,
            "setup": setup_seconds,
            "body_rate": None,
            "checks": 0.0,
            "rtol": rtol,
            "sync": sync,
            # The first piece (today's way, whose rate is not known yet): a small share of the contexts.
            "first": max(64, min(2048, contexts // (4 * ROUNDS * len(methods)))),
        }

    def forward_logprobs(
        self, body: Callable[[], tuple], run: Callable, device: torch.device, seconds: float = 0.0
    ) -> torch.Tensor:
        """A forward call's log-probs: ``body()`` runs its body and gives (hidden, contexts, targets, positions), timed
        while choosing (plus ``seconds`` of it run before); ``run(method, hidden, contexts, targets)`` computes
        log-probs with one method."""
        if not self.choosing:
            return run(self.method or TILES, *body()[:3])
        sync = device_sync(device)
        sync()
        start = time.perf_counter()
        hidden, contexts, targets, positions = body()
        sync()
        return self.batch_logprobs(run, hidden, contexts, targets, (time.perf_counter() - start + seconds, positions))

    def batch_logprobs(
        self, run: Callable, hidden: torch.Tensor, contexts: torch.Tensor, targets: torch.Tensor, body: tuple[float, int]
    ) -> torch.Tensor:
        """A forward call's log-probs while choosing: its contexts in pieces, each by the next candidate, timed.

        ``run(method, hidden, contexts, targets)`` computes log-probs with one method; ``body``: this call's
        body seconds and positions (the first one's set the evaluation's estimate).
        """
        plan = self._plan
        if plan["body_rate"] is None:
            plan["body_rate"] = body[0] / max(body[1], 1)
        order = torch.argsort(contexts, stable=True)
        ordered = contexts[order]
        logprobs = torch.empty(targets.shape[0], dtype=torch.float32, device=hidden.device)
        start, k = 0, hidden.shape[0]
        while start < k and self.choosing:
            method, size = self._next_piece(k - start)
            if method is None:
                break
            end = start + size
            lo, hi = torch.searchsorted(ordered, torch.tensor([start, end], device=ordered.device)).tolist()
            pick = order[lo:hi]
            piece = (hidden[start:end], ordered[lo:hi] - start, targets[pick])
            plan["sync"]()
            began = time.perf_counter()
            values = run(method, *piece)
            plan["sync"]()
            self._timed(method, time.perf_counter() - began, size)
            if plan["timings"][method].exact is None:
                self._check(run, method, piece, values)
            if not plan["timings"][method].exact:
                values = run(TILES, *piece)  # its numbers are not kept
            logprobs[pick] = values
            start = end
            if not plan["queue"]:
                self._decide()
        if start < k:  # the rest of this call: with the chosen method, or the fastest so far
            lo = int(torch.searchsorted(ordered, torch.tensor(start, device=ordered.device)))
            pick = order[lo:]
            method = self.method or self._fastest()
            logprobs[pick] = run(method, hidden[start:], ordered[lo:] - start, targets[pick])
        return logprobs

    def finish(self) -> None:
        """End of the first evaluation: choose among what was timed, if the choice is still open."""
        if self.choosing:
            self._decide()

    # -- the timing plan --------------------------------------------------------------------------------

    def _next_piece(self, left: int) -> tuple[HeadMethod | None, int]:
        """The next candidate to time and its piece's contexts (at most ``left``), or (None, 0) to stop timing."""
        plan = self._plan
        while plan["queue"]:
            method = plan["queue"][0]
            if plan["timings"][method].exact is False:  # disagreed with today's way: not timed again
                plan["queue"].pop(0)
                continue
            smallest = method.rows if method.kind == "chunks" else 1
            rate = self._fastest_rate()
            if rate == float("inf"):  # the first piece: today's way, real output at today's cost
                plan["queue"].pop(0)
                return method, min(left, plan["first"])
            share = (self._budget() - self._spent()) / max(len(plan["queue"]), 1)
            size = int(share / ((SLOWEST - 1) * rate)) if share > 0 else 0
            if method.kind == "chunks":
                size = size // method.rows * method.rows  # whole chunks
            if size < smallest:
                plan["queue"].pop(0)  # its smallest piece does not fit its share of the bound
                continue
            if left < smallest:
                return None, 0  # the rest of this forward call is too small for it: the next call's contexts
            plan["queue"].pop(0)
            size = min(size, left // smallest * smallest)
            return method, size
        return None, 0

    def _budget(self) -> float:
        plan = self._plan
        estimate = plan["setup"] + plan["body_rate"] * plan["positions"] + self._fastest_rate() * plan["contexts"]
        return BOUND * estimate

    def _spent(self) -> float:
        """What the timing has added so far: each piece's time above the fastest rate, and the comparisons."""
        rate = self._fastest_rate()
        timings = self._plan["timings"].values()
        return sum(t.seconds - rate * t.contexts for t in timings) + self._plan["checks"]

    def _timed(self, method: HeadMethod, seconds: float, contexts: int) -> None:
        timing = self._plan["timings"][method]
        timing.contexts += contexts
        timing.seconds += seconds
        timing.pieces += 1
        timing.best_rate = min(timing.best_rate, seconds / max(contexts, 1))

    def _check(self, run: Callable, method: HeadMethod, piece, values: torch.Tensor) -> bool:
        """Whether ``method``'s log-probs equal today's on the piece's first contexts, within the method check's tolerance."""
        timing = self._plan["timings"][method]
        if method == TILES:
            timing.exact = True
            return True
        hidden, contexts, targets = piece
        began = time.perf_counter()
        few = contexts < CHECKED_CONTEXTS
        reference = run(TILES, hidden[:CHECKED_CONTEXTS], contexts[few], targets[few])
        mine = values[few]
        finite = torch.isfinite(reference)
        allowed = self._plan["rtol"] * (reference.abs() + LOGIT_SCALE)
        timing.exact = bool(torch.equal(torch.isfinite(mine), finite) and ((mine - reference).abs() <= allowed)[finite].all())
        self._plan["checks"] += time.perf_counter() - began
        if not timing.exact:
            logger.warning("tatblimp: head method %s disagrees with the tiled head on this model; not used", method)
        return timing.exact

    def _fastest(self, to_keep: bool = False) -> HeadMethod:
        """The exact candidate with the best rate so far; ``to_keep``: of those timed ``ROUNDS`` times (today's tiles
        once), since one piece alone can fall on a burst of the machine's load (256K: 14.7 against 37.4 s a 1,000
        contexts in single pieces, 45 against 27 s whole evaluations, loaded machine, 2026-12-02)."""
        timings = self._plan["timings"].items()
        timed = [
            (t.best_rate, i, m)
            for i, (m, t) in enumerate(timings)
            if t.exact and t.pieces >= (ROUNDS if to_keep and m != TILES else 1)
        ]
        return min(timed)[2] if timed else TILES

    def _fastest_rate(self) -> float:
        return self._plan["timings"][self._fastest()].best_rate

    def _decide(self) -> None:
        plan = self._plan
        method = self._fastest(to_keep=True)
        timings = {
            str(m): {
                "seconds_per_1000_contexts": None if not t.pieces else 1000 * t.best_rate,
                "pieces": t.pieces,
                "contexts": t.contexts,
                "exact": t.exact,
            }
            for m, t in plan["timings"].items()
        }
        spent = max(0.0, self._spent())
        self.record = {
            "head_method": str(method),
            "chosen_by": "timing",
            "candidates": timings,
            "timing_added_seconds": spent,
            "timing_bound_seconds": self._budget(),
        }
        self.method, self._plan = method, None
        logger.info(
            "tatblimp: LM head by %s (timed: %s)",
            method,
            ", ".join(f"{name} {t['seconds_per_1000_contexts']:.3g} s/1000" for name, t in timings.items() if t["pieces"]),
        )


def method_logprobs(lm: torch.nn.Module, method: HeadMethod, hidden, contexts, targets, tile, memory_budget: int) -> torch.Tensor:
    """log p(target | context) by ``method``: ``tile`` for today's tiles; a chunk is cut to what fits ``memory_budget``."""
    if method.kind == "tiles":
        return head_logprobs(lm, hidden, contexts, targets, tile)
    weight = lm.get_output_embeddings().weight
    fits = candidates(weight.device, weight.shape[0], weight.dtype, memory_budget, method.rows)[-1].rows
    return chunked_logprobs(lm, hidden, contexts, targets, min(method.rows, fits))
