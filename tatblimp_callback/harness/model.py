"""``--model tatblimp``: lm-evaluation-harness's ``HFLM`` with its log-likelihoods computed by the fused engine.

Loading (``pretrained``, ``dtype``, ``device``, ``revision``, ``trust_remote_code``, ...), tokenizing and the
encoding of every request (``_encode_pair``, the prefix token for an empty context, the rolling windows) are the
harness's own, so each request's tokens are exactly what ``--model hf`` scores. Only the forward passes change:
all of a call's requests are scored at once in prefix-tree rows (``fused.RequestScorer``), so requests that share
a context compute it once, and the head is applied only at the continuation's positions. ``generate_until`` is
``HFLM``'s.

Importing this module registers the model with the harness (``import tatblimp_callback.harness`` does it too);
``tatblimp lm-eval ...`` runs the harness's command line with it registered.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from contextlib import contextmanager

from accelerate.utils import convert_file_size_to_int
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from .fused import RequestScorer

logger = logging.getLogger(__name__)


@register_model("tatblimp")
class TatBLiMPLM(HFLM):
    """``HFLM`` whose ``loglikelihood`` and ``loglikelihood_rolling`` run on the engine's prefix-tree rows.

    Args:
        memory_budget: bytes of extra memory per forward call and head tile (default: the engine's,
            from free device memory), a count or a size such as ``2GB`` or ``500MiB``; the harness's ``batch_size``
            is not used for log-likelihoods.
        row_length: positions per row (raised to the longest request, and to the largest question of those at most
            twice as long: a question's choices share one row).
        release_memory: on a CPU, hand the memory each call freed back to the system after it (glibc's
            ``malloc_trim``). Off by default: the harness's calls follow each other and reuse that memory (trimming
            it and touching it again cost 4-9 ms a call); on inside a training run (``in_training``).
        **kwargs: ``HFLM``'s arguments (``pretrained=`` a path, a Hub id or a loaded model, ...).

    Raises:
        ValueError: one of these three that is not what it says (they come from ``--model_args`` as lm_eval parses
            them), naming it and its value, before the model is loaded.
    """

    def __init__(
        self,
        memory_budget: int | str | None = None,
        row_length: int | str = 256,
        release_memory: bool | str = False,
        **kwargs,
    ):
        options = {
            "memory_budget": _bytes(memory_budget),
            "row_length": _positive_count("row_length", row_length),
            "release_memory": _flag("release_memory", release_memory),
        }
        super().__init__(**kwargs)
        if self.backend != "causal":
            raise ValueError(f"--model tatblimp scores causal LMs; {kwargs.get('pretrained')!r} loaded as {self.backend}")
        each_process_its_own = self.world_size > 1  # the harness deals the requests out by rank
        self.request_scorer = RequestScorer(self.model, each_process_its_own=each_process_its_own, **options)
        self._encoding_only = False
        self._encoded: dict[tuple[str, bool | None], list[int]] | None = None  # within a call: each string's tokens
        self._prefix: int | None = None  # within a call: the prefix token id

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """As the harness makes a model from ``--model_args``; a key given there (``device=cpu``) wins over the same key
        of the command line's own options, which the harness fills with defaults (``device`` is ``cuda:0`` unless
        ``--device`` says otherwise) and would otherwise pass twice (``got multiple values for keyword argument``)."""
        given = {key: value for key, value in (additional_config or {}).items() if value is not None}
        for key in given.keys() & arg_dict.keys():
            if given[key] != arg_dict[key]:
                logger.warning("--model tatblimp: %s=%s from --model_args, not %s", key, arg_dict[key], given.pop(key))
            else:
                given.pop(key)
        return cls(**arg_dict, **given)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """``create_from_arg_obj`` of ``key=value,...`` as the harness parses it."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def prefix_token_id(self) -> int:
        """``HFLM``'s, read once a call: the harness's encoding reads it twice for each request with an empty context
        (BLiMP's: 3.5 us a read through the tokenizer, about 0.9 s a call of its 134,000 requests)."""
        prefix = getattr(self, "_prefix", None)  # HFLM's __init__ reads it before ours has run
        return HFLM.prefix_token_id.fget(self) if prefix is None else prefix

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``HFLM``'s, each distinct string of the call encoded once (``_encodings``)."""
        with self._encodings(requests):
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def encode(self, requests) -> list[tuple[list[int], list[int]]]:
        """``(context tokens, continuation tokens)`` of each loglikelihood ``Instance``, nothing scored: the harness's own
        encoding (``TemplateLM.loglikelihood``: ``_encode_pair``, the prefix token for an empty context)."""
        self._encoding_only = True  # its _loglikelihood_tokens call gets the encoded requests: handed back as they are
        try:
            with self._encodings(requests):
                encoded = super().loglikelihood(requests, disable_tqdm=True)
        finally:
            self._encoding_only = False
        return [(list(context), list(continuation)) for _, context, continuation in encoded]

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs):
        """``HFLM.tok_encode``, from the call's encodings where the string is among them."""
        known = None if self._encoded is None or kwargs else self._encoded.get((string, add_special_tokens))
        if known is None:
            return super().tok_encode(string, add_special_tokens, left_truncate_len, **kwargs)
        # The list itself, not a copy: the harness only reads it, and a question's choices then hold one context list,
        # which ``fused.request_tokens`` reads once.
        return known[-left_truncate_len:] if left_truncate_len else known

    @contextmanager
    def _encodings(self, requests):
        """Within the block, ``tok_encode`` answers the strings the harness's encoding of ``requests`` asks for
        (``TemplateLM.loglikelihood``, ``_encode_pair``) from one batch call of a fast tokenizer, each distinct string
        once: the harness encodes a question's context again for each of its choices, each string a call of its own
        (400 multiple-choice requests: 800 calls for 500 strings). Kept only if a sample equals ``tok_encode``'s own.
        The prefix token id is read once for the block too."""
        try:
            self._prefix = HFLM.prefix_token_id.fget(self)
            self._encoded = self._batch_encodings([request.args for request in requests])
            yield
        finally:
            self._encoded = self._prefix = None

    def _batch_encodings(self, pairs) -> dict[tuple[str, bool | None], list[int]] | None:
        if not getattr(self.tokenizer, "is_fast", False) or not pairs:
            return None
        wanted = {}  # (string, add_special_tokens) as the harness's encoding asks, in order, once each
        for context, continuation in pairs:
            if context == "":
                wanted[continuation, False] = None
                continue
            spaces = len(context) - len(context.rstrip())  # moved to the continuation, as _encode_pair moves them
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            wanted[context + continuation, None] = None
            wanted[context, None] = None
        bos = self.tokenizer.decode(self.prefix_token_id)
        groups = defaultdict(list)  # tok_encode's tokenizer arguments -> the strings encoded with them
        for string, add in wanted:
            options = _add_special_kwargs(add, self.add_bos_token)
            if add is None and has_bos_prefix(string, bos):
                options["add_special_tokens"] = False
            groups[tuple(sorted(options.items()))].append((string, add))
        encoded = {}
        # The ids alone: the attention masks and token type ids a call builds by default cost about 6% more.
        lean = {"return_attention_mask": False, "return_token_type_ids": False}
        for options, keys in groups.items():
            ids = self.tokenizer([string for string, _ in keys], **lean, **dict(options))["input_ids"]
            encoded.update(zip(keys, ids, strict=True))
        sample = list(encoded.items())[:: max(1, len(encoded) // 8)][:8]
        if any(super(TatBLiMPLM, self).tok_encode(string, add) != ids for (string, add), ids in sample):
            return None  # this tokenizer's batch call is not its one-string call: the harness's own way, one by one
        return encoded

    def rolling_windows(self, string: str) -> list[tuple[list[int], list[int]]]:
        """The ``(context, continuation)`` token windows of a rolling request, as ``HFLM.loglikelihood_rolling`` cuts them."""
        rolling = get_rolling_token_windows(
            token_list=self.tok_encode(string),
            prefix_token=self.prefix_token_id,
            max_seq_len=self.max_length,
            context_len=1,
        )
        return [tuple(map(list, make_disjoint_window(window))) for window in rolling]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """``(log-prob, is_greedy)`` of each encoded ``(key, context tokens, continuation tokens)``, in order."""
        if self._encoding_only:
            return requests
        answers = self.request_scorer.score(
            [(context, continuation) for _, context, continuation in requests], self.prefix_token_id, self.max_length
        )
        for (key, _, _), answer in zip(requests, answers, strict=True):
            if key is not None:  # rolling windows have no key; their request is cached whole below
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's log-likelihood over the harness's disjoint rolling windows, all windows scored in one call."""
        windows, owners = [], []
        for k, (string,) in enumerate(request.args for request in requests):
            for context, continuation in self.rolling_windows(string):
                windows.append((None, context, continuation))
                owners.append(k)
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[k] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals


def _bytes(value) -> int | None:
    """``memory_budget`` as lm_eval parses ``--model_args`` (an int, a float such as 1e9, a string such as 2GB or
    500MiB; None or absent: the default) in bytes."""
    if value is None or value == "":
        return None
    size = None
    if (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer()):
        size = int(value)
    elif isinstance(value, str):
        with contextlib.suppress(ValueError):
            size = int(value) if value.strip().isdigit() else convert_file_size_to_int(value)
    if size is None or size <= 0:
        raise ValueError(f"--model tatblimp: memory_budget={value!r} is not a size in bytes, such as 2000000000, 2GB or 500MiB")
    return size


def _positive_count(name: str, value) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"--model tatblimp: {name}={value!r} is not a positive whole number")
    return value


def _flag(name: str, value) -> bool:
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    flag = value if isinstance(value, bool) else words.get(str(value).strip().lower())
    if flag is None:
        raise ValueError(f"--model tatblimp: {name}={value!r} is not true or false")
    return flag
