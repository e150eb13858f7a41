"""lm-evaluation-harness both ways: TatBLiMP as a harness task, and the fused engine as the harness model ``tatblimp``.

``task_path()`` is the folder to give the harness as ``--include_path`` (``tatblimp lm-eval-path`` prints it):
the ``tatblimp`` group and one ``tatblimp_<phenomenon>`` task per phenomenon. ``register()`` imports the model
module, which registers ``--model tatblimp`` with the harness (lm_eval is imported only then).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["register", "task_path"]


def task_path() -> Path:
    """The folder of the TatBLiMP harness tasks shipped with the package (for ``--include_path``)."""
    return Path(__file__).resolve().parent / "tasks"


def register() -> type:
    """Register ``--model tatblimp`` with lm-evaluation-harness and return its class (``TatBLiMPLM``).

    Raises:
        ImportError: lm-eval is not installed (``pip install lm-eval``).
    """
    try:
        from .model import TatBLiMPLM
    except ImportError as err:
        raise ImportError(f"the harness model needs lm-eval (pip install 'lm-eval==0.4.13'): {err}") from err
    return TatBLiMPLM
