"""Reaching the Hugging Face Hub: on a machine without network, a Hub id fails in seconds, not after a minute.

huggingface_hub retries a request whose connection fails (about a minute in all, printing each retry) before it
looks in its cache. Before the package downloads the benchmark or a command loads a model by Hub id, it asks the
Hub once, with a short timeout (``hub_unreachable``); when no answer comes, the load reads the local cache only
(``local_files_only=True``), and what is not there fails at once with a message that says so. With
``HF_HUB_OFFLINE=1`` the Hub is not asked at all: huggingface_hub itself then reads the cache only.
"""

from __future__ import annotations

import time
from pathlib import Path

PROBE_TIMEOUT = 5.0  # seconds for the one request; a dropped connection costs this much, a refused one nothing
_REMEMBERED = 60.0  # seconds a probe's answer is reused (a command loads a tokenizer, then a model)
_last: tuple[float, str | None] | None = None

OFFLINE_ADVICE = "on a machine without network, set HF_HUB_OFFLINE=1 (Hub ids are then read from the local cache only)"


def hub_offline() -> bool:
    """Whether huggingface_hub is in offline mode (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` set when it was imported)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_unreachable(timeout: float = PROBE_TIMEOUT) -> str | None:
    """None when the Hub answers (with any HTTP status) or offline mode is on; else why it could not be reached.

    One HEAD request to the Hub's endpoint through huggingface_hub's own session (its proxies and certificates),
    without retries; the answer is reused for a minute.
    """
    global _last
    if hub_offline():
        return None
    now = time.monotonic()
    if _last is not None and now - _last[0] < _REMEMBERED:
        return _last[1]
    from huggingface_hub import constants, get_session

    reason = None
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as err:  # httpx's or requests' connection, proxy, DNS and timeout errors, whichever hub version
        text = str(err).splitlines()[0] if str(err) else ""
        reason = f"{type(err).__name__}: {text}"[:160] if text else type(err).__name__
    _last = (time.monotonic(), reason)
    return reason


def hub_endpoint() -> str:
    """The Hub's address (``HF_ENDPOINT``, default https://huggingface.co), for messages."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_cached(repo_id: str, repo_type: str = "model") -> bool:
    """Whether huggingface_hub's cache holds anything of ``repo_id`` (a snapshot folder): without network, only then
    is a load from the cache worth trying."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return (Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type=repo_type) / "snapshots").is_dir()


def unreachable_message(name: str, reason: str) -> str:
    """One line for a Hub id that is no local folder, when the Hub cannot be reached and its cache lacks it."""
    return (
        f"{name}: no such local folder, and the Hugging Face Hub ({hub_endpoint()}) could not be reached ({reason}) "
        f"to load it as a Hub id; {OFFLINE_ADVICE}"
    )
