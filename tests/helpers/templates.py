"""Chat templates the token-in tests render with, and tokenizers that carry them."""

import shutil
from pathlib import Path

from prime_rl.orchestrator.envs.renderer import Renderer

THINK = "<think>\n\n</think>\n\n"
"""The empty think block Qwen3's generation prompt opens an assistant turn with."""

QWEN3_LIKE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set content = message['content'] or '' %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n"
    + THINK.replace("\n", "\\n")
    + "' }}{%- endif %}"
)
"""As Qwen3's template does for turns without reasoning: the generation prompt opens the assistant
turn with an empty think block, and earlier assistant turns are re-rendered without it. A prompt
re-rendered from messages then never extends the tokens of the turn before."""


def renderer_with(model: Path | str, template: str, folder: Path) -> Renderer:
    """`model`'s tokenizer with `template` as its chat template (copied into `folder`)."""
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model) / name, folder / name)
    (folder / "chat_template.jinja").write_text(template)
    return Renderer(AutoTokenizer.from_pretrained(folder))
