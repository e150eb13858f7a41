"""The harness model's calls without a per-call toll (issue #52, item 4): each call's scorer is bound to a scorer made
once for the model (``Scorer.for_cache``: the model's facts found once), a request's cells are its continuation's
only, the CPU tree masks of a pass share one buffer, and ``lm_eval``'s back-to-back calls keep the memory they free."""

from __future__ import annotations

import random

import pytest
import torch

import tatblimp_callback.engine.scoring as scoring_module
from conftest import tiny_llama
from tatblimp_callback.engine.cells import Cells
from tatblimp_callback.engine.model_checks import ScoringError
from tatblimp_callback.engine.scored_spans import flat_sequence_cache
from tatblimp_callback.engine.tree_mask import interval_mask, reused_buffer
from tatblimp_callback.harness.fused import RequestScorer, request_tokens


def questions(seed: int, count: int, vocab: int = 50) -> list[tuple[list[int], list[int]]]:
    """Multiple-choice requests: each question's choices hold one context list, as the harness model hands them out."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        context = [rng.randrange(1, vocab) for _ in range(rng.randint(3, 20))]
        requests += [(context, [rng.randrange(1, vocab) for _ in range(rng.randint(1, 4))]) for _ in range(4)]
    return requests


def plain_scores(model, requests) -> list[tuple[float, bool]]:
    """Each request's continuation log-prob and greedy flag from one plain forward of its whole sequence."""
    answers = []
    with torch.no_grad():
        for context, continuation in requests:
            ids = torch.tensor([context + continuation])
            logits = model(input_ids=ids[:, :-1]).logits[0].double()
            logprobs = logits.log_softmax(-1)[len(context) - 1 :]
            targets = torch.tensor(continuation)
            answers.append(
                (
                    float(logprobs.gather(-1, targets[:, None]).sum()),
                    bool((logits[len(context) - 1 :].argmax(-1) == targets).all()),
                )
            )
    return answers


def test_each_calls_scorer_is_bound_to_one_made_for_the_model_and_scores_as_a_plain_forward(monkeypatch):
    model = tiny_llama(50, seed=4).eval()
    scorer = RequestScorer(model, memory_budget=64 << 20)
    found = []
    precision = scoring_module.scoring_precision
    monkeypatch.setattr(scoring_module, "scoring_precision", lambda *a, **k: found.append(1) or precision(*a, **k))
    first = scorer.score(questions(0, 6), 0, 64)
    made = len(found)  # the method check's scorer: the model's facts found there
    for seed in (1, 2, 3):  # other requests each call
        requests = questions(seed, 5 + seed)
        answers = scorer.score(requests, 0, 64)
        for (ours, greedy), (theirs, plain_greedy) in zip(answers, plain_scores(model, requests), strict=True):
            assert ours == pytest.approx(theirs, abs=1e-4) and greedy == plain_greedy
    assert made == 1 and len(found) == made  # no call after the first walks the model for its precision again
    assert scorer._scorer.check is scorer._checker.check  # one method check for every call
    assert first == RequestScorer(model, memory_budget=64 << 20).score(questions(0, 6), 0, 64)


def test_binding_another_cache_checks_its_tokens_and_device():
    model = tiny_llama(50, seed=4).eval()
    scorer = RequestScorer(model, memory_budget=64 << 20)
    scorer.score(questions(0, 2), 0, 64)
    tokens, lengths, _continuations, _ = request_tokens([([1, 2], [60])], 64)
    cache = flat_sequence_cache(tokens, lengths, 0, torch.device("cpu"), "lm-eval")
    with pytest.raises(ScoringError, match="token id 60, but the model's embedding has only 50 rows"):
        scorer._checker.for_cache(cache)
    with pytest.raises(ScoringError, match="token id 60"):
        scorer.score([([1, 2], [60])], 0, 64)
    with pytest.raises(ValueError, match="the cache is on meta, this scorer's on cpu"):
        scorer._checker.for_cache(flat_sequence_cache(tokens, lengths, 0, torch.device("meta"), "lm-eval"))


def test_a_requests_cells_are_its_continuations_tokens():
    """4,000 multiple-choice requests of 150-word contexts held 1,040,028 cells, of which the head wrote 59,652."""
    requests = questions(5, 10)
    tokens, lengths, continuations, _ = request_tokens(requests, 64)
    cache = flat_sequence_cache(tokens, lengths, 0, torch.device("cpu"), "lm-eval")
    spans = Cells(cache.__class__(**{**cache.__dict__, "span_tokens": tuple(continuations.tolist())}))
    assert spans.total == sum(len(k) for _, k in requests) < Cells(cache).total == int(lengths.sum()) - len(requests)
    assert spans.widths.tolist() == [len(k) for _, k in requests]


def test_the_masks_of_a_pass_share_one_buffer_once_the_one_before_is_gone():
    generator = torch.Generator().manual_seed(0)
    sizes = [torch.randint(1, 9, (3, 8), generator=generator, dtype=torch.int16) for _ in range(3)]
    expected = [interval_mask(s).clone() for s in sizes]
    with reused_buffer():
        first = interval_mask(sizes[0])
        address, held = first.data_ptr(), first.clone()
        second = interval_mask(sizes[1])  # the first is still held: memory of its own
        assert second.data_ptr() != address
        del second
        third = interval_mask(sizes[2])  # the first is held still, though the one before this is gone
        assert third.data_ptr() != address and torch.equal(first, held) and torch.equal(third, expected[2])
        del first, third
        fourth = interval_mask(sizes[1])  # the buffer's mask is gone: written where it was
        assert fourth.data_ptr() == address and torch.equal(fourth, expected[1])
        del fourth
        smaller = interval_mask(sizes[0][:2])
        assert smaller.data_ptr() == address and torch.equal(smaller, expected[0][:2])
    assert torch.equal(interval_mask(sizes[1]), expected[1])  # no pass: a mask of its own


def test_the_harness_model_keeps_the_memory_it_frees_between_lm_evals_calls(monkeypatch, bpe_tokenizer, local_tasks):
    from lm_eval.api.instance import Instance

    from tatblimp_callback.harness.in_training import HarnessTasks
    from tatblimp_callback.harness.model import TatBLiMPLM

    released = []
    monkeypatch.setattr(scoring_module, "release_freed_memory", lambda device: released.append(device))
    model = tiny_llama(len(bpe_tokenizer), seed=3)
    requests = [Instance("loglikelihood", {}, ("Bu kitap", " yakhshy"), 0), Instance("loglikelihood", {}, ("Bu", " kitap"), 1)]
    TatBLiMPLM(pretrained=model, tokenizer=bpe_tokenizer).loglikelihood(requests, disable_tqdm=True)
    assert released == []
    TatBLiMPLM(pretrained=model, tokenizer=bpe_tokenizer, release_memory="True").loglikelihood(requests, disable_tqdm=True)
    assert len(released) == 1  # at the end of the call
    # Inside a training run: handed back after each pass.
    tasks = HarnessTasks(["local_mc"], bpe_tokenizer, include_path=str(local_tasks))
    lm = tasks._model_for(model)
    released.clear()
    lm.loglikelihood(requests, disable_tqdm=True)
    lm.loglikelihood(requests[:1], disable_tqdm=True)
    assert len(released) == 2


def test_a_questions_choices_share_one_row_where_the_question_is_at_most_twice_the_row():
    """400 multiple-choice requests of 150-word contexts took 180 rows of 332 positions for 100 questions: a question
    split over two rows computed its context twice. Rows are now as wide as the largest question where it is at most
    twice the row length otherwise used (there: 100 rows), and a row ends before a question it would split."""
    model = tiny_llama(50, seed=4).eval()
    requests = questions(7, 12)
    trees = [len(requests[q][0]) + sum(len(k) - 1 for _, k in requests[q : q + 4]) for q in range(0, len(requests), 4)]
    longest = max(len(c) + len(k) for c, k in requests)
    assert longest < max(trees) <= 2 * longest
    scorer = RequestScorer(model, memory_budget=64 << 20, row_length=8)
    answers = scorer.score(requests, 0, 64)
    assert scorer._scorer.row_length == max(trees)
    rows = scorer._scorer.layout().batches.rows.rows()
    assert all(len({k // 4 for k in row}) == len(row) // 4 for row in rows)  # whole questions a row
    plain = plain_scores(model, requests)
    assert [a for a, _ in answers] == pytest.approx([a for a, _ in plain], abs=1e-4)
    assert [g for _, g in answers] == [g for _, g in plain]
    # A question more than twice as long as the rows would be (8): they stay 8 long, the question split.
    context = [5, 6, 7]
    wide = [(context, [token, 8, 9, 10]) for token in range(11, 23)]  # one context list, as the harness hands it out
    scorer.score(wide, 0, 64)
    assert scorer._scorer.row_length == 8 and scorer._scorer.layout().batches.rows.num_rows > 1
    # Beside questions that fit, such a group (as BLiMP's requests in a fused cache, which share only the prefix token)
    # does not keep the rows from being widened to them.
    larger = [(context, [a, b, 8, 9]) for a in range(11, 21) for b in range(21, 31)]  # 3 + 100 x 3 inputs as a tree
    scorer.score(requests + larger, 0, 64)
    assert scorer._scorer.row_length == max(trees)
