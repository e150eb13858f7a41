"""The prefix token: BOS, else EOS, else the caller's; never two BOS; byte lengths on Cyrillic text."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import DATA, SPM_MODEL
from tatblimp_callback import SentencePieceTokenizer, TokenizationError, build_cache, compute_results, load_benchmark
from tatblimp_callback.tokenized.tokenization import encode_sentences, resolve_prefix_token_id

SENTENCES = ["Мин китап укыйм.", "Бакчаның кешесе юк."]


def test_bos_prefix(bpe_tokenizer):
    encoded = encode_sentences(bpe_tokenizer, SENTENCES, resolve_prefix_token_id(bpe_tokenizer))
    plain = bpe_tokenizer(SENTENCES, add_special_tokens=False)["input_ids"]
    assert [ids[0] for ids in encoded] == [bpe_tokenizer.bos_token_id] * 2
    assert [ids[1:] for ids in encoded] == plain


def test_eos_prefix_when_there_is_no_bos(eos_only_tokenizer):
    assert eos_only_tokenizer.bos_token_id is None
    prefix = resolve_prefix_token_id(eos_only_tokenizer)
    assert prefix == eos_only_tokenizer.eos_token_id
    assert encode_sentences(eos_only_tokenizer, SENTENCES, prefix)[0][0] == prefix


def test_caller_prefix_overrides(bpe_tokenizer):
    assert resolve_prefix_token_id(bpe_tokenizer, 7) == 7
    assert encode_sentences(bpe_tokenizer, SENTENCES, 7)[1][0] == 7


def test_no_prefix_at_all_is_an_error(eos_only_tokenizer):
    class NoSpecials:
        bos_token_id = eos_token_id = None
        name_or_path = "bare"

    with pytest.raises(TokenizationError, match="bare has neither a BOS nor an EOS"):
        resolve_prefix_token_id(NoSpecials())


def test_tokenizer_that_adds_bos_itself_gets_no_second_one(bpe_tokenizer):
    class AddsBos:
        """Adds BOS and EOS even when asked not to, as some tokenizers do."""

        bos_token_id, eos_token_id, name_or_path = bpe_tokenizer.bos_token_id, bpe_tokenizer.eos_token_id, "adds-bos"

        def __call__(self, texts, add_special_tokens=True):
            ids = bpe_tokenizer(texts, add_special_tokens=False)["input_ids"]
            return {"input_ids": [[self.bos_token_id, *x, self.eos_token_id] for x in ids]}

    bos = bpe_tokenizer.bos_token_id
    encoded = encode_sentences(AddsBos(), SENTENCES, bos)
    assert encoded == encode_sentences(bpe_tokenizer, SENTENCES, bos)
    assert all(ids.count(bos) == 1 for ids in encoded)


def test_an_ordinary_prefix_token_is_kept_where_the_sentence_has_it(bpe_tokenizer):
    """A user's prefix such as "." is not a special token: a sentence ending (or starting) with it keeps it."""
    period = bpe_tokenizer.convert_tokens_to_ids(".")
    plain = bpe_tokenizer(SENTENCES, add_special_tokens=False)["input_ids"]
    assert [ids[-1] for ids in plain] == [period, period] and period not in bpe_tokenizer.all_special_ids
    assert encode_sentences(bpe_tokenizer, SENTENCES, period) == [[period, *ids] for ids in plain]

    first = plain[0][0]  # "Мин", the first token of the first sentence, as the prefix
    encoded = encode_sentences(bpe_tokenizer, SENTENCES, first)
    assert encoded[0] == [first, first, *plain[0][1:]] and len(encoded[0]) == len(plain[0]) + 1


def test_an_ordinary_padding_token_is_kept_where_the_sentence_has_it(bpe_tokenizer):
    import copy

    tokenizer = copy.deepcopy(bpe_tokenizer)
    tokenizer.pad_token = "."  # an ordinary token as padding: now in all_special_ids, but never inserted
    period = tokenizer.pad_token_id
    assert period in tokenizer.all_special_ids
    plain = bpe_tokenizer(SENTENCES, add_special_tokens=False)["input_ids"]
    assert encode_sentences(tokenizer, SENTENCES, tokenizer.bos_token_id) == [[tokenizer.bos_token_id, *ids] for ids in plain]
    assert plain[0][-1] == period


def test_an_unknown_token_at_either_end_is_kept():
    """<unk> is one of all_special_ids, but it stands for text the vocabulary lacks: it is scored, never stripped."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "мин": 3, "барам": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    assert tokenizer.unk_token_id in tokenizer.all_special_ids
    assert encode_sentences(tokenizer, ["龍 мин барам 龍"], tokenizer.bos_token_id) == [[1, 0, 3, 4, 0]]


def test_an_ordinary_prefix_token_is_kept_with_raw_sentencepiece():
    tokenizer = SentencePieceTokenizer(SPM_MODEL)
    plain = tokenizer.encode_batch(SENTENCES)
    last = plain[0][-1]
    assert last not in (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert encode_sentences(tokenizer, SENTENCES[:1], last) == [[last, *plain[0]]]


def test_raw_sentencepiece_ids():
    import sentencepiece as spm

    tokenizer = SentencePieceTokenizer(SPM_MODEL)
    raw = spm.SentencePieceProcessor(model_file=str(SPM_MODEL)).encode(SENTENCES)
    assert encode_sentences(tokenizer, SENTENCES, tokenizer.bos_token_id) == [[1, *ids] for ids in raw]


def test_acc_norm_divides_by_bytes_not_characters(bpe_tokenizer):
    cache = build_cache(bpe_tokenizer, DATA)
    benchmark = load_benchmark(DATA)
    byte_lengths = cache.byte_lengths.numpy()
    assert byte_lengths[0] == len(benchmark.pairs[0].good.encode("utf-8")) > len(benchmark.pairs[0].good)
    # Log-probs proportional to character counts: every pair ties per character, so only the
    # byte normalisation separates them, in the direction of the byte/char ratios.
    chars = np.array([len(s) for s in benchmark.sentences], dtype=np.float64)
    logprobs = -2.0 * chars
    results = compute_results(cache, torch.tensor(logprobs))
    good_norm, bad_norm = logprobs[0::2] / byte_lengths[0::2], logprobs[1::2] / byte_lengths[1::2]
    assert results.acc_norm == pytest.approx(float((good_norm > bad_norm).mean()))
    by_chars = float(((logprobs[0::2] / chars[0::2]) > (logprobs[1::2] / chars[1::2])).mean())
    assert by_chars == 0.0  # ties by characters all fail ...
    assert results.acc_norm > 0.2  # ... but bytes differ, and separate many pairs


def test_ties_fail_and_are_counted(bpe_tokenizer):
    cache = build_cache(bpe_tokenizer, DATA)
    logprobs = torch.full((2496,), -10.0, dtype=torch.float64)
    logprobs[0::2][:100] = -9.0  # 100 pairs where good wins
    results = compute_results(cache, logprobs)
    assert results.acc == pytest.approx(100 / 1248)
    assert results.overall.ties == 1148
    assert sum(g.ties for g in results.phenomena.values()) == 1148


def test_a_tokenizer_built_in_memory_is_named_by_its_fingerprint(bpe_tokenizer, eos_only_tokenizer):
    from tatblimp_callback.tokenized.tokenization import tokenizer_fingerprint, tokenizer_name

    name = tokenizer_name(bpe_tokenizer)
    # By its kind and size: transformers' class name (TokenizersBackend for every fast one) tells a reader nothing.
    assert (
        name
        == f"a BPE tokenizer built in memory ({len(bpe_tokenizer):,} tokens, fingerprint {tokenizer_fingerprint(bpe_tokenizer)})"
    )
    assert tokenizer_name(eos_only_tokenizer) != name  # two in-memory tokenizers are told apart
