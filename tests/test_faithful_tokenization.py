"""A raw SentencePiece model is scored with raw sentencepiece ids, and a converted tokenizer that
gives other ids is detected (transformers 5 always converts ``tokenizer.model`` to a fast tokenizer)."""

from __future__ import annotations

import json
import shutil

import pytest
import sentencepiece as spm
import torch

from conftest import DATA, SPM_MODEL, reference_logprobs, tiny_llama
from tatblimp_callback import SentencePieceTokenizer, TatBLiMPCallback, build_cache, evaluate, load_benchmark, load_tokenizer
from tatblimp_callback.cli import main
from tatblimp_callback.tokenized.tokenization import check_sentencepiece_mismatch, compare_tokenizations

pytestmark = pytest.mark.skipif(not SPM_MODEL.exists(), reason=f"the shared SentencePiece model is not at {SPM_MODEL}")


@pytest.fixture(scope="module")
def sentences():
    return load_benchmark(DATA).sentences


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The shared model loaded the transformers way: LlamaTokenizer on a folder holding it as tokenizer.model."""
    from transformers import LlamaTokenizer

    folder = tmp_path_factory.mktemp("spm")
    shutil.copy(SPM_MODEL, folder / "tokenizer.model")
    return LlamaTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, converted):
    """A model folder with both a converted tokenizer (tokenizer.json + config) and the raw tokenizer.model."""
    folder = tmp_path_factory.mktemp("model")
    tiny_llama(len(converted), hidden=16).save_pretrained(folder)
    converted.save_pretrained(folder)
    shutil.copy(SPM_MODEL, folder / "tokenizer.model")
    return folder


def test_converted_tokenizer_differs_from_raw_sentencepiece(sentences, converted):
    raw = SentencePieceTokenizer(SPM_MODEL)
    assert len(sentences) == 2496
    assert compare_tokenizations(raw, converted, sentences) == 2062
    assert compare_tokenizations(raw, SentencePieceTokenizer(SPM_MODEL), sentences) == 0


def test_the_scorer_uses_raw_ids_for_a_model_file(sentences, converted):
    tokenizer = load_tokenizer(str(SPM_MODEL))
    assert isinstance(tokenizer, SentencePieceTokenizer)
    cache = build_cache(tokenizer, DATA)
    processor = spm.SentencePieceProcessor(model_file=str(SPM_MODEL))
    bos = processor.bos_id()
    raw_ids = [[bos, *ids] for ids in processor.encode(sentences)]
    assert all(cache.sentence(s) == raw_ids[s] for s in range(cache.num_sentences))
    converted_ids = converted(sentences, add_special_tokens=False)["input_ids"]
    assert sum(cache.sentence(s)[1:] != converted_ids[s] for s in range(cache.num_sentences)) == 2062


def test_evaluate_with_a_sentencepiece_tokenizer_scores_raw_ids(small_data):
    tokenizer = SentencePieceTokenizer(SPM_MODEL)
    model = tiny_llama(len(tokenizer), hidden=16)
    results = evaluate(model, tokenizer, small_data, allow_modified=True)
    benchmark = load_benchmark(small_data, allow_modified=True)
    processor = spm.SentencePieceProcessor(model_file=str(SPM_MODEL))
    reference = reference_logprobs(model, [[processor.bos_id(), *ids] for ids in processor.encode(benchmark.sentences)])
    scored = [value for pair in results.pairs for value in (pair.good_logprob, pair.bad_logprob)]
    assert scored == pytest.approx(reference, abs=1e-3)
    assert results.tokenizer == str(SPM_MODEL)


def test_cli_score_warns_about_a_converted_tokenizer_and_accepts_the_model_file(model_dir, small_data, tmp_path, caplog):
    benchmark = load_benchmark(small_data, allow_modified=True)
    expected = compare_tokenizations(SentencePieceTokenizer(SPM_MODEL), load_tokenizer(model_dir), benchmark.sentences)
    assert 40 < expected < len(benchmark.sentences)

    common = ["--data", str(small_data), "--allow-modified", "--device", "cpu"]
    assert main(["score", str(model_dir), *common, "--output", str(tmp_path / "converted.json")]) == 0
    err = caplog.text  # the CLI logs to stderr; under pytest the log goes to caplog
    assert f"on {expected} of {len(benchmark.sentences)} benchmark sentences" in err
    assert f"--tokenizer {model_dir / 'tokenizer.model'}" in err
    converted = json.loads((tmp_path / "converted.json").read_text())
    assert converted["sentencepiece_mismatches"] == expected

    raw_file = str(model_dir / "tokenizer.model")
    caplog.clear()
    assert main(["score", str(model_dir), *common, "--tokenizer", raw_file, "--output", str(tmp_path / "raw.json")]) == 0
    assert "different token ids" not in caplog.text
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert raw["tokenizer"] == raw_file and "sentencepiece_mismatches" not in raw
    processor = spm.SentencePieceProcessor(model_file=raw_file)
    assert raw["tokens"] == sum(len(ids) for ids in processor.encode(benchmark.sentences))
    assert raw["tokens"] != converted["tokens"]


def test_no_warning_without_a_difference(model_dir, sentences, caplog):
    raw = SentencePieceTokenizer(SPM_MODEL)
    assert check_sentencepiece_mismatch(model_dir, raw, sentences) is None  # raw already: nothing to compare
    assert check_sentencepiece_mismatch(model_dir.parent, raw, sentences) is None  # no tokenizer.model there
    assert check_sentencepiece_mismatch(model_dir, load_tokenizer(model_dir), sentences[:4]) == 4
    assert "on 4 of 4 benchmark sentences" in caplog.text


def test_callback_with_a_sentencepiece_tokenizer(small_data, tmp_path):
    from transformers import Trainer, TrainingArguments

    tokenizer = SentencePieceTokenizer(SPM_MODEL)
    model = tiny_llama(len(tokenizer), hidden=16).train()
    corpus = [torch.tensor([tokenizer.bos_token_id, *ids][:32]) for ids in tokenizer.encode_batch(["Бу яхшы китап."] * 8)]
    dataset = [{"input_ids": ids, "labels": ids} for ids in corpus]
    callback = TatBLiMPCallback(eval_steps=1, tokenizer=tokenizer, data=small_data, allow_modified=True, raise_on_error=True)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        learning_rate=1e-3,
    )
    Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback]).train()
    assert [entry["step"] for entry in callback.history] == [0, 1, 2]
    cache = callback._evaluator.cache
    processor = spm.SentencePieceProcessor(model_file=str(SPM_MODEL))
    first = load_benchmark(small_data, allow_modified=True).sentences[0]
    assert cache.sentence(0) == [processor.bos_id(), *processor.encode(first)]
    # The last score is the definition on raw sentencepiece ids, computed plainly with the trained weights.
    raw_ids = [processor.bos_id(), *processor.encode(first)]
    assert abs(callback.last_results.pairs[0].good_logprob - reference_logprobs(model, [raw_ids])[0]) < 1e-4
