"""``--model tatblimp`` encodes a call's requests as ``--model hf`` does, each distinct string once (issue #52)."""

from __future__ import annotations

import pytest

from conftest import CORPUS, tiny_llama

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from tatblimp_callback.harness import register  # noqa: E402


def requests_of(lines: list[str]) -> list[Instance]:
    """Multiple choice (a context, four endings, a trailing space now and then) and BLiMP-like empty contexts."""
    requests = []
    for k, line in enumerate(lines):
        words = line.split()
        context = " ".join(words[:12]) + (" " if k % 3 == 0 else "")
        for j in range(4):
            ending = " ".join(words[12 + j : 15 + j]) or "ә"
            requests.append(Instance("loglikelihood", {}, (context, (" " if k % 3 else "") + ending), len(requests)))
        requests.append(Instance("loglikelihood", {}, ("", " " + line), len(requests)))
    return requests


def test_each_distinct_string_is_encoded_once_with_the_harness_encoding(bpe_tokenizer, monkeypatch):
    model = tiny_llama(len(bpe_tokenizer), seed=4)
    hf = HFLM(pretrained=model, tokenizer=bpe_tokenizer, batch_size=4)
    ours = register()(pretrained=model, tokenizer=bpe_tokenizer)
    requests = requests_of(CORPUS.read_text(encoding="utf-8").splitlines()[:30])
    encoded = []
    monkeypatch.setattr(type(hf), "_loglikelihood_tokens", lambda self, reqs, **kw: encoded.append(reqs) or [])
    hf.loglikelihood(requests, disable_tqdm=True)
    theirs = [(list(context), list(continuation)) for _, context, continuation in encoded[0]]
    reads = []  # of the prefix token id through the tokenizer: the harness asks twice per empty-context request
    prefix = HFLM.prefix_token_id
    monkeypatch.setattr(HFLM, "prefix_token_id", property(lambda self: reads.append(1) or prefix.fget(self)))
    calls, batch_calls = [], []
    original, original_batch = type(bpe_tokenizer).encode, type(bpe_tokenizer).__call__
    monkeypatch.setattr(type(bpe_tokenizer), "encode", lambda self, *a, **kw: calls.append(a) or original(self, *a, **kw))
    monkeypatch.setattr(
        type(bpe_tokenizer), "__call__", lambda self, *a, **kw: batch_calls.append(kw) or original_batch(self, *a, **kw)
    )
    assert ours.encode(requests) == theirs
    assert len(calls) <= 8  # the sample compared with the one-string call; the rest in one batch call
    # The ids alone: no attention masks nor token type ids built for thousands of strings.
    batches = [kw for kw in batch_calls if kw.get("return_attention_mask") is False]
    assert batches and all(kw.get("return_token_type_ids") is False for kw in batches)
    assert not ours._encoded  # nothing kept between calls
    assert len(reads) == 1 and ours._prefix is None  # read once for the call (30 requests here have empty contexts)
