"""argparse ``type=`` functions for the commands' numeric options, and the checks of the Python API's flags and counts.

A value out of range is refused by the parser, as a value that is no number is: status 2, the subcommand's usage
and ``argument --limit: must be a whole number of at least 1, got 0``, before anything is imported or loaded.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers


def _number(text: str, kind: type, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def whole_number(minimum: int):
    """The type function of a whole-number option of at least ``minimum``."""
    what = f"a whole number of at least {minimum}"

    def parse(text: str) -> int:
        value = _number(text, int, what)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    parse.__name__ = f"whole_number_from_{minimum}"
    return parse


positive_int = whole_number(1)  # a count of pairs, processes, tokens
natural_int = whole_number(0)  # an index, a step, a number of retries


def positive_float(text: str) -> float:
    """A finite number above 0 (seconds)."""
    value = _number(text, float, "a number above 0")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number of at least 0 (seconds to wait, where 0 means none)."""
    value = _number(text, float, "a number of at least 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of at least 0, got {text}")
    return value


def share(text: str) -> float:
    """A number in (0, 1] (a share of a GPU's memory)."""
    value = _number(text, float, "a number above 0 and at most 1")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number above 0 and at most 1, got {text}")
    return value


def accuracy(text: str) -> float:
    """A number in [0, 1] (an acc_norm threshold)."""
    value = _number(text, float, "a number from 0 to 1")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text}")
    return value


def json_object(text: str) -> dict:
    """A JSON object (extra fields of each request)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"must be a JSON object, e.g. '{{\"top_k\": 1}}'; {text!r} is not JSON ({err.msg})"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{\"top_k\": 1}}', got {text}")
    return value


def is_whole_number(value) -> bool:
    """An integer of any integer type (numpy's too), and not a bool (which Python counts as one)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_flags(**flags) -> None:
    """Options of the Python API that are True or False: a string such as ``"no"`` would read as True.

    Raises:
        ValueError: the first that is not a bool, named with its value.
    """
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
