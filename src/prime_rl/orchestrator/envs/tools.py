"""The tools of a v1 task, run in this process, and the model's tool calls read from its text.

A v1 task offers tools as `Toolset`s: classes whose `@vf.tool` methods verifiers would serve as MCP
servers in a runtime. Here the methods are called directly (no server, no subprocess), advertised
under the names verifiers gives them (`<toolset>_<tool>`, or the bare name with `TOOL_PREFIX =
None`), with JSON schemas from their signatures.

The model's calls are read from the completion's text in the hermes format (`<tool_call>{"name":
..., "arguments": {...}}</tool_call>`), as vLLM's `hermes` parser reads them: the orchestrator
samples token ids, so no server parses for it.

Invariants: `call` never raises for a bad call or a tool that fails: the model gets the error as
the tool's result ("Error: ..."), as verifiers' harnesses give it; `parse_calls` returns the text
before the first call as the content, and only calls that parse.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from dataclasses import dataclass, field
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.utils.decorators import discover_decorated

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _schema(fn) -> dict[str, Any]:
    """JSON schema of `fn`'s parameters (those with annotations; `self` excluded)."""
    from pydantic import create_model

    hints = typing.get_type_hints(fn)
    fields = {
        name: (hints.get(name, Any), ... if p.default is inspect.Parameter.empty else p.default)
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    schema = create_model(f"{fn.__name__}_args", **fields).model_json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    return schema


@dataclass
class ToolBox:
    """The tools one trace may call: their schemas (as verifiers `Tool`s) and their functions."""

    tools: list = field(default_factory=list)
    functions: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, toolsets: list, schemas: bool = True) -> ToolBox:
        """The toolsets' tools; without `schemas`, only their functions (to call, not to show)."""
        box = cls()
        for toolset in toolsets:
            prefix = toolset.server_name
            for fn in discover_decorated(toolset, "tool"):
                name = getattr(fn, "tool_name", None) or fn.__name__
                name = f"{prefix}_{name}" if prefix else name
                if name in box.functions:
                    raise ValueError(f"two tools are named '{name}': give a toolset a distinct TOOL_PREFIX")
                box.functions[name] = fn
                if schemas:
                    box.tools.append(
                        vf.Tool(name=name, description=(fn.__doc__ or "").strip(), parameters=_schema(fn))
                    )
        return box

    def wire(self) -> list[dict] | None:
        """The tools as a chat template takes them (OpenAI's function format)."""
        if not self.tools:
            return None
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
            }
            for t in self.tools
        ]

    async def call(self, name: str, arguments: str) -> tuple[str, bool]:
        """The tool's result as text, and whether the call failed."""
        fn = self.functions.get(name)
        if fn is None:
            return f"Error: no tool named '{name}' (tools: {sorted(self.functions)})", True
        try:
            args = json.loads(arguments or "{}")
            if not isinstance(args, dict):
                raise ValueError(f"arguments must be a JSON object, got {type(args).__name__}")
            result = fn(**args)
            if inspect.isawaitable(result):
                result = await result
        except Exception as e:
            return f"Error: {type(e).__name__}: {e}", True
        return result if isinstance(result, str) else json.dumps(result), False


def parse_calls(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, JSON arguments), ...]) of a completion in the hermes format. Without a
    call that parses, the whole text is the content."""
    calls = []
    for match in CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments", {})
            calls.append((call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    if not calls:
        return text, []
    content = text[: text.index("<tool_call>")]
    return (content if content.strip() else None), calls
