"""``memory_budget=`` (bytes) and ``row_length=`` (positions a row) are None or a positive whole number at every entry
point: the callbacks and the ``Evaluator`` refuse anything else when made, the ``Scorer`` too, naming the option.
Before, a negative or fractional budget was taken silently and ``"2GB"`` failed inside the first evaluation."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_llama
from tatblimp_callback import Evaluator, Scorer, TatBLiMPCallback

BAD = [("memory_budget", -5), ("memory_budget", 0), ("memory_budget", 1.5e9), ("memory_budget", "2GB"), ("row_length", 0)]
BAD += [("row_length", 12.0), ("row_length", True)]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_every_entry_point_refuses_a_size_that_is_not_a_positive_whole_number(bpe_tokenizer, small_data, name, value):
    from tatblimp_callback import build_cache
    from tatblimp_callback.lightning import TatBLiMPLightningCallback

    message = f"^{name} must be a positive whole number of .*; got {value!r}$"
    for make in (TatBLiMPCallback, TatBLiMPLightningCallback, lambda **o: Evaluator(bpe_tokenizer, small_data, **o)):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            make(**{name: value})
    cache = build_cache(bpe_tokenizer, small_data, allow_modified=True)
    with pytest.raises(ValueError, match=message):
        Scorer(tiny_llama(len(bpe_tokenizer)), cache, **{name: value})


def test_whole_numbers_of_any_integer_type_and_none_are_taken(bpe_tokenizer, small_data):
    from tatblimp_callback import build_cache

    cache = build_cache(bpe_tokenizer, small_data, allow_modified=True)
    scorer = Scorer(tiny_llama(len(bpe_tokenizer)), cache, memory_budget=np.int64(2**24), row_length=np.int32(64))
    assert scorer.memory_budget == 2**24 and scorer.row_length >= 64
    assert TatBLiMPCallback(memory_budget=None, row_length=None).memory_budget is None
