"""Build the project's own tiny causal LM and tokenizer (no model hub needed), or a real model's shape.

`uv run make-tiny-model --output models/tiny` trains a byte-level BPE tokenizer on generated text,
gives it a ChatML chat template, creates a small Qwen3-style model with random weights and saves
both as one HF folder that transformers and vLLM load.

`--preset` gives shapes that matter at scale with random weights, to measure memory and speed
(`PRESETS`): 'real-vocab' keeps Qwen3's vocabulary of 151,936 (whose logits dominate trainer memory)
on a small body, and 'qwen3-0.6b' is Qwen3-0.6B's whole config. A real vocabulary needs no real
tokenizer: the small BPE's vocabulary is padded with reserved tokens that no text encodes to, so
every id the model can sample decodes (vLLM detokenizes what it samples).

Invariant: the same config (seed included) produces byte-identical files. Embeddings are untied by
default, because vLLM's CPU backend keeps a stale copy of a tied lm_head after a weight reload.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

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


PRESETS: dict[str, dict] = {
    "tiny": {},
    "real-vocab": {"model_vocab_size": 151_936, "hidden_size": 256, "intermediate_size": 768,
                   "num_heads": 4, "num_kv_heads": 2, "max_position_embeddings": 32_768},
    "qwen3-0.6b": {"model_vocab_size": 151_936, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_layers": 28, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 40_960, "rope_theta": 1_000_000.0, "tie_word_embeddings": True},
    "tiny-moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96},
    # Qwen3-30B-A3B's config with 2 of its 48 layers: each layer's experts alone are 604M parameters.
    "qwen3-30b-a3b": {"model_vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 6144,
                      "num_layers": 2, "num_heads": 32, "num_kv_heads": 4, "head_dim": 128,
                      "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "max_position_embeddings": 40_960, "rope_theta": 1_000_000.0},
}  # fmt: skip
"""Shape fields per preset; fields given explicitly win over the preset's."""


class TinyModelConfig(RootConfig):
    """make-tiny-model: builds a small Qwen3-style model and its BPE tokenizer as an HF folder."""

    output: Path = Path("models/tiny")
    """Folder to write the model, config and tokenizer to."""

    preset: Literal["tiny", "real-vocab", "qwen3-0.6b", "tiny-moe", "qwen3-30b-a3b"] = "tiny"
    """Shape: 'tiny' (the defaults below, 0.4M parameters), 'real-vocab' (Qwen3's 151,936-token
    vocabulary, width 256, 2 layers: 78M parameters, nearly all in the embedding and the lm_head),
    'qwen3-0.6b' (Qwen3-0.6B's width, depth, heads and tied embeddings: 596M parameters), 'tiny-moe'
    (the tiny model as a Qwen3-MoE: 8 experts of width 96, top-2, 0.84M parameters) or 'qwen3-30b-a3b'
    (Qwen3-30B-A3B's config, 128 experts, top-8, with 2 of its 48 layers: 1.87B parameters)."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data):
        if isinstance(data, dict) and data.get("preset", "tiny") in PRESETS:
            return {**PRESETS[data.get("preset", "tiny")], **data}
        return data

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

    head_dim: int | None = Field(default=None, ge=4)
    """Width of one attention head; unset: hidden_size / num_heads."""

    rope_theta: float = Field(default=10_000.0, gt=0)
    """RoPE base frequency."""

    model_vocab_size: int | None = Field(default=None, ge=300)
    """Embedding rows of the model (a real model's vocabulary); the tokenizer is padded with reserved
    tokens up to it. Unset: the tokenizer's size, rounded up to a multiple of 64."""

    max_position_embeddings: int = Field(default=2048, ge=64)
    """Longest sequence the model supports (vLLM's max-model-len must not exceed it)."""

    num_experts: int = Field(default=0, ge=0)
    """Experts per layer: a mixture of experts (Qwen3-MoE's architecture) when above 0, else a dense
    Qwen3 model."""

    num_experts_per_tok: int = Field(default=2, ge=1)
    """Experts each token is routed to (top-k), with a MoE."""

    moe_intermediate_size: int | None = Field(default=None, ge=4)
    """Width of one expert's MLP; unset: intermediate_size / num_experts_per_tok (the dense MLP's
    width per token)."""

    tie_word_embeddings: bool = False
    """Share the input embedding with the lm_head (see the vLLM CPU reload pitfall before enabling)."""

    corpus_lines: int = Field(default=20_000, ge=100)
    """Generated text lines the tokenizer is trained on."""

    tokenizer: Path | None = None
    """Copy this model folder's tokenizer instead of training one: a distillation teacher must share
    its student's token ids."""

    @model_validator(mode="after")
    def _check_heads(self):
        if self.num_heads % self.num_kv_heads or (
            self.head_dim is None and self.hidden_size % self.num_heads
        ):
            raise ValueError(
                "num_heads must divide by num_kv_heads, and hidden_size by num_heads unless head_dim is set"
            )
        if self.model_vocab_size is not None and self.model_vocab_size < self.vocab_size + len(TOOL_TOKENS):
            raise ValueError(
                f"model_vocab_size ({self.model_vocab_size}) must hold the tokenizer's "
                f"{self.vocab_size + len(TOOL_TOKENS)} tokens"
            )
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must not exceed num_experts ({self.num_experts})"
            )
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
    if config.model_vocab_size is not None:
        tok = pad_vocabulary(tok, config.model_vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=config.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def pad_vocabulary(tok, size: int):
    """The BPE with reserved tokens `<|reserved_N|>` added to its vocabulary up to `size` ids: no
    merge produces them, so text never encodes to them, but each decodes (to its own name)."""
    import json

    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    # Added tokens go into the vocabulary too: a loaded tokenizer keeps an added token's id only if
    # its model knows it, and would otherwise renumber it past the reserved ones.
    vocab.update({t["content"]: t["id"] for t in data["added_tokens"]})
    taken = set(vocab.values())
    vocab.update({f"<|reserved_{i}|>": i for i in range(size) if i not in taken})
    return Tokenizer.from_str(json.dumps(data))


def build_model(config: TinyModelConfig, tokenizer):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(config.seed)
    # vLLM needs vocab_size >= len(tokenizer); rounded up to 64 like real models' embeddings.
    vocab = max(config.model_vocab_size or 0, -(-len(tokenizer) // 64) * 64)
    moe = {}
    if config.num_experts:
        moe = dict(
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size
            or config.intermediate_size // config.num_experts_per_tok,
            norm_topk_prob=True,  # as Qwen3's MoE models: the top-k weights sum to 1
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    model_config = (Qwen3MoeConfig if moe else Qwen3Config)(
        **moe,
        vocab_size=vocab,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim or config.hidden_size // config.num_heads,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        torch_dtype="float32",
    )
    return (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(model_config).to(torch.float32)


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
