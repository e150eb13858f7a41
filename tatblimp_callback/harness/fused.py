"""The harness's log-likelihood requests scored in the engine's prefix-tree rows: each request's log-prob and ``is_greedy``.

A request is lm-evaluation-harness's ``(context tokens, continuation tokens)``, already encoded the harness's
way (``HFLM._encode_pair``, its prefix token for an empty context). Its sequence is the two joined, cut from
the left to the model's context plus one as ``HFLM`` cuts it; the engine lays the sequences out in rows (sorted
prefix trees: the choices of one question share the question's positions, each computed once), and the chosen
scoring method is checked against a plain forward of the model, as for TatBLiMP (``Scorer``).

The head is applied only where a continuation token is predicted (a context's own tokens are never read), tile
by tile (``greedy_head``); a request is greedy when every continuation token is its position's argmax, as
``HFLM`` decides.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.cells import Cells
from ..engine.forward import model_output
from ..engine.greedy_head import head_logprobs_and_greedy
from ..engine.model_checks import tree_mask_dtype
from ..engine.model_state import scoring_mode
from ..engine.packing import Batch, TokenSequences, build_layout
from ..engine.scored_spans import sequence_cache
from ..engine.scoring import Scorer
from ..engine.tiled_head import head_tile, plain_head_weight
from ..tokenized.cache import SentenceCache

CHECK_TOKENS = 64  # tokens of each sequence the scoring method is checked on

Request = tuple[Sequence[int], Sequence[int]]  # (context token ids, continuation token ids)


def request_sequences(requests: Sequence[Request], max_length: int) -> tuple[list[list[int]], list[int]]:
    """Each request's scored sequence (context + continuation, its last ``max_length + 1`` tokens) and continuation length.

    Raises:
        ValueError: a request with an empty context or continuation, or a continuation longer than ``max_length``.
    """
    sequences, continuation_lengths = [], []
    for k, (context, continuation) in enumerate(requests):
        if not context or not continuation:
            raise ValueError(f"harness request {k}: empty {'context' if not context else 'continuation'} tokens")
        if len(continuation) > max_length:
            raise ValueError(f"harness request {k}: a continuation of {len(continuation)} tokens, over max_length {max_length}")
        sequences.append([*context, *continuation][-(max_length + 1) :])
        continuation_lengths.append(len(continuation))
    return sequences, continuation_lengths


class RequestScorer:
    """Scores harness requests with one model: ``(log-prob, is_greedy)`` per request, in request order.

    Args:
        model: the causal LM (the harness's loaded model, or the training model).
        memory_budget: bytes of extra memory for activations and head tiles (None: the engine's default).
        row_length: positions per row (at least the longest sequence).

    The scoring method (tree, packed or padded rows; the head) is chosen at the first call, as the engine chooses
    it for TatBLiMP, and kept for the scorer's life.
    """

    def __init__(self, model: torch.nn.Module, *, memory_budget: int | None = None, row_length: int = 256):
        self.model = model
        self._options = {"memory_budget": memory_budget, "row_length": row_length}
        self.method = None  # chosen at the first call, for this model

    def score(self, requests: Sequence[Request], pad_id: int, max_length: int) -> list[tuple[float, bool]]:
        """``(sum of the continuation's token log-probs, every continuation token greedy)`` of each request."""
        if not requests:
            return []
        sequences, continuation_lengths = request_sequences(requests, max_length)
        device = next(self.model.parameters()).device
        cache = sequence_cache(sequences, pad_id, device, "lm-eval")
        scorer = Scorer(self.model, self._check_cache(sequences, pad_id, device), **self._options)
        with scoring_mode(self.model):
            if self.method is None:  # the fastest layout whose numbers equal a plain forward, chosen once
                self.method = scorer.check.when_due()
            method = self.method
            layout = build_layout(
                TokenSequences(cache.token_ids, cache.offsets),
                method.layout,
                scorer.row_length,
                scorer.tokens_per_batch,
                pad_id=pad_id,
                device=device,
                tree_mask_dtype=tree_mask_dtype(scorer.lm) or torch.bool,
            )
            cells = Cells(cache)
            logprobs, greedy = self._cells(scorer, layout, cells, method.head, continuation_lengths)
        per_request, per_greedy = cells.per_sentence(logprobs), cells.per_sentence(greedy)
        return [
            (sum(tokens[-n:]), all(g == 1.0 for g in flags[-n:]))
            for tokens, flags, n in zip(per_request, per_greedy, continuation_lengths, strict=True)
        ]

    @staticmethod
    def _check_cache(sequences: list[list[int]], pad_id: int, device: torch.device) -> SentenceCache:
        """The sequences as the method check sees them: their first ``CHECK_TOKENS`` tokens, within the context.

        The check compares each layout with a plain forward of the whole model on a sample; whether a model honours
        the tree mask and the position ids shows on short sequences as well, at a fraction of the cost (a sample of
        long multiple-choice contexts took 40 of a call's 46 seconds). The rows themselves are laid out for the full
        sequences in ``score``: a full rolling window is one token longer than the context, its last a target only.
        """
        return sequence_cache([s[:CHECK_TOKENS] for s in sequences], pad_id, device, "lm-eval")

    def _cells(self, scorer: Scorer, layout, cells: Cells, head: str, continuation_lengths: list[int]):
        """Every continuation token's log-prob and greedy flag (1.0 or 0.0) in its cell; context cells stay 0 and 1."""
        logprobs, greedy = cells.empty(), cells.empty() + 1
        # A sequence's first continuation slot: the slots before it predict context tokens, which nothing reads.
        first = cells.widths - torch.tensor(continuation_lengths, device=cells.device)
        weight = plain_head_weight(scorer.lm) if head == "tiled" else None
        for batch in layout.batches:
            wanted = batch.score_slots >= first[batch.score_sentences]
            if not wanted.any():
                continue
            lp, top = self._read(scorer, batch, weight, wanted)
            sentences, slots = batch.score_sentences[wanted], batch.score_slots[wanted]
            cells.write(logprobs, sentences, slots, lp)
            cells.write(greedy, sentences, slots, top)
            del batch, lp, top
        return logprobs, greedy

    def _read(self, scorer: Scorer, batch: Batch, weight, wanted: torch.Tensor):
        """log p(target | context) and whether the target is the argmax (1.0 or 0.0), for the batch's wanted tokens."""
        contexts, targets = batch.score_contexts[wanted], batch.score_targets[wanted]
        read, inverse = contexts.unique(return_inverse=True)  # only the contexts a continuation token needs
        narrowed = Batch(**{**vars(batch), "score_positions": batch.score_positions[read]})
        output = model_output(scorer.lm, scorer.lm, narrowed, "tiled" if weight is not None else "full_logits")
        vocab = weight.shape[0] if weight is not None else output.shape[-1]
        tile = head_tile(output.device, vocab, output.dtype, scorer.memory_budget)
        bias = scorer.lm.get_output_embeddings().bias if weight is not None else None
        cap = getattr(scorer.lm.config, "final_logit_softcapping", None)
        lp, top = head_logprobs_and_greedy(output, weight, bias, cap, inverse, targets.to(output.device), tile)
        return lp, top.to(lp.dtype)
