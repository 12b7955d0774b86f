"""SFT warm-up data for tool-add, as JSONL rows `{"messages": [...], "tools": [...]}`: for every
game, one row ending with the tool call and one ending with the answer (the SFT loss covers the
final assistant turn of a row, so both are learned). The tool list is the one the orchestrator
sends, so the rendered prompts are those RL sees. `uv run python -m tool_add.transcripts --out data.jsonl`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import verifiers.v1 as vf

from prime_rl.orchestrator.envs.tools import ToolBox
from tool_add import SYSTEM_PROMPT, AddTools, make_examples


def tool_schemas() -> list[dict]:
    return ToolBox.of([AddTools(vf.ToolsetConfig())]).wire()


def games(n: int, seed: int, digits: int = 4) -> list[dict]:
    tools = tool_schemas()
    rows = []
    # Numbers from their own seed: the RL train set (seed 0) and eval set (seed 1) stay unseen.
    for i, ex in enumerate(make_examples(n, seed + 1000, digits)):
        a, b = ex["info"]["a"], ex["info"]["b"]
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}  # fmt: skip
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": ex["question"]},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
        rows.append({"messages": messages, "tools": tools})
        messages = [
            *messages,
            {"role": "tool", "tool_call_id": f"call_{i}", "content": str(a + b)},
            {"role": "assistant", "content": f"<answer>{a + b}</answer>"},
        ]
        rows.append({"messages": messages, "tools": tools})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = games(args.n, args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows ({args.n} games) to {args.out}")


if __name__ == "__main__":
    main()
