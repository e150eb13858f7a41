"""A harness model that answers each log-likelihood request from a table: the fused pass's, in the training loop.

The harness's own ``evaluate`` runs with it (``in_training.HarnessTasks.metrics``), so that the filters,
``process_results`` and aggregation are the harness's, while nothing is encoded or scored again. It reports
rank 0 of 1 on every process: each process holds every request's answer (gathered by the fused pass) and
computes the same metrics, with no collective of the harness's own.
"""

from __future__ import annotations

from lm_eval.api.model import LM

from ..engine.model_state import scoring_mode


class TableLM(LM):
    """Answers ``loglikelihood`` and ``loglikelihood_rolling`` from ``answers``; ``generate_until`` by ``generator``.

    Args:
        answers: ``{(request type, request args): answer}``: ``(log-prob, is_greedy)`` or a rolling log-likelihood.
        generator: the harness model that generates (``model.TatBLiMPLM``: ``HFLM``'s ``generate_until``), in
            ``model_state.scoring_mode`` as every pass that runs the model.
    """

    def __init__(self, answers: dict, generator=None):
        super().__init__()
        self.answers, self.generator = answers, generator

    def _answer(self, kind: str, request):
        try:
            return self.answers[kind, tuple(request.args)]
        except KeyError:
            raise ValueError(f"a harness {kind} request not built at prepare: {request.args!r:.200}") from None

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return [self._answer("loglikelihood", r) for r in requests]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return [self._answer("loglikelihood_rolling", r) for r in requests]

    def generate_until(self, requests, disable_tqdm: bool = False):
        if self.generator is None:
            raise ValueError("a harness generate_until request, and no model to generate with")
        with scoring_mode(self.generator.model):  # dropout off; the training model's own modes back after
            return self.generator.generate_until(requests, disable_tqdm=True)
