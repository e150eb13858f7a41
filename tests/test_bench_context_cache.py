"""``benchmarks/bench_context_cache.py``'s design (contexts once, their choices after the KV cache) scores the harness's
requests as the harness model does, so that the host times it reports compare two ways of reaching the same answers."""

from __future__ import annotations

import pytest

from conftest import CORPUS, REPO, load_module, tiny_llama

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.models.huggingface import HFLM  # noqa: E402

from tatblimp_callback.harness import register  # noqa: E402
from test_harness_encoding import requests_of  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return load_module(REPO / "benchmarks" / "bench_context_cache.py")


@pytest.mark.parametrize("second", ["choice_rows", "question_rows"])
@pytest.mark.parametrize("batch_positions", [64, 1 << 16])  # several batches; one, of every context length
def test_contexts_once_then_their_choices_give_the_harness_models_answers(bench, bpe_tokenizer, second, batch_positions):
    model = tiny_llama(len(bpe_tokenizer), seed=5)
    lm = register()(pretrained=model, tokenizer=bpe_tokenizer)
    # Multiple choice with shared contexts of several lengths, one-token endings, and empty contexts (the prefix token).
    requests = requests_of(CORPUS.read_text(encoding="utf-8").splitlines()[:24])
    lm._encoding_only = True
    with lm._encodings(requests):
        encoded = HFLM.loglikelihood(lm, requests, disable_tqdm=True)
    lm._encoding_only = False
    engine = lm._loglikelihood_tokens(encoded)
    spent = {"body": 0.0, "head": 0.0, "kv_copy": 0.0, "kv_bytes": 0}
    ours = bench.two_phase(model, encoded, lm.prefix_token_id, batch_positions, 1 << 24, spent, getattr(bench, second))
    assert len(ours) == len(engine) == 5 * 24
    assert max(abs(a - b) for (a, _), (b, _) in zip(engine, ours)) < 1e-4
    assert [g for _, g in ours] == [g for _, g in engine]
    assert spent["body"] > 0 and spent["head"] > 0 and spent["kv_bytes"] > 0
    assert (spent["kv_copy"] > 0) == (second == "choice_rows")  # question rows read their own cache row, no copy
