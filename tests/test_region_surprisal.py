"""Critical-region surprisal (bits) with the word-start correction equals a plain per-word computation from the full
softmax of a tiny model, within 1e-4 bits, for a byte-level BPE, a raw SentencePiece model and a WordPiece tokenizer;
it reaches the per-pair records, the per-phenomenon means and ``explain``."""

from __future__ import annotations

import math
import re

import pytest
import torch

from conftest import DATA, SPM_MODEL, tiny_llama, train_bpe
from tatblimp_callback.evaluation import Evaluator
from tatblimp_callback.reading.data import load_benchmark
from tatblimp_callback.reading.edit import find_edit
from tatblimp_callback.tokenized.tokenization import SentencePieceTokenizer
from test_tokenizers_command import hf_raw_tokens, sentencepiece_raw_tokens, train_wordpiece

# Pairs of several kinds: a substitution inside a word (0), an added word (passives), the first word edited.
PHENOMENA = ("anaphor_agreement", "passives", "quantifiers", "word_order", "suspended_affixation", "npi_licensing")


@pytest.fixture(scope="module")
def pairs():
    benchmark = load_benchmark(DATA)
    chosen = [next(i for i, p in enumerate(benchmark.pairs) if p.phenomenon == name) for name in PHENOMENA]
    first_word = next(i for i, p in enumerate(benchmark.pairs) if p.good.split()[0] != p.bad.split()[0])
    return benchmark.pick([*chosen, first_word])


def word_spans(text):
    return [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]


def reference_bits(model, prefix, ids, spans, text, other, starts, first_word_marked):
    """Per word, p(word | words before) = p(its tokens) * p(B after it) / p(B before it), from the full softmax in
    float64, summed over the words the edit touches (the whitespace words overlapping where ``text`` and ``other``
    differ, or the word at the point of an insertion)."""
    a = next((k for k, (x, y) in enumerate(zip(text, other)) if x != y), min(len(text), len(other)))
    tail = next((k for k, (x, y) in enumerate(zip(text[a:][::-1], other[a:][::-1])) if x != y), min(len(text), len(other)) - a)
    b = len(text) - tail
    touched = [w for w in word_spans(text) if ((w[0] < b and a < w[1]) if a < b else w[0] <= a <= w[1])]
    with torch.no_grad():
        logprobs = model(input_ids=torch.tensor([[prefix, *ids]])).logits[0].double().log_softmax(-1)
    starts = torch.tensor(sorted(starts))
    total = 0.0
    for ws, we in touched:
        tokens = [k for k, (s, e) in enumerate(spans) if any(not text[c].isspace() for c in range(max(s, ws), min(e, we)))]
        first, last = tokens[0], tokens[-1] + 1
        word = sum(float(logprobs[k, ids[k]]) for k in range(first, last))
        after = float(logprobs[last, starts].logsumexp(0))
        before = 0.0 if first == 0 and not first_word_marked else float(logprobs[first, starts].logsumexp(0))
        total += word + after - before
    return -total / math.log(2)


def kinds(tmp_path_factory):
    from transformers import AutoTokenizer

    bpe = train_bpe(vocab_size=500, lines=2000)
    wordpiece = AutoTokenizer.from_pretrained(train_wordpiece(tmp_path_factory.mktemp("wp")))
    return {"bpe": bpe, "sentencepiece": SentencePieceTokenizer(SPM_MODEL), "wordpiece": wordpiece}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return kinds(tmp_path_factory)


def starts_of(kind, tokenizer):
    if kind == "sentencepiece":
        pieces = [tokenizer.processor.id_to_piece(i) for i in range(len(tokenizer))]
        starts = {i for i, p in enumerate(pieces) if p.startswith("▁")}
    else:
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        special = set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}  # an unknown word starts a word too
        if kind == "bpe":
            starts = {i for i, p in enumerate(pieces) if p.startswith("Ġ")} - special
        else:
            starts = {i for i, p in enumerate(pieces) if not p.startswith("##")} - special
    return starts | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece", "wordpiece"])
def test_region_surprisal_equals_a_per_word_reference(kind, tokenizers, pairs, tmp_path):
    tokenizer = tokenizers[kind]
    model = tiny_llama(len(tokenizer), seed=1)
    prefix = 0 if kind == "wordpiece" else None  # WordPiece here has neither BOS nor EOS
    results = Evaluator(tokenizer, pairs, include_tokens=True, allow_modified=True, prefix_token_id=prefix)(model)
    prefix = (
        prefix
        if prefix is not None
        else (tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id)
    )
    sentences = [s for p in pairs.pairs for s in (p.good, p.bad)]
    raw = sentencepiece_raw_tokens(SPM_MODEL, sentences) if kind == "sentencepiece" else None
    if raw is None:
        folder = tmp_path / "tok"
        tokenizer.save_pretrained(folder)
        raw = hf_raw_tokens(folder, sentences)
    starts = starts_of(kind, tokenizer)
    checked = 0
    for index, (pair, record) in enumerate(zip(pairs.pairs, results.pair_tokens)):
        for side, text, other in (("good", pair.good, pair.bad), ("bad", pair.bad, pair.good)):
            ids, spans, _ = raw[2 * index + (side == "bad")]
            first_marked = ids[0] in starts
            expected = reference_bits(model, prefix, ids, spans, text, other, starts, first_marked)
            assert record.critical_region_bits[side] == pytest.approx(expected, abs=1e-4), (kind, index, side)
            checked += 1
        assert record.critical_region_bits["word_marks"] == ("continuation" if kind == "wordpiece" else "start")
    assert checked == 2 * len(pairs)
    record = results.to_dict()
    means = record["critical_region_surprisal"]
    bits = [r.critical_region_bits for r in results.pair_tokens]
    assert means["mean_difference_bits"] == pytest.approx(sum(b["bad"] - b["good"] for b in bits) / len(bits))
    assert set(means["phenomena"]) == set(pairs.phenomena)
    assert record["pairs"][0]["critical_region_bits"]["good"] == bits[0]["good"]


def test_the_correction_matters_for_leading_space_tokens(tokenizers, pairs):
    """Without the word-start terms the reference differs: the test can tell a plain sum of token surprisals."""
    tokenizer = tokenizers["bpe"]
    model = tiny_llama(len(tokenizer), seed=1)
    results = Evaluator(tokenizer, pairs, include_tokens=True, allow_modified=True)(model)
    record = results.pair_tokens[0]
    i, j = record.critical_region_tokens["good"]
    plain = -sum(record.good_token_logprobs[i:j]) / math.log(2)
    assert abs(record.critical_region_bits["good"] - plain) > 0.01


def test_end_of_word_marks_need_no_correction(pairs):
    """A BPE whose word-final tokens carry ``</w>``: a word's tokens say where it ends, so the region's surprisal is
    the sum of its tokens' surprisals, the tokens being those that cover the region's characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.BPEDecoder(suffix="</w>")
    text = [s for p in load_benchmark(DATA).pairs[::2] for s in (p.good, p.bad)]
    backend.train_from_iterator(
        text, trainers.BpeTrainer(vocab_size=700, end_of_word_suffix="</w>", special_tokens=["<unk>", "<s>"])
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", unk_token="<unk>")
    model = tiny_llama(len(tokenizer), seed=2)
    results = Evaluator(tokenizer, pairs, include_tokens=True, allow_modified=True)(model)
    for pair, record in zip(pairs.pairs, results.pair_tokens):
        assert record.critical_region_bits["word_marks"] == "end"
        offsets = tokenizer(pair.good, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        region = record.critical_region_tokens["good"]
        start, end = find_edit(pair.good, pair.bad).good_region
        assert (offsets[region[0]][0], offsets[region[1] - 1][1]) == (start, end)  # the words, whole
        plain = -sum(record.good_token_logprobs[slice(*region)]) / math.log(2)
        assert record.critical_region_bits["good"] == pytest.approx(plain, abs=1e-4)  # the scorer's float32 sums
