"""A scalar reward model: an HF sequence-classification model with one output, and its tokenizer.

Shared by the three places that touch one: `train-reward-model` (trains it), the orchestrator (scores
rollouts in-process) and `reward-server` (scores them over HTTP).

Invariant: a conversation becomes token ids by one function, `encode`, in all three places, the way
inference renders it (the prompt through the chat template with its generation prefix, then the
completion's text tokenized on its own), so a reward model scores the very tokens it was trained on.
The score is the head's output at the last non-padding token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Message = dict[str, Any]


class RewardModelError(ValueError):
    """A reward model that cannot be loaded or used; the message names the folder and the reason."""


def plain_messages(messages) -> list[Message]:
    """Chat messages as plain dicts (verifiers hands out pydantic objects), None fields dropped."""
    if isinstance(messages, str):
        return [{"role": "assistant", "content": messages}]
    out = []
    for m in messages or []:
        d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        out.append({k: v for k, v in d.items() if v is not None})
    return out


def encode(tokenizer, prompt: list[Message], completion: list[Message], max_length: int) -> list[int]:
    """Token ids of a prompt and its completion, as inference renders them; the start of a too-long
    conversation is cut, since the score is read at its end."""
    prompt_text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    full_text = (
        tokenizer.apply_chat_template(prompt + completion, tokenize=False) if completion else prompt_text
    )
    tail = full_text[len(prompt_text) :] if full_text.startswith(prompt_text) else full_text
    head = prompt_text if full_text.startswith(prompt_text) else ""
    ids = (
        tokenizer(head, add_special_tokens=False)["input_ids"]
        + tokenizer(tail, add_special_tokens=False)["input_ids"]
    )
    return ids[-max_length:]


def check_reward_model_dir(path: str) -> None:
    """Raise RewardModelError unless `path` looks like a one-output sequence-classification folder.
    Reads config.json only (cheap, for start-up checks)."""
    config_file = Path(path).expanduser() / "config.json"
    if not config_file.is_file():
        raise RewardModelError(f"'{path}' is not a model folder (no config.json there)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RewardModelError(f"'{config_file}' cannot be read as JSON: {e}") from None
    arch = (config.get("architectures") or ["?"])[0]
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    if not arch.endswith("ForSequenceClassification") or labels != 1:
        raise RewardModelError(
            f"'{path}' holds a {arch} with {labels} output(s); a reward model is a "
            "*ForSequenceClassification with one output (train one with `train-reward-model`)"
        )


@dataclass
class RewardModel:
    """A loaded reward model. `score` is thread-safe to call from one thread at a time."""

    model: Any
    tokenizer: Any
    max_length: int = 1024

    def ids(self, prompt: list[Message], completion: list[Message]) -> list[int]:
        return encode(self.tokenizer, prompt, completion, self.max_length)

    def forward(self, batch: list[list[int]]):
        """The scores of a batch of token-id lists (a differentiable tensor, one value per list)."""
        import torch

        pad = self.model.config.pad_token_id
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, ids in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
        # Read the head at each row's own last token: do not rely on the pad id never occurring.
        hidden = self.model.base_model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(batch)), mask.sum(1) - 1]
        return self.model.score(last).squeeze(-1).float()

    def score(self, conversations: list[tuple[list[Message], list[Message]]]) -> list[float]:
        import torch

        with torch.inference_mode():
            return self.forward([self.ids(p, c) for p, c in conversations]).tolist()


def load_reward_model(path: str, max_length: int = 1024, threads: int | None = None) -> RewardModel:
    """Load a reward model folder for scoring; RewardModelError saying why when it does not load."""
    check_reward_model_dir(path)
    try:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    except Exception as e:
        raise RewardModelError(
            f"'{path}' does not load: {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from None
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id or 0
    return RewardModel(model, tokenizer, max_length)


def init_reward_model(base: str):
    """A fresh reward model from a causal LM folder: its body and tokenizer, a new one-output head."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=1, dtype=torch.float32, pad_token_id=tokenizer.pad_token_id
    )
    return RewardModel(model, tokenizer)
