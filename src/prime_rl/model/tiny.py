"""Build the project's own tiny causal LM and tokenizer (no model hub needed).

`uv run make-tiny-model --output models/tiny` trains a byte-level BPE tokenizer on generated text,
gives it a ChatML chat template, creates a small Qwen3-style model with random weights and saves
both as one HF folder that transformers and vLLM load.

Invariant: the same config (seed included) produces byte-identical files. Embeddings are untied by
default, because vLLM's CPU backend keeps a stale copy of a tied lm_head after a weight reload.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator
from pathlib import Path

from pydantic import Field, model_validator

from prime_rl.config import RootConfig, parse_config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
"""Single tokens, not special ones: decoded text keeps them whatever skip_special_tokens says, and
vLLM's `hermes` tool parser finds calls in the text."""

# ChatML, as Qwen models use it; content may be a string or a list of text parts. With `tools`, the
# system turn lists them (compactly: `name(arg: type, ...) - description`, a tiny model's context is
# short), an assistant turn's calls follow its content as `<tool_call>\n{"name": ..., "arguments":
# {...}}\n</tool_call>` (what vLLM's hermes parser reads, and what re-renders to the very tokens the
# model sampled when it wrote canonical JSON), and tool results come back in one user turn of
# `<tool_response>` blocks. Without tools and tool messages it renders plain ChatML.
CHAT_TEMPLATE = (
    "{%- macro text(content) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content %}{%- for part in content %}{{- part['text'] }}{%- endfor %}{%- endif %}"
    "{%- endmacro %}"
    "{%- set ns = namespace(first=0) %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- text(messages[0]['content']) + '\\n\\n' }}{%- set ns.first = 1 %}"
    "{%- endif %}"
    "{{- 'Tools:' }}"
    "{%- for tool in tools %}"
    "{%- set f = tool['function'] if tool['function'] is defined else tool %}"
    "{{- '\\n' + f['name'] + '(' }}"
    "{%- for name, schema in ((f['parameters'] or {})['properties'] or {}).items() %}"
    "{{- name + ': ' + (schema['type'] if schema['type'] is string else 'any') }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- ')' }}{%- if f['description'] %}{{- ' - ' + f['description'] }}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[ns.first:] %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user\\n' }}"
    "{%- else %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{{- text(message['content']) }}"
    "{%- for call in (message['tool_calls'] or []) if message['role'] == 'assistant' %}"
    "{%- set f = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}{%- else %}{{- f['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class TinyModelConfig(RootConfig):
    """make-tiny-model: builds a small Qwen3-style model and its BPE tokenizer as an HF folder."""

    output: Path = Path("models/tiny")
    """Folder to write the model, config and tokenizer to."""

    seed: int = 0
    """Seed for the generated corpus and the weights; the same seed gives identical files."""

    vocab_size: int = Field(default=512, ge=300)
    """Tokenizer vocabulary size (256 bytes + special tokens + merges)."""

    hidden_size: int = Field(default=128, ge=16)
    """Model width."""

    intermediate_size: int = Field(default=384, ge=16)
    """MLP width."""

    num_layers: int = Field(default=2, ge=1)
    """Transformer blocks."""

    num_heads: int = Field(default=4, ge=1)
    """Attention heads."""

    num_kv_heads: int = Field(default=2, ge=1)
    """Key/value heads (grouped-query attention when fewer than num_heads)."""

    max_position_embeddings: int = Field(default=2048, ge=64)
    """Longest sequence the model supports (vLLM's max-model-len must not exceed it)."""

    tie_word_embeddings: bool = False
    """Share the input embedding with the lm_head (see the vLLM CPU reload pitfall before enabling)."""

    corpus_lines: int = Field(default=20_000, ge=100)
    """Generated text lines the tokenizer is trained on."""

    tokenizer: Path | None = None
    """Copy this model folder's tokenizer instead of training one: a distillation teacher must share
    its student's token ids."""

    @model_validator(mode="after")
    def _check_heads(self):
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        return self


def corpus(seed: int, lines: int) -> Iterator[str]:
    """Chat-formatted text resembling the example tasks: reversals, digit sums, additions, noise."""
    rng = random.Random(seed)
    letters = string.ascii_lowercase
    for _ in range(lines):
        kind = rng.randrange(4)
        if kind == 0:
            # Random letters, not recurring words: runs of lowercase letters then stay (mostly) one
            # token per letter, so reversing text is reversing tokens, which a tiny model can learn.
            text = "".join(rng.choice(letters) for _ in range(rng.randint(3, 12)))
            user, answer = f"Reverse the text: {text}", text[::-1]
        elif kind == 1:
            number = str(rng.randint(0, 10 ** rng.randint(1, 8)))
            user, answer = (
                f"What is the sum of the digits of {number}?",
                f"<answer>{sum(map(int, number))}</answer>",
            )
        elif kind == 2:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            user, answer = f"Compute {a} + {b}.", f"{a} + {b} = {a + b}"
        else:
            user = "".join(rng.choice(string.printable[:95]) for _ in range(rng.randint(5, 40)))
            answer = user.upper()
        yield f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


def build_tokenizer(config: TinyModelConfig):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Letters and digits stay one token each (merges happen only among spaces and punctuation):
    # reversing text or summing digits is then a token-level task that a tiny model can learn.
    # A newline is a token of its own too: ChatML puts one right before every message's content, and
    # a merge across it ("\n<") would make a rendered conversation tokenize differently from the
    # tokens sampled turn by turn, so multi-turn rollouts could not merge into one sample.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
            pre_tokenizers.Split(Regex("[A-Za-z0-9]"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(config.seed, config.corpus_lines), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=config.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def build_model(config: TinyModelConfig, tokenizer):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(config.seed)
    vocab = -(-len(tokenizer) // 64) * 64  # round up: vLLM needs vocab_size >= len(tokenizer)
    model_config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.hidden_size // config.num_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        torch_dtype="float32",
    )
    return Qwen3ForCausalLM(model_config).to(torch.float32)


def make_tiny_model(config: TinyModelConfig) -> Path:
    """Build and save the tokenizer and model; return the output folder."""
    if config.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    else:
        tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    out = Path(config.output)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> None:
    config = parse_config(TinyModelConfig, argv, prog="make-tiny-model")
    out = make_tiny_model(config)
    n = sum(f.stat().st_size for f in out.iterdir())
    print(f"make-tiny-model: wrote {out} ({n / 1e6:.1f} MB)")
