"""``tatblimp report --model``: a pair listed under acc_norm shows the per-byte margin that decides acc_norm (as
``tatblimp explain`` does), a pair listed under acc the sentence margin that decides acc."""

from __future__ import annotations

import re

from conftest import DATA
from tatblimp_callback import evaluate
from tatblimp_callback.cli import main
from tatblimp_callback.commands.explain import normalised_margin
from tatblimp_callback.reading.data import load_benchmark
from test_report_where_features_meet import history


def listed(html: str, metric: str) -> list[tuple[int, str]]:
    """(pair index in the file, its <li>) of every lost and learned list of ``metric``."""
    blocks = re.findall(rf'<div class="flips" [^>]*data-metric="{metric}">(.*?)</ul></details></div>', html, re.S)
    return [(int(i), item) for block in blocks for i, item in re.findall(r'<li data-pair="(\d+)">(.*?)</li>', block, re.S)]


def test_the_acc_norm_lists_give_the_per_byte_margin(model_dir, bpe_tokenizer, tmp_path):
    from tatblimp_callback.commands.loading import load_model

    chosen = load_benchmark(DATA).select(limit=8, phenomena="binding,quantifiers,word_order")
    runs = history(tmp_path / "tatblimp_history.jsonl", (5, 6, 7), bpe_tokenizer, chosen)
    report = tmp_path / "report.html"
    assert main(["report", str(runs), "--output", str(report), "--model", str(model_dir), "--device", "cpu"]) == 0
    html = report.read_text(encoding="utf-8")
    in_file_order = evaluate(load_model(model_dir, "cpu"), bpe_tokenizer, chosen).pairs
    scored = dict(zip(chosen.file_indices, in_file_order))  # the page names a pair by its index in the file

    # The pairs shown token by token (report_pairs: the first of each list and kind).
    by_bytes = [(i, item) for i, item in listed(html, "acc_norm") if 'class="meta"' in item]
    in_all = [(i, item) for i, item in listed(html, "acc") if 'class="meta"' in item]
    assert by_bytes and in_all
    for index, item in by_bytes:
        pair = scored[index]
        shown = re.search(r"margin per byte ([-+]\d\.\d{4}) nats; in all ([-+]\d+\.\d\d) nats: at the edit", item)
        assert shown, item
        assert shown.group(1) == f"{normalised_margin(pair):+.4f}"
        assert shown.group(2) == f"{pair.good_logprob - pair.bad_logprob:+.2f}"
    for index, item in in_all:
        pair = scored[index]
        assert "per byte" not in item
        assert re.search(r"margin ([-+]\d+\.\d\d) nats: at the edit", item).group(1) == (
            f"{pair.good_logprob - pair.bad_logprob:+.2f}"
        )
    # A listed pair whose two margins differ in sign: the raw one would say the wrong thing about acc_norm.
    assert any((normalised_margin(scored[i]) > 0) != (scored[i].good_logprob > scored[i].bad_logprob) for i, _ in by_bytes)
