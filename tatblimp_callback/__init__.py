"""Score causal language models on TatBLiMP, the Tatar benchmark of linguistic minimal pairs.

Entry points: ``TatBLiMPCallback`` for the Hugging Face Trainer, ``evaluate`` and ``Evaluator``
for custom loops, ``load_benchmark`` for the data (``load_suite`` for BLiMP, TurBLiMP, MultiBLiMP or your own), and the ``tatblimp`` command. Chat models:
``evaluate_forced_choice`` (local) and ``evaluate_endpoint`` (an OpenAI-compatible server).
"""

from .chat.endpoint import ChatClient, EndpointError, evaluate_endpoint
from .chat.forced_choice import ForcedChoiceEvaluator, ForcedChoiceResults, evaluate_forced_choice
from .commands.loading import load_tokenizer
from .engine.distributed import PeerFailure, this_process_only
from .engine.scoring import Scorer, ScoringError, ScoringMethod
from .evaluation import Evaluator, evaluate
from .reading.data import Benchmark, BenchmarkError, Pair, load_benchmark
from .reading.suites import Suite, load_suite
from .results.metrics import GroupResult, PairResult, Results, compute_results
from .tokenized.cache import SentenceCache, build_cache
from .tokenized.tokenization import SentencePieceTokenizer, TokenizationError
from .training.callback import TatBLiMPCallback

__version__ = "0.1.0"  # the one place: pyproject.toml reads it (tool.setuptools.dynamic)

__all__ = [
    "Benchmark",
    "BenchmarkError",
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
