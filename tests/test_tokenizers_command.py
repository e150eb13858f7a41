"""``tatblimp tokenizers``: each figure equals an independent computation from the tokenizers' own offset mappings,
for a byte-level BPE, a WordPiece and a raw SentencePiece Unigram model, on the whole of TatBLiMP; and the command
loads neither torch nor transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import DATA, REPO, SPM_MODEL, train_bpe
from tatblimp_callback.cli import main
from tatblimp_callback.reading.edit import find_edit


def train_wordpiece(folder):
    """A WordPiece tokenizer (``##`` continuations, BERT's pre-tokenizer) trained on the benchmark's sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    records = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    text = [r[k] for r in records[::3] for k in ("good", "bad")]  # a third of the pairs, 50 characters: some words stay unknown
    tokenizer.train_from_iterator(
        text, trainers.WordPieceTrainer(vocab_size=600, limit_alphabet=50, special_tokens=["[UNK]", "[CLS]", "[SEP]"])
    )
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]").save_pretrained(
        folder
    )
    return folder


@pytest.fixture(scope="module")
def tokenizer_folders(tmp_path_factory):
    bpe = tmp_path_factory.mktemp("bpe")
    train_bpe(vocab_size=600, lines=2000).save_pretrained(bpe)
    return {"bpe": bpe, "wordpiece": train_wordpiece(tmp_path_factory.mktemp("wordpiece"))}


def hf_raw_tokens(folder, sentences):
    """(ids, untrimmed offsets, unknown/byte flags) from transformers' own tokenizer and offset mapping."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    encoded = tokenizer(sentences, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for ids, offsets in zip(encoded["input_ids"], encoded["offset_mapping"]):
        pieces = tokenizer.convert_ids_to_tokens(ids)
        flags = [i == tokenizer.unk_token_id or (p.startswith("<0x") and len(p) == 6) for i, p in zip(ids, pieces)]
        out.append((ids, [tuple(o) for o in offsets], flags))
    return out


def sentencepiece_raw_tokens(model_file, sentences):
    """(ids, offsets, flags) with the offsets rebuilt from the pieces alone: "▁" is a space (the first one added
    by SentencePiece), byte pieces are gathered until they make a character."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(model_file))
    out = []
    for text in sentences:
        ids = processor.encode(text)
        spans, flags, position, pending = [], [], 0, b""
        for token in ids:
            piece = processor.id_to_piece(token)
            flags.append(processor.is_byte(token) or processor.is_unknown(token))
            if processor.is_byte(token):
                pending += bytes([int(piece[3:5], 16)])
                try:
                    char = pending.decode("utf-8")
                except UnicodeDecodeError:
                    spans.append((position, position))
                    continue
                pending = b""
                assert text[position : position + len(char)] == char
                spans.append((position, position + len(char)))
                position += len(char)
                continue
            surface = piece.replace("▁", " ")
            if surface.startswith(" ") and not text[position:].startswith(" "):
                surface = surface[1:]  # the space SentencePiece adds before the first word
            assert text[position : position + len(surface)] == surface, (text, piece)
            spans.append((position, position + len(surface)))
            position += len(surface)
        out.append((ids, spans, flags))
    return out


def common_start(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def reference_figures(pairs, raw):
    """Every pair's figures from raw offsets, computed character by character."""

    def covered(text, span):  # the non-whitespace characters a token covers
        return {c for c in range(*span) if not text[c].isspace()}

    def boundary(text, spans, p):
        return not any(min(cs) < p <= max(cs) for cs in (covered(text, s) for s in spans) if cs)

    def count_in(text, spans, region):
        a, b = region
        chars = set(range(a, b))
        n = 0
        for s in spans:
            cs = covered(text, s)
            if cs:
                n += bool(cs & chars) if a < b else min(cs) < a <= max(cs)
            else:  # no character of its own: a byte piece before its character, or whitespace only
                n += a <= s[1] < b
        return n

    figures = []
    for index, pair in enumerate(pairs):
        (g_ids, g_spans, g_flags), (b_ids, b_spans, b_flags) = raw[2 * index], raw[2 * index + 1]
        good, bad = pair["good"], pair["bad"]
        prefix = common_start(good, bad)
        suffix = common_start(good[prefix:][::-1], bad[prefix:][::-1])
        g_edit, b_edit = (prefix, len(good) - suffix), (prefix, len(bad) - suffix)
        edit = find_edit(good, bad)
        assert (edit.good, edit.bad) == (g_edit, b_edit)

        def flagged(text, spans, flags, region):
            return sum(f for s, f in zip(spans, flags) if count_in(text, [s], region))

        figures.append(
            {
                "good_edit_tokens": count_in(good, g_spans, g_edit),
                "bad_edit_tokens": count_in(bad, b_spans, b_edit),
                "aligned": all(boundary(good, g_spans, p) for p in g_edit) and all(boundary(bad, b_spans, p) for p in b_edit),
                "region_one_token": count_in(good, g_spans, edit.good_region) == 1
                and count_in(bad, b_spans, edit.bad_region) == 1,
                "token_difference": len(b_ids) - len(g_ids),
                "identical_ids": g_ids == b_ids,
                "flagged_at_edit": flagged(good, g_spans, g_flags, g_edit) + flagged(bad, b_spans, b_flags, b_edit),
                "good_tokens": len(g_ids),
                "bad_tokens": len(b_ids),
            }
        )
    return figures


def test_critical_region_is_the_whole_words_the_edit_touches():
    edit = find_edit("Мин китап укыйм.", "Мин китаплар укыйм.")
    assert (edit.good, edit.bad, edit.good_region, edit.bad_region) == ((9, 9), (9, 12), (4, 9), (4, 12))
    edit = find_edit("Ул килде.", "Ул килмәде.")  # the edit touches the word with its full stop
    assert edit.bad_region == (3, 11) and "Ул килмәде."[slice(*edit.bad_region)] == "килмәде."
    edit = find_edit("a b", "a  b")  # whitespace only: no word
    assert edit.bad == (2, 3) and edit.bad_region == (2, 2)


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "sentencepiece"])
def test_every_figure_equals_an_independent_computation_from_offsets(kind, tokenizer_folders, records, tmp_path):
    source = str(SPM_MODEL) if kind == "sentencepiece" else str(tokenizer_folders[kind])
    out = tmp_path / "figures.json"
    assert main(["tokenizers", source, "--data", str(DATA), "--output", str(out), "--include-pairs"]) == 0
    figures = json.loads(out.read_text(encoding="utf-8"))["suites"]["tatblimp"][0]
    sentences = [r[k] for r in records for k in ("good", "bad")]
    raw = sentencepiece_raw_tokens(SPM_MODEL, sentences) if kind == "sentencepiece" else hf_raw_tokens(source, sentences)
    expected = reference_figures(records, raw)
    keys = list(expected[0])
    assert [{k: p[k] for k in keys} for p in figures["pairs"]] == expected
    n = len(records)
    assert figures["n"] == n
    assert figures["edit_aligned"] == sum(e["aligned"] for e in expected) / n
    assert figures["region_one_token"] == sum(e["region_one_token"] for e in expected) / n
    assert figures["mean_token_difference"] == pytest.approx(sum(e["token_difference"] for e in expected) / n)
    assert figures["bad_longer"] == sum(e["token_difference"] > 0 for e in expected) / n
    total_bytes = sum(len(s.encode("utf-8")) for s in sentences)
    assert figures["tokens_per_byte"] == pytest.approx(sum(len(r[0]) for r in raw) / total_bytes)
    assert figures["identical_ids"] == sum(e["identical_ids"] for e in expected)
    assert figures["flagged_pairs"] == sum(e["flagged_at_edit"] > 0 for e in expected)
    one = next(iter(figures["phenomena"]))
    members = [e for e, r in zip(expected, records) if r["phenomenon"] == one]
    assert figures["phenomena"][one]["edit_aligned"] == sum(e["aligned"] for e in members) / len(members)
    if kind == "wordpiece":  # 50 characters: words with others are unknown, counted at the edit
        assert figures["flagged_pairs"] > 0
    assert 0 < figures["edit_aligned"] < 1 and figures["mean_edit_tokens_bad"] > 0


def test_the_ids_are_the_ones_scored(tokenizer_folders, records):
    """The command's torch-free tokenizer gives the ids ``score`` scores (transformers' tokenizer, specials stripped)."""
    from transformers import AutoTokenizer

    from tatblimp_callback.commands.tokenizers import load_light_tokenizer
    from tatblimp_callback.tokenized.tokenization import encode_plain

    sentences = [r["good"] for r in records[:200]]
    for folder in tokenizer_folders.values():
        light = load_light_tokenizer(str(folder))
        assert encode_plain(light, sentences) == encode_plain(AutoTokenizer.from_pretrained(folder), sentences)
        assert light.bos_token_id == AutoTokenizer.from_pretrained(folder).bos_token_id


def test_the_command_imports_no_torch_and_prints_a_table(tokenizer_folders):
    code = (
        "import sys\nfrom tatblimp_callback.cli import main\n"
        f"code = main(['tokenizers', {str(tokenizer_folders['bpe'])!r}, {str(SPM_MODEL)!r}, '--data', {str(DATA)!r}])\n"
        "print('LOADED', sorted(m for m in ('torch', 'transformers') if m in sys.modules), code)\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.rstrip().endswith("LOADED [] 0")
    assert completed.stdout.count("overall ") == 2 and "aligned" in completed.stdout


def test_a_missing_tokenizer_is_named(tmp_path, capsys):
    assert main(["tokenizers", str(tmp_path / "nope.model"), "--data", str(DATA)]) == 1
    assert "nope.model: no such SentencePiece model file" in capsys.readouterr().err


def test_a_suite_gets_its_own_figures(tmp_path, records):
    """``--suite``: BLiMP's pairs measured as TatBLiMP's (the edit of "was" / "were" is a whole word)."""
    from conftest import SHARED

    suite = tmp_path / "blimp"
    suite.mkdir()
    lines = (SHARED / "blimp" / "data" / "passive_1.jsonl").read_text(encoding="utf-8").splitlines()[:40]
    (suite / "passive_1.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "figures.json"
    argv = ["tokenizers", str(SPM_MODEL), "--data", str(DATA), "--suite", f"blimp={suite}", "--output", str(out)]
    assert main([*argv, "--include-pairs"]) == 0
    suites = json.loads(out.read_text(encoding="utf-8"))["suites"]
    assert list(suites) == ["tatblimp", "blimp"] and suites["blimp"][0]["n"] == 40
    first = json.loads(lines[0])
    pair = suites["blimp"][0]["pairs"][0]
    assert pair["critical_region"]["good_text"] in first["sentence_good"].split()
    assert main([*argv, "--suites-only"]) == 0
    assert list(json.loads(out.read_text(encoding="utf-8"))["suites"]) == ["blimp"]


def test_byte_fallback_pieces_are_flagged_at_the_edit():
    """The raw SentencePiece model spells an unseen character in byte pieces: flagged, and spanning its character."""
    from tatblimp_callback.tokenized.edit_tokens import edit_tokens_of_pairs, token_spans
    from tatblimp_callback.tokenized.tokenization import SentencePieceTokenizer

    tokenizer = SentencePieceTokenizer(SPM_MODEL)
    good, bad = "Мин китап укыйм.", "Мин ♞ укыйм."
    spans = token_spans(tokenizer, [bad])[0]
    byte_pieces = [k for k, piece in enumerate(spans.pieces) if piece.startswith("<0x")]
    assert len(byte_pieces) == 3 and all(spans.flagged[k] for k in byte_pieces)
    assert [spans.spans[k] for k in byte_pieces] == [(4, 4), (4, 4), (4, 5)]  # the last completes "♞"

    class Pair:
        phenomenon = "x"

    pair = Pair()
    pair.good, pair.bad = good, bad
    (facts,) = edit_tokens_of_pairs(tokenizer, [pair])
    assert facts.flagged_at_edit == 3 and facts.aligned
