"""A causal LM that is not a transformers model (nanoGPT-style code, OLMo-core, torchtitan), given as a callable.

``CallableLM`` presents the callable to the engine the way a transformers causal LM looks to it: a
``config`` (vocabulary, context, whether its attention takes a 4D mask), input and output embeddings, a
forward that returns ``.logits`` and, for the tiled head, a ``base_model`` that returns
``.last_hidden_state``. What the engine cannot find out by itself, the caller declares: the vocabulary
size, the context length and the row layouts the attention supports. The scoring-method check then
compares the layout it chose with one-sequence-at-a-time calls of the same callable, as for any model.

The callable is called as ``fn(input_ids, position_ids)`` ([rows, length] each, long), and with
``attention_mask=`` for prefix-tree rows only:

- padded rows (always used): one sequence a row, right-padded; positions 0, 1, 2, ... A causal
  attention needs no mask for them (no real token sees the padding after it).
- packed rows (``layouts`` with "packed"): several sequences a row, their position ids restarting at 0
  at each one; the attention must keep each sequence to itself (block-diagonal and causal), as
  transformers models do when they find restarting position ids.
- prefix-tree rows (``layouts`` with "tree"): ``attention_mask`` [rows, 1, length, length], boolean,
  True where a query position may attend to a key position; position ids are depths in the tree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..reading.option_types import is_whole_number

__all__ = ["CallableLM"]

Forward = Callable[..., torch.Tensor]


@dataclass
class CallableConfig:
    """What the engine reads from a transformers config, declared by the caller."""

    vocab_size: int
    max_position_embeddings: int
    _attn_implementation: str | None  # "sdpa": takes a boolean 4D mask (prefix trees); None: no 4D mask
    hidden_size: int = 1024  # for the memory budget's estimate (memory_budget's own default when unknown)
    is_encoder_decoder: bool = False


class _Vocabulary:
    """The input embeddings as far as the engine checks them: how many token ids the model knows."""

    def __init__(self, num_embeddings: int):
        self.num_embeddings = num_embeddings


class _Body(torch.nn.Module):
    """``base_model``: the hidden states before the output embedding, as ``.last_hidden_state``."""

    def __init__(self, owner: CallableLM):
        super().__init__()
        object.__setattr__(self, "_owner", owner)  # not a submodule: the owner holds the weights

    def forward(self, input_ids, position_ids=None, attention_mask=None, **_ignored):
        owner = self._owner
        return SimpleNamespace(last_hidden_state=owner._call(owner._hidden_states, input_ids, position_ids, attention_mask))


class CallableLM(torch.nn.Module):
    """A causal LM given as a callable, for ``Evaluator``, ``evaluate`` and the callbacks.

    Below float32 (bf16 weights), its float32 checks and rescoring hold every weight in float32 while they run, not
    one module's at a time: its code may use a weight outside its module's call (a head tied as
    ``F.linear(h, self.wte.weight)``).

    Give ``forward`` (logits), or ``hidden_states`` and ``output_embedding`` (then the log-probs are
    computed through the head tile by tile, without the full logits), or all three. Keep one
    ``CallableLM`` per model across evaluations: the engine keeps its scorer (and checked method) per object.

    Args:
        forward: ``fn(input_ids, position_ids[, attention_mask=]) -> logits`` [rows, length, vocab].
        vocab_size: the model's vocabulary size (the logits' last dimension).
        context_length: the most positions a sequence may have.
        layouts: the row layouts its attention supports besides padded rows: "packed" (restarting
            position ids), "tree" (a boolean 4D mask); see the module's docstring.
        module: the ``torch.nn.Module`` holding the weights (for the device, dtype, train/eval mode and
            the weights' label); default: the module ``forward`` (or ``hidden_states``) is a method of.
        hidden_states: ``fn(input_ids, position_ids[, attention_mask=]) -> hidden`` [rows, length, hidden],
            the states ``output_embedding`` turns into logits.
        output_embedding: the LM head, a plain ``torch.nn.Linear`` (``logits = output_embedding(hidden)``).

    Raises:
        ValueError: neither ``forward`` nor ``hidden_states`` with ``output_embedding``, a ``vocab_size`` or
            ``context_length`` that is not a positive whole number, an unknown layout, an ``output_embedding`` that
            is not a ``torch.nn.Linear``, or no module with weights; and, when it is called, a callable that returns
            anything but a float tensor [rows, length, vocab] (or [rows, length, hidden]).

    Example:
        ```python
        lm = CallableLM(gpt.forward, vocab_size=50304, context_length=1024, layouts=("packed",))
        results = Evaluator(tokenizer, "test.jsonl")(lm)
        ```
    """

    reads_weights_anywhere = True  # see above: ``precision.computing_in`` upcasts all of its weights at once

    def __init__(
        self,
        forward: Forward | None = None,
        *,
        vocab_size: int,
        context_length: int,
        layouts: Iterable[str] = (),
        module: torch.nn.Module | None = None,
        hidden_states: Forward | None = None,
        output_embedding: torch.nn.Linear | None = None,
    ):
        super().__init__()
        if forward is None and (hidden_states is None or output_embedding is None):
            raise ValueError("CallableLM needs forward= (logits), or hidden_states= with output_embedding= (the LM head)")
        for name, value in (("vocab_size", vocab_size), ("context_length", context_length)):
            if not is_whole_number(value) or value < 1:
                raise ValueError(f"CallableLM: {name} must be a positive whole number, got {value!r}")
        if output_embedding is not None and not isinstance(output_embedding, torch.nn.Linear):
            raise ValueError(f"CallableLM: output_embedding must be the LM head, a torch.nn.Linear; got {output_embedding!r}")
        if isinstance(layouts, str):
            raise ValueError(f"CallableLM: layouts= takes names, e.g. ({layouts!r},); got the string {layouts!r}")
        layouts = set(layouts)
        if layouts - {"tree", "packed", "padded"}:
            raise ValueError(f"unknown layouts {sorted(layouts - {'tree', 'packed', 'padded'})}: 'tree', 'packed', 'padded'")
        module = module if module is not None else getattr(forward or hidden_states, "__self__", None)
        if not isinstance(module, torch.nn.Module) or next(module.parameters(), None) is None:
            raise ValueError("CallableLM needs module=, the torch.nn.Module that holds the model's weights")
        self.module = module
        self._logits_fn = forward
        self._hidden_states = hidden_states
        self.output_embedding = output_embedding  # registered: a head outside ``module`` moves and trains with it
        # Padded rows always: the last resort of the method check and the rows non-finite sequences are scored on.
        self.supported_layouts = tuple(layout for layout in ("tree", "packed", "padded") if layout in layouts | {"padded"})
        self.config = CallableConfig(
            vocab_size=vocab_size,
            max_position_embeddings=context_length,
            _attn_implementation="sdpa" if "tree" in layouts else None,
            hidden_size=output_embedding.in_features if output_embedding is not None else 1024,
        )
        self._body = _Body(self) if hidden_states is not None and output_embedding is not None else None

    @property
    def base_model(self) -> torch.nn.Module:
        """The hidden states' module (``hidden_states``), or the model itself when only ``forward`` is given."""
        return self._body if self._body is not None else self

    def get_input_embeddings(self) -> _Vocabulary:
        return _Vocabulary(self.config.vocab_size)

    def get_output_embeddings(self) -> torch.nn.Linear | None:
        return self.output_embedding

    def forward(self, input_ids, position_ids=None, attention_mask=None, **_ignored):
        """``.logits`` [rows, length, vocab] of ``input_ids``, as a transformers model returns them."""
        if self._logits_fn is not None:
            logits = self._call(self._logits_fn, input_ids, position_ids, attention_mask)
        else:
            logits = self.output_embedding(self._call(self._hidden_states, input_ids, position_ids, attention_mask))
        return SimpleNamespace(logits=logits)

    def _call(self, fn: Forward, input_ids, position_ids, attention_mask) -> torch.Tensor:
        if position_ids is None:  # one sequence a row from position 0: the reference forward
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        if attention_mask is not None and attention_mask.dim() == 4:  # prefix-tree rows
            out = fn(input_ids, position_ids, attention_mask=attention_mask)
        else:  # a [rows, length] mask marks right padding, which a causal attention never sees from a real token
            out = fn(input_ids, position_ids)
        if fn is self._logits_fn:
            return _checked(out, "forward", input_ids, self.config.vocab_size, "vocab")
        return _checked(out, "hidden_states", input_ids, self.output_embedding.in_features, "hidden")


def _checked(out, name: str, input_ids: torch.Tensor, last: int, last_name: str) -> torch.Tensor:
    """``out`` if it is a float tensor [rows, length, ``last``] for ``input_ids`` [rows, length], else a ValueError
    that says what came back (a nanoGPT forward returns ``(logits, loss)``, say)."""
    rows, length = input_ids.shape
    if isinstance(out, torch.Tensor) and out.is_floating_point() and tuple(out.shape) == (rows, length, last):
        return out
    if isinstance(out, torch.Tensor):
        got = f"a {str(out.dtype).removeprefix('torch.')} tensor of shape {list(out.shape)}"
    else:
        got = f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, tuple) else "")
    raise ValueError(
        f"CallableLM: {name} must return a float tensor [rows, length, {last_name}] = [{rows}, {length}, {last}] for "
        f"input_ids of shape [{rows}, {length}]; got {got}"
        + (" (return the logits alone, e.g. lambda ids, pos: model(ids)[0])" if isinstance(out, tuple) else "")
    )
