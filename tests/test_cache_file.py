"""Saving the sentence cache from several processes at once, on one host or on several sharing a filesystem."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from tatblimp_callback import SentenceCache, build_cache


@pytest.mark.parametrize("hosts", [("node-a", "node-b"), ("container", "container")], ids=["two-hosts", "one-hostname"])
def test_two_processes_with_one_process_id_save_one_path_at_once(hosts, bpe_tokenizer, small_data, tmp_path, monkeypatch):
    """Process ids repeat across nodes (and containers share host names): the second process writes and renames
    its file while the first is between writing and renaming; both must succeed and leave one good file."""
    import safetensors.torch

    cache = build_cache(bpe_tokenizer, small_data, allow_modified=True)
    path = tmp_path / "cache.safetensors"
    real_save_file = safetensors.torch.save_file
    written = []

    def save_file_then_the_other_process_saves(tensors, filename, metadata=None):
        real_save_file(tensors, filename, metadata=metadata)
        written.append(filename)
        if len(written) == 1:
            monkeypatch.setattr(socket, "gethostname", lambda: hosts[1])
            cache.save(path)

    monkeypatch.setattr(socket, "gethostname", lambda: hosts[0])
    monkeypatch.setattr(safetensors.torch, "save_file", save_file_then_the_other_process_saves)
    cache.save(path)

    assert len(written) == 2 and written[0] != written[1]
    assert all(f".{host}.{os.getpid()}." in name for host, name in zip(hosts, written))
    assert sorted(tmp_path.iterdir()) == [path]  # no temporary file left behind
    loaded = SentenceCache.load(path)
    assert torch.equal(loaded.token_ids, cache.token_ids) and loaded.fingerprint == cache.fingerprint


def test_a_cache_reused_by_fingerprint_names_this_run_s_benchmark(bpe_tokenizer, small_data, tmp_path):
    from conftest import tiny_llama
    from tatblimp_callback import Evaluator
    from tatblimp_callback.reading.data import load_benchmark

    model = tiny_llama(len(bpe_tokenizer))
    cache_path, first = tmp_path / "cache.safetensors", tmp_path / "first.jsonl"
    first.write_bytes(small_data.read_bytes())
    # Saved by a run over a selection that kept every pair (3 a phenomenon, a limit of 1000): the whole file.
    everything = load_benchmark(first, allow_modified=True).select(limit=1000)
    assert everything.selection is None
    saved = Evaluator(bpe_tokenizer, everything, cache_path=cache_path)(model)
    assert not saved.partial and saved.benchmark_source == str(first)
    # The file moves; the full run reuses the cache (same bytes, same pairs) and says what it scored.
    moved = tmp_path / "moved.jsonl"
    first.rename(moved)
    stamp = cache_path.stat().st_mtime_ns
    results = Evaluator(bpe_tokenizer, moved, allow_modified=True, cache_path=cache_path)(model)
    assert cache_path.stat().st_mtime_ns == stamp  # reused, not rebuilt
    record = results.to_dict()
    assert results.benchmark_source == str(moved) and record["selection"] is None and record["partial"] is False
    assert results.acc_norm == saved.acc_norm and [p.good_logprob for p in results.pairs] == [p.good_logprob for p in saved.pairs]
    cache = build_cache(bpe_tokenizer, moved, allow_modified=True, cache_path=cache_path)
    assert (cache.benchmark_source, cache.benchmark_selection) == (str(moved), None)
