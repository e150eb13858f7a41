"""Score causal language models on TatBLiMP, the Tatar benchmark of linguistic minimal pairs.

Entry points: ``TatBLiMPCallback`` for the Hugging Face Trainer, ``evaluate`` and ``Evaluator``
for custom loops, ``load_benchmark`` for the data (``load_suite`` for BLiMP, TurBLiMP, MultiBLiMP or your own), and the ``tatblimp`` command. Chat models:
``evaluate_forced_choice`` (local) and ``evaluate_endpoint`` (an OpenAI-compatible server).

The public names are imported when first used (PEP 562), so ``import tatblimp_callback`` and the command's
``--help`` load neither torch nor transformers; ``from tatblimp_callback import TatBLiMPCallback`` works as before.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"  # the one place: pyproject.toml reads it (tool.setuptools.dynamic)

# Each public name and the module that defines it (relative to this package).
_WHERE = {
    "ChatClient": ".chat.endpoint",
    "EndpointError": ".chat.endpoint",
    "evaluate_endpoint": ".chat.endpoint",
    "ForcedChoiceEvaluator": ".chat.forced_choice",
    "ForcedChoiceResults": ".chat.forced_choice",
    "evaluate_forced_choice": ".chat.forced_choice",
    "load_tokenizer": ".commands.loading",
    "CallableLM": ".engine.callable_model",
    "PeerFailure": ".engine.distributed",
    "this_process_only": ".engine.distributed",
    "Scorer": ".engine.scoring",
    "ScoringError": ".engine.scoring",
    "ScoringMethod": ".engine.scoring",
    "Evaluator": ".evaluation",
    "evaluate": ".evaluation",
    "Benchmark": ".reading.data",
    "BenchmarkError": ".reading.data",
    "Pair": ".reading.data",
    "load_benchmark": ".reading.data",
    "Suite": ".reading.suites",
    "load_suite": ".reading.suites",
    "GroupResult": ".results.group_metrics",
    "PairResult": ".results.metrics",
    "Results": ".results.metrics",
    "compute_results": ".results.metrics",
    "SentenceCache": ".tokenized.cache",
    "build_cache": ".tokenized.cache",
    "SentencePieceTokenizer": ".tokenized.tokenization",
    "TokenizationError": ".tokenized.tokenization",
    "TatBLiMPCallback": ".training.callback",
}

__all__ = [
    "Benchmark",
    "BenchmarkError",
    "CallableLM",
    "ChatClient",
    "EndpointError",
    "Evaluator",
    "ForcedChoiceEvaluator",
    "ForcedChoiceResults",
    "GroupResult",
    "Pair",
    "PairResult",
    "PeerFailure",
    "Results",
    "Scorer",
    "ScoringError",
    "ScoringMethod",
    "SentenceCache",
    "SentencePieceTokenizer",
    "Suite",
    "TatBLiMPCallback",
    "TokenizationError",
    "build_cache",
    "compute_results",
    "evaluate",
    "evaluate_endpoint",
    "evaluate_forced_choice",
    "load_benchmark",
    "load_suite",
    "load_tokenizer",
    "this_process_only",
]


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value  # imported once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and the API docs (griffe reads these imports statically)
    from .chat.endpoint import ChatClient, EndpointError, evaluate_endpoint
    from .chat.forced_choice import ForcedChoiceEvaluator, ForcedChoiceResults, evaluate_forced_choice
    from .commands.loading import load_tokenizer
    from .engine.callable_model import CallableLM
    from .engine.distributed import PeerFailure, this_process_only
    from .engine.scoring import Scorer, ScoringError, ScoringMethod
    from .evaluation import Evaluator, evaluate
    from .reading.data import Benchmark, BenchmarkError, Pair, load_benchmark
    from .reading.suites import Suite, load_suite
    from .results.group_metrics import GroupResult
    from .results.metrics import PairResult, Results, compute_results
    from .tokenized.cache import SentenceCache, build_cache
    from .tokenized.tokenization import SentencePieceTokenizer, TokenizationError
    from .training.callback import TatBLiMPCallback
