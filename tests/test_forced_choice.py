"""Forced choice for chat models: prompts, the batched decision, the metrics, the CLI and the callback."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from conftest import (
    CHAT_TEMPLATE,
    CORPUS,
    DATA,
    ignore_tree_masks,
    tiny_llama,
    write_pairs,
)
from tatblimp_callback import load_benchmark
from tatblimp_callback.chat.forced_choice import (
    DEFAULT_PROMPT,
    DEFAULT_ROW_LENGTH,
    ForcedChoiceEvaluator,
    build_prompt_cache,
    check_prompt,
    compute_choice_results,
    evaluate_forced_choice,
    items_from_logprobs,
)
from tatblimp_callback.cli import main
from tatblimp_callback.engine.scoring import Scorer, ScoringError, ScoringMethod
from tatblimp_callback.reading.data import Benchmark, Pair
from tatblimp_callback.tokenized.tokenization import TokenizationError


@pytest.fixture(scope="module")
def fc_data(records, tmp_path_factory):
    """The first pair of each phenomenon: 16 pairs, 32 items (chat prompts are long for a CPU)."""
    firsts = {}
    for record in records:
        firsts.setdefault(record["phenomenon"], record)
    return write_pairs(tmp_path_factory.mktemp("fc") / "fc.jsonl", list(firsts.values()))


@pytest.fixture(scope="module")
def model(chat_tokenizer):
    return tiny_llama(len(chat_tokenizer), max_position_embeddings=512)


@pytest.fixture(scope="module")
def cache(chat_tokenizer, fc_data):
    return build_prompt_cache(chat_tokenizer, fc_data, allow_modified=True)


def fc_scorer(model, cache, **options) -> Scorer:
    """The scoring engine on prompts, with the forced-choice evaluator's row length unless given."""
    return Scorer(model, cache, **{"row_length": DEFAULT_ROW_LENGTH, **options})


@pytest.fixture(scope="module")
def reference(model, cache):
    """log P(A), log P(B) after each prompt, one prompt at a time, plain forward, float64 softmax."""
    a, b = cache.answer_ids
    rows = []
    with torch.no_grad():
        for k in range(cache.num_sentences):
            logits = model(input_ids=torch.tensor([cache.sentence(k)])).logits[0, -1].double()
            rows.append(logits.log_softmax(-1)[[a, b]])
    return torch.stack(rows)


def test_prompts_show_each_pair_in_both_orderings(chat_tokenizer, cache, fc_data):
    benchmark = load_benchmark(fc_data, allow_modified=True)
    assert cache.num_sentences == 2 * len(benchmark) == 32
    assert cache.answer_ids == tuple(chat_tokenizer.convert_tokens_to_ids(["A", "B"]))
    for i in (0, 7, 15):
        pair = benchmark.pairs[i]
        first, second = (chat_tokenizer.decode(cache.sentence(k)) for k in (2 * i, 2 * i + 1))
        assert f"A: {pair.good}\nB: {pair.bad}\n" in first  # item 2i: A = good, right answer A
        assert f"A: {pair.bad}\nB: {pair.good}\n" in second  # item 2i+1: A = bad, right answer B
        expected = chat_tokenizer.apply_chat_template(
            [{"role": "user", "content": DEFAULT_PROMPT.format(a=pair.good, b=pair.bad)}], add_generation_prompt=True
        )
        assert cache.sentence(2 * i) == list(expected["input_ids"])
        assert first.endswith("</s>\n<s>assistant\n")


def test_full_benchmark_has_2496_prompts(chat_tokenizer):
    cache = build_prompt_cache(chat_tokenizer, DATA)
    assert cache.num_sentences == 2496 and cache.num_pairs == 1248 and cache.benchmark_release == load_benchmark(DATA).release


def test_custom_prompt_and_system_prompt(chat_tokenizer, fc_data):
    prompt = "Грамматик җөмлә? 1) {a} 2) {b} — {{A}} яки {{B}}"
    cache = build_prompt_cache(chat_tokenizer, fc_data, prompt=prompt, system_prompt="Be brief.", allow_modified=True)
    pair = load_benchmark(fc_data, allow_modified=True).pairs[0]
    text = chat_tokenizer.decode(cache.sentence(1))
    assert text.startswith("<s>system\nBe brief.</s>\n<s>user\n")
    assert f"1) {pair.bad} 2) {pair.good} — {{A}} яки {{B}}" in text
    for bad in ("only {a}", "{a} {b} {c}", "{a} {b} {"):
        with pytest.raises(ValueError, match="forced-choice prompt"):
            check_prompt(bad)


def test_answer_letters_must_be_single_tokens(chat_tokenizer, fc_data):
    from tokenizers import AddedToken

    # A template ending in a space and a tokenizer with a " A" token: "A" would merge with the space.
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.add_tokens([AddedToken(" A", normalized=False)])
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<s>assistant\n", "<s>assistant: ")
    with pytest.raises(TokenizationError, match=r"the answer 'A' is not a single token after the chat template"):
        build_prompt_cache(tokenizer, fc_data, allow_modified=True)
    plain = copy.deepcopy(chat_tokenizer)
    plain.chat_template = None
    with pytest.raises(TokenizationError, match="has no chat template"):
        build_prompt_cache(plain, fc_data, allow_modified=True)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(method=ScoringMethod("padded", "tiled")),
        dict(method=ScoringMethod("packed", "tiled")),
        dict(method=ScoringMethod("tree", "full_logits")),
        dict(memory_budget=8 * 2**20, row_length=300, method="tree"),
    ],
    ids=["auto", "padded", "packed", "tree-logits", "many-batches"],
)
def test_batched_decision_equals_one_prompt_at_a_time(model, cache, reference, options):
    scorer = fc_scorer(model, cache, **options)
    logprobs = scorer.score()
    assert logprobs.shape == (32, 2)
    assert (logprobs.double() - reference).abs().max().item() < 1e-4
    if not options:
        assert str(scorer.method) == "tree rows, tiled head"
        # The chat template and the question are computed once a row, not once a prompt.
        assert scorer.layout("tree").saved_by_prefix_sharing > 0.3
    if "memory_budget" in options:
        assert len(scorer.layout("tree").batches) >= 3
    items = items_from_logprobs(logprobs)
    expected = ["A" if a > b else "B" for a, b in reference.tolist()]
    assert [item.answer for item in items] == expected
    # The reference margins are far from zero, so no decision hangs on rounding.
    assert (reference[:, 0] - reference[:, 1]).abs().min().item() > 1e-3


def test_falls_back_to_padded_rows_when_trees_and_packing_are_ignored(model, cache, reference, monkeypatch):
    import transformers.masking_utils as masking_utils

    ignore_tree_masks(monkeypatch)
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    scorer = fc_scorer(model, cache)
    logprobs = scorer.score()
    assert scorer.method.layout == "padded"
    assert (logprobs.double() - reference).abs().max().item() < 1e-4


def test_a_nan_prompt_does_not_spread_through_its_row(chat_tokenizer, cache):
    # A token that occurs in the prompts of one pair only (both orderings show both sentences) gets a NaN embedding.
    users: dict[int, set[int]] = {}
    for k in range(cache.num_sentences):
        for token in cache.sentence(k):
            users.setdefault(token, set()).add(k)
    token = next(t for t in sorted(users) if len(users[t]) == 2)
    poisoned = sorted(users[token])
    model = tiny_llama(len(chat_tokenizer), max_position_embeddings=512)
    with torch.no_grad():
        model.model.embed_tokens.weight[token] = float("nan")
    # One prompt a row: what a plain forward gives.
    reference = fc_scorer(model, cache, method=ScoringMethod("padded", "tiled")).score()
    assert (~torch.isfinite(reference)).any(1).nonzero().flatten().tolist() == poisoned
    scorer = fc_scorer(model, cache)
    logprobs = scorer.score()
    assert str(scorer.method) == "tree rows, tiled head"  # one row shares the NaN prompt with others
    shared = next(b for b in scorer.layout().batches if poisoned[0] in b.score_sentences.tolist())
    assert set(poisoned) < set(shared.score_sentences.tolist())  # its forward computes other prompts too
    assert (~torch.isfinite(logprobs)).any(1).nonzero().flatten().tolist() == poisoned
    finite = torch.isfinite(reference)
    assert (logprobs[finite] - reference[finite]).abs().max().item() < 1e-4
    items = items_from_logprobs(logprobs)
    assert [k for k, item in enumerate(items) if item.note == "non_finite"] == poisoned


def _benchmark(phenomena: list[str]) -> Benchmark:
    pairs = tuple(Pair(good=f"good {i}", bad=f"bad {i}", phenomenon=p) for i, p in enumerate(phenomena))
    return Benchmark(pairs=pairs, source="crafted", md5="0" * 32)


def test_metrics_on_crafted_logprobs():
    benchmark = _benchmark(["x", "x", "y", "y"])
    # Columns: log P("A"), log P("B"). Item 2i expects A, item 2i+1 expects B.
    logprobs = [
        [-1.0, -2.0],
        [-3.0, -1.0],  # pair 0: A (right), B (right): right in both orders
        [-1.0, -0.5],
        [-2.0, -1.0],  # pair 1: B (wrong), B (right)
        [-1.0, -1.0],
        [-0.1, -4.0],  # pair 2: tie (wrong), A (wrong)
        [math.nan, -1.0],
        [-5.0, -0.2],  # pair 3: non-finite (wrong), B (right)
    ]
    results = compute_choice_results(benchmark, items_from_logprobs(torch.tensor(logprobs)), model="m", prompt=DEFAULT_PROMPT)
    o = results.overall
    assert (o.items, o.pairs) == (8, 4)
    assert o.accuracy == pytest.approx(4 / 8)
    assert o.both_orders == pytest.approx(1 / 4)
    assert (o.answers_a, o.answers_b, o.ties, o.non_finite, o.unparsed) == (2, 4, 1, 1, 0)
    assert o.a_share == pytest.approx(2 / 6)
    x, y = results.phenomena["x"], results.phenomena["y"]
    assert (x.accuracy, x.both_orders, x.a_share) == (pytest.approx(3 / 4), 0.5, pytest.approx(1 / 4))
    assert (y.accuracy, y.both_orders, y.a_share) == (pytest.approx(1 / 4), 0.0, pytest.approx(1 / 2))
    flat = results.flat_metrics()
    assert flat["tatblimp_fc/accuracy"] == pytest.approx(0.5) and flat["tatblimp_fc/both_orders"] == pytest.approx(0.25)
    assert flat["tatblimp_fc/x/both_orders"] == 0.5 and flat["tatblimp_fc/ties"] == 1.0 and flat["tatblimp_fc/non_finite"] == 1.0
    payload = json.loads(json.dumps(results.to_dict()))
    assert (
        payload["accuracy"] == 0.5 and payload["per_item"][4]["note"] == "tie" and payload["per_item"][6]["note"] == "non_finite"
    )
    table = results.format_table()
    assert "overall" in table and "1 items with log-prob ties, counted as wrong" in table


def test_position_bias_of_a_model_that_always_answers_a():
    benchmark = load_benchmark(DATA)
    always_a = torch.tensor([[-0.1, -3.0]] * 2496)
    results = compute_choice_results(benchmark, items_from_logprobs(always_a), model="a", prompt=DEFAULT_PROMPT)
    assert (results.overall.items, results.overall.pairs) == (2496, 1248)
    assert results.accuracy == 0.5 and results.both_orders == 0.0 and results.a_share == 1.0
    assert all(g.accuracy == 0.5 and g.a_share == 1.0 for g in results.phenomena.values())


def test_evaluator_restores_mode_and_tokenizes_once(chat_tokenizer, fc_data, monkeypatch):
    model = tiny_llama(len(chat_tokenizer), max_position_embeddings=512, attention_dropout=0.5).train()
    evaluator = ForcedChoiceEvaluator(chat_tokenizer, fc_data, allow_modified=True)
    first = evaluator(model)
    assert model.training
    import tatblimp_callback.chat.forced_choice as fc

    monkeypatch.setattr(fc, "build_prompt_cache", lambda *a, **k: pytest.fail("tokenized again"))
    second = evaluator(model)
    # Dropout was off while scoring, so the two evaluations agree exactly.
    assert [i.logprob_a for i in first.items] == [i.logprob_a for i in second.items]
    assert first.overall.items == 32 and first.run_info["answer_token_ids"] == list(
        chat_tokenizer.convert_tokens_to_ids(["A", "B"])
    )


def test_prompt_longer_than_context_is_an_error(chat_tokenizer, cache):
    short = tiny_llama(len(chat_tokenizer), max_position_embeddings=64)
    with pytest.raises(ScoringError, match=r"forced-choice item \d+ \(pair \d+, (good|bad)_first\) has \d+ prompt tokens"):
        fc_scorer(short, cache)


def test_cli_forced_choice_end_to_end(model, chat_tokenizer, fc_data, reference, tmp_path, capsys):
    folder = tmp_path / "chat-model"
    model.save_pretrained(folder)
    chat_tokenizer.save_pretrained(folder)
    out = tmp_path / "fc.json"
    code = main(
        [
            "score",
            str(folder),
            "--data",
            str(fc_data),
            "--allow-modified",
            "--protocol",
            "forced-choice",
            "--device",
            "cpu",
            "--output",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0 and "both-orders" in printed and "32 items (16 pairs x 2 orderings)" in printed
    payload = json.loads(out.read_text(encoding="utf-8"))
    assert payload["protocol"] == "forced-choice" and payload["model"] == str(folder)
    assert (payload["items"], payload["pairs"]) == (32, 16) and len(payload["per_item"]) == 32
    expected = ["A" if a > b else "B" for a, b in reference.tolist()]
    assert [i["answer"] for i in payload["per_item"]] == expected
    right = [answer == "AB"[k % 2] for k, answer in enumerate(expected)]
    assert payload["accuracy"] == pytest.approx(sum(right) / 32)
    assert payload["both_orders"] == pytest.approx(sum(right[k] and right[k + 1] for k in range(0, 32, 2)) / 16)

    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("no placeholders here", encoding="utf-8")
    assert (
        main(
            [
                "score",
                str(folder),
                "--data",
                str(fc_data),
                "--allow-modified",
                "--protocol",
                "forced-choice",
                "--prompt-file",
                str(prompt_file),
            ]
        )
        == 1
    )
    assert "forced-choice prompt must contain {a} and {b}" in capsys.readouterr().err
    assert main(["score", "--endpoint", "http://127.0.0.1:9/v1", "--model-name", "m", "--data", str(fc_data)]) == 1
    assert "--protocol logprob with --endpoint needs --tokenizer" in capsys.readouterr().err


def _sft_dataset(tokenizer, count: int = 32) -> list[dict]:
    """Chat-formatted examples (user: a corpus line, assistant: "A"), as in supervised fine-tuning."""
    lines = [line for line in CORPUS.read_text(encoding="utf-8").splitlines()[:400] if line.strip()][:count]
    examples = []
    for line in lines:
        chat = [{"role": "user", "content": line[:120]}, {"role": "assistant", "content": "A"}]
        ids = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)[:96]
        examples.append({"input_ids": ids, "labels": ids})
    return examples


def test_callback_logs_forced_choice_during_training(chat_tokenizer, fc_data, tmp_path):
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from tatblimp_callback import TatBLiMPCallback

    model = tiny_llama(len(chat_tokenizer), max_position_embeddings=512).train()
    callback = TatBLiMPCallback(
        eval_steps=2, data=fc_data, allow_modified=True, protocol="both", log_table=False, raise_on_error=True
    )
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_sft_dataset(chat_tokenizer),
        processing_class=chat_tokenizer,
        data_collator=DataCollatorForSeq2Seq(chat_tokenizer, padding=True),
        callbacks=[callback],
    )
    trainer.train()
    steps = [entry["step"] for entry in callback.history]
    assert steps == [0, 2]
    for entry in callback.history:
        assert 0 <= entry["tatblimp_fc/accuracy"] <= 1 and 0 <= entry["tatblimp_fc/both_orders"] <= entry["tatblimp_fc/accuracy"]
        assert "tatblimp/acc_norm" in entry and "tatblimp_fc/subject_verb_agreement/accuracy" in entry
    logged = [e for e in trainer.state.log_history if "tatblimp_fc/accuracy" in e]
    assert [e["step"] for e in logged] == [0, 2]
    assert model.training and callback.failures == 0
    # The last logged numbers are those of the trained model.
    final = evaluate_forced_choice(model, chat_tokenizer, fc_data, allow_modified=True)
    assert callback.last_fc_results.accuracy == final.accuracy == callback.history[-1]["tatblimp_fc/accuracy"]
    with pytest.raises(ValueError, match="protocol must be"):
        TatBLiMPCallback(protocol="chat")
