"""The files of a Hub revision a sweep scores: only those a model needs, the next one fetched while one is scored,
and with ``keep=False`` each one's deleted once it is scored.

A revision's file list (one API call) gives what is fetched: ``config.json``, the weights (safetensors when the
revision has them, else the ``.bin`` files; never both) and the tokenizer files, the Python files only with
``trust_remote_code``. They go to the Hugging Face cache by name, and every other name of the commit gets its ref too
(the cache's ``refs/<name>`` then lets a later sweep with ``HF_HUB_OFFLINE=1`` find each name it scored); with ``keep=False`` to a folder of the revision's own beside the results file,
deleted once scored, so that no file the cache shares between revisions is removed under another download. Without
network (offline mode, or a Hub that does not answer) the files are read from the cache only, and with
``keep=False`` the revision is deleted from the cache once scored.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from ..reading.hub import hub_offline, hub_unreachable
from .checkpoints import WEIGHTS_FILES
from .loading import TOKENIZER_FILES

logger = logging.getLogger(__name__)

MODEL_FILES = ("config.json", "generation_config.json", "adapter_config.json")
MORE_TOKENIZER_FILES = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model")


class RevisionFilesError(RuntimeError):
    """A revision whose files cannot be had: no weights (an incomplete upload), not in the cache, moved meanwhile."""


def needed_files(files: list[str], trust_remote_code: bool = False) -> list[str]:
    """The files of a repository's listing that loading and tokenizing need (top level only).

    Raises:
        RevisionFilesError: no weights file among them.
    """
    top = [name for name in files if "/" not in name]
    # transformers reads model.safetensors or the shards its index names (model-00001-of-00002.safetensors), not
    # other copies a repository may hold (consolidated.safetensors).
    safetensors = [n for n in top if n.startswith("model") and n.endswith((".safetensors", ".safetensors.index.json"))]
    weights = safetensors or [n for n in top if n.startswith("pytorch_model") and (n.endswith(".bin") or n.endswith(".json"))]
    weights += [n for n in top if n.startswith("adapter_model.")]
    if not any(name in WEIGHTS_FILES or name.endswith(".safetensors") or name.endswith(".bin") for name in weights):
        raise RevisionFilesError(f"no weights file ({', '.join(WEIGHTS_FILES[:2])}, ...): an incomplete upload?")
    wanted = {*MODEL_FILES, *TOKENIZER_FILES, *MORE_TOKENIZER_FILES}
    return sorted({*weights, *(n for n in top if n in wanted), *(n for n in top if trust_remote_code and n.endswith(".py"))})


class RevisionFiles:
    """Fetches revisions of ``repo_id`` into folders (``fetch``) and deletes them once scored (``release``)."""

    def __init__(self, repo_id: str, downloads: Path, keep: bool = True, trust_remote_code: bool = False):
        self.repo_id = repo_id
        self.downloads = downloads  # with keep=False: where each revision's own folder goes
        self.keep = keep
        self.trust_remote_code = trust_remote_code
        self.from_cache = hub_offline() or hub_unreachable() is not None

    def fetch(self, name: str, commit: str, other_names: tuple[str, ...] = ()) -> Path:
        """The folder holding revision ``name``'s files, at ``commit``; ``other_names``: the commit's other names
        (``main`` beside ``step143000``), whose refs the cache gets too when the files are kept.

        The files are fetched one after the other on the calling thread (``hf_hub_download``; no pool of threads of
        its own, which would hold up Ctrl-C until a download ends).
        """
        if self.from_cache:
            return self._cached(name, commit)
        from huggingface_hub import HfApi, hf_hub_download

        folder, quiet = None, {"tqdm_class": _silent_bar()}  # the sweep's own bar says how far it is
        files = needed_files(HfApi().list_repo_files(self.repo_id, revision=commit), self.trust_remote_code)
        for filename in files:
            if not self.keep:
                path = hf_hub_download(self.repo_id, filename, revision=commit, local_dir=self.downloads / commit, **quiet)
            else:  # by name, so that the cache's refs/<name> finds it again offline
                path = hf_hub_download(self.repo_id, filename, revision=name, **quiet)
            folder = Path(path).parent
        if self.keep and folder.name != commit:
            raise RevisionFilesError(f"now at commit {folder.name[:12]}, listed at {commit[:12]}: re-uploaded during the sweep")
        for other in other_names if self.keep else ():
            # One file again by each other name: the Hub says the name's commit (one HEAD request), the file is in the
            # cache already, and refs/<other> is written, so that a sweep offline finds every name it scored.
            hf_hub_download(self.repo_id, files[0], revision=other, **quiet)
        return folder

    def _cached(self, name: str, commit: str) -> Path:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(self.repo_id, "config.json", revision=commit)
        if not isinstance(found, str):
            found = try_to_load_from_cache(self.repo_id, "adapter_config.json", revision=commit)
        if not isinstance(found, str):
            raise RevisionFilesError(f"{name} (commit {commit[:12]}) is not in the local cache, and the Hub cannot be asked")
        return Path(found).parent

    def release(self, commit: str, folder: Path | None) -> None:
        """Delete a scored revision's files when they are not to be kept (nothing else when they are)."""
        if self.keep or folder is None:
            return
        if not self.from_cache:
            shutil.rmtree(folder, ignore_errors=True)
            return
        from huggingface_hub import constants, scan_cache_dir

        scan_cache_dir(constants.HF_HUB_CACHE).delete_revisions(
            commit
        ).execute()  # the snapshot, and the blobs no other snapshot uses


def _silent_bar() -> type:
    """huggingface_hub's progress bar class, never shown."""
    from huggingface_hub.utils.tqdm import tqdm

    class SilentBar(tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

    return SilentBar


class Prefetcher:
    """Runs fetches and deletions one at a time on a background thread, in the order asked: while one revision is
    scored, the next one is fetched. A daemon thread, so that Ctrl-C is not held up by a download."""

    def __init__(self):
        self._tasks: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="tatblimp-prefetch", daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], object]) -> _Result:
        result = _Result()
        self._tasks.put((task, result))
        return result

    def _work(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            task, result = item
            try:
                result.value = task()
            except BaseException as err:  # handed to the caller of get(), who decides
                result.error = err
            result.done.set()

    def close(self, wait: bool = True) -> None:
        """No more tasks; with ``wait``, return once those asked for are done."""
        self._tasks.put(None)
        if wait:
            self._thread.join()


class _Result:
    def __init__(self):
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None

    def get(self) -> object:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value
