"""Score causal language models on TatBLiMP, the Tatar benchmark of linguistic minimal pairs.

Entry points: ``TatBLiMPCallback`` for the Hugging Face Trainer, ``evaluate`` and ``Evaluator``
for custom loops, ``load_benchmark`` for the data, and the ``tatblimp`` command.
"""

from .callback import TatBLiMPCallback
from .cache import SentenceCache, build_cache
from .data import Benchmark, BenchmarkError, Pair, load_benchmark
from .evaluation import Evaluator, evaluate
from .metrics import GroupResult, PairResult, Results, compute_results
from .scoring import ScorePath, Scorer, ScoringError
from .tokenization import SentencePieceTokenizer, TokenizationError, load_tokenizer

__version__ = "0.1.0"

__all__ = [
    "Benchmark",
    "BenchmarkError",
    "Evaluator",
    "GroupResult",
    "Pair",
    "PairResult",
    "Results",
    "ScorePath",
    "Scorer",
    "ScoringError",
    "SentenceCache",
    "SentencePieceTokenizer",
    "TatBLiMPCallback",
    "TokenizationError",
    "build_cache",
    "compute_results",
    "evaluate",
    "load_benchmark",
    "load_tokenizer",
]
