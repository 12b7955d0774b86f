"""Token-in turns: a conversation's next prompt as token ids, built by extending the tokens the
model already saw instead of re-rendering the history.

A chat template may render an earlier turn differently once later turns exist (Qwen3 strips the
think blocks of earlier assistant turns; others drop reasoning or re-serialize tool calls). A
prompt re-rendered from messages then no longer starts with the tokens the model was sampled on,
and the rollout cannot train as one sample. Here the next turn's prompt is always

    previous prompt + previous completion + what closes that completion + the new messages

where the new messages (tool results, the env's reply) are rendered on their own: after a fixed
stand-in conversation, and cut off it. Nothing of the history is rendered again.

Invariants: `render` is what vLLM's chat layer feeds the model for the same messages (the
template's text, tokenized without added special tokens); `bridge` returns a prompt that starts
with `previous_prompt + previous_completion`, or None when the template cannot be cut that way
(the caller renders the whole conversation instead, and counts it).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

STAND_IN: list[dict[str, Any]] = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "Okay."},
]
"""The conversation new messages are rendered after: one exchange, so that tool results and user
turns render as they do mid-conversation (some templates open a tool block only after an
assistant turn)."""


@dataclass(frozen=True)
class Bridge:
    """What the template puts between a finished assistant turn and the next messages."""

    close: tuple[int, ...]
    """The tokens that end an assistant turn after its content (ChatML: `<|im_end|>`, `\\n`)."""


class Renderer:
    """A model's chat template as token ids (the HF tokenizer of the served model)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._stand_ins: dict[str, list[int]] = {}

    @classmethod
    @functools.cache
    def for_model(cls, name: str) -> Renderer:
        """The renderer of the model `name` (a folder or hub id), loaded once per process."""
        from prime_rl.model.tokenizer import load_tokenizer

        return cls(load_tokenizer(name))

    def render(
        self, messages: list[dict], tools: list[dict] | None = None, generation: bool = True
    ) -> list[int]:
        """The conversation's tokens, as vLLM's chat layer renders them."""
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=generation, tokenize=False
        )
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """`text`'s token ids, no special tokens added: straight from a fast tokenizer's backend
        when it has one (transformers' `encode` costs ~0.15 ms more per call, building the dict
        of masks and offsets it then drops)."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    @functools.cached_property
    def _backend(self):
        backend = getattr(self.tokenizer, "_tokenizer", None)
        return backend if hasattr(backend, "encode") else None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @functools.cached_property
    def _bridge(self) -> Bridge | None:
        """The template's turn close: what follows an assistant turn's content when later turns
        come. None when the content cannot be found in the rendering (the template rewrites it)."""
        user = self.render(STAND_IN[:1], generation=False)
        whole = self.render(STAND_IN, generation=False)
        content = self.encode(STAND_IN[1]["content"])
        if whole[: len(user)] != user:
            return None
        # The content's last occurrence: a template may open the turn with a scaffold of its own
        # (an empty think block), so the content is searched, not assumed right after the opener.
        for start in range(len(whole) - len(content), len(user) - 1, -1):
            if whole[start : start + len(content)] == content:
                return Bridge(close=tuple(whole[start + len(content) :]))
        return None

    def tail(self, messages: list[dict], tools: list[dict] | None = None) -> list[int] | None:
        """The tokens of `messages` rendered on their own after an assistant turn, with the
        generation prompt; None when the template does not render them as a suffix."""
        key = json.dumps(tools, sort_keys=True) if tools else ""
        before = self._stand_ins.get(key)
        if before is None:  # the same for every turn with these tools: rendered once
            before = self._stand_ins[key] = self.render(STAND_IN, tools, generation=False)
        after = self.render(STAND_IN + messages, tools, generation=True)
        if after[: len(before)] != before:
            return None
        return after[len(before) :]

    def bridge(
        self,
        previous_prompt: list[int],
        previous_completion: list[int],
        messages: list[dict],
        tools: list[dict] | None = None,
    ) -> list[int] | None:
        """The next prompt: the previous turn's tokens, the close of its completion (the part the
        model did not sample: a completion cut by `max_tokens` gets the whole close), then
        `messages` rendered on their own. None when the template cannot be extended this way."""
        bridge = self._bridge
        tail = self.tail(messages, tools) if bridge is not None else None
        if bridge is None or tail is None:
            return None
        close = list(bridge.close)
        if close and previous_completion and previous_completion[-1] == close[0]:
            close = close[1:]  # the model sampled the end of its turn itself
        return [*previous_prompt, *previous_completion, *close, *tail]
