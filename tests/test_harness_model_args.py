"""``--model tatblimp``'s own model arguments, as ``lm_eval`` hands them from ``--model_args`` (strings it has cast to
int, float, bool or None where it could): sizes read as sizes, and a bad value a ``ValueError`` naming the argument
and its value, before any model is loaded."""

from __future__ import annotations

import pytest

from conftest import tiny_llama

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.registry import get_model  # noqa: E402

from tatblimp_callback.harness import register  # noqa: E402


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("memory_budget=abc", "memory_budget='abc' is not a size in bytes"),
        ("memory_budget=-5", "memory_budget=-5 is not a size in bytes"),
        ("memory_budget=0", "memory_budget=0 is not a size in bytes"),
        ("memory_budget=1.5", "memory_budget=1.5 is not a size in bytes"),
        ("memory_budget=inf", "memory_budget=inf is not a size in bytes"),
        ("row_length=0", "row_length=0 is not a positive whole number"),
        ("row_length=wide", "row_length='wide' is not a positive whole number"),
        ("release_memory=maybe", "release_memory='maybe' is not true or false"),
    ],
)
def test_a_bad_model_argument_is_named_before_the_model_is_loaded(tmp_path, argument, message):
    register()
    missing = tmp_path / "no-model-here"  # loading it would fail otherwise, with another error
    with pytest.raises(ValueError, match=f"^--model tatblimp: {message}"):
        get_model("tatblimp").create_from_arg_string(f"pretrained={missing},{argument}", {"device": "cpu"})


@pytest.mark.parametrize(
    ("arguments", "options"),
    [
        ("memory_budget=2GB,row_length=128,release_memory=true", (2_000_000_000, 128, True)),
        ("memory_budget=500MiB,release_memory=no", (500 * 2**20, 256, False)),
        ("memory_budget=1e9,release_memory=0", (1_000_000_000, 256, False)),
        ("memory_budget=None", (None, 256, False)),
    ],
)
def test_sizes_counts_and_flags_reach_the_request_scorer(bpe_tokenizer, arguments, options):
    model = tiny_llama(len(bpe_tokenizer))
    extra = {"pretrained": model, "tokenizer": bpe_tokenizer, "device": "cpu"}
    lm = register().create_from_arg_string(arguments, extra)
    scorer = lm.request_scorer
    assert (scorer._options["memory_budget"], scorer._options["row_length"], scorer._options["release_memory"]) == options


def test_device_in_model_args_wins_over_the_command_lines_default(bpe_tokenizer, caplog):
    """``lm_eval --model_args ...,device=cpu`` without ``--device``: the harness passed its own default (cuda:0) as well,
    and the model failed with "got multiple values for keyword argument 'device'"."""
    model = tiny_llama(len(bpe_tokenizer))
    lm = register().create_from_arg_string("device=cpu", {"pretrained": model, "tokenizer": bpe_tokenizer, "device": "cuda:0"})
    assert str(lm.device) == "cpu" and "device=cpu from --model_args, not cuda:0" in caplog.text
    again = register().create_from_arg_obj({"device": "cpu", "pretrained": model, "tokenizer": bpe_tokenizer}, {"device": "cpu"})
    assert str(again.device) == "cpu"
