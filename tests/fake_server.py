"""A fake OpenAI-compatible inference server for orchestrator unit tests.

It speaks vLLM's completions route as the orchestrator calls it (the prompt as token ids of the
policy's chat template, answered with token ids and logprobs), its chat-completions route, plus
/health and the weight-reload route. A `script(request, index)` decides, per request, whether to
answer, fail (HTTP status), delay, or truncate (drop the token ids and logprobs). Answers are the
reversed user text (right for reverse-text), or text chosen by the script.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


@dataclass
class Reply:
    text: str | None = None
    """Completion text; None answers the reversed last user message."""
    status: int = 200
    """An HTTP error status to fail with instead of answering."""
    delay_s: float = 0.0
    truncate: bool = False
    """Leave out token ids and logprobs, as a server that was not asked properly would."""
    eos: bool = False
    """End the token ids with an end-of-sequence token (id 0, no text), as a model's answer does."""


Script = Callable[[dict, int], Reply]


def user_text(request: dict) -> str:
    content = request["messages"][-1]["content"]
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def encode(text: str) -> list[int]:
    return list(text.encode())


MODEL = str(Path(__file__).parents[1] / "models" / "reverse_text-tiny")
"""The policy of orchestrators run against the fake server: the orchestrator renders prompts with its
tokenizer, and the fake reads them with it (the shipped tiny models share one tokenizer)."""


@functools.cache
def tokenizer():
    # The class `AutoTokenizer` picks, without importing torch (seconds in a process of its own).
    from prime_rl.model.tokenizer import load_tokenizer

    return load_tokenizer(MODEL)


def chatml_messages(ids: list[int]) -> list[dict]:
    """The messages of a ChatML prompt (as the tiny models' template renders them)."""
    text = tokenizer().decode(ids, skip_special_tokens=False)
    messages = []
    for part in text.split("<|im_start|>")[1:]:
        role, _, content = part.partition("\n")
        messages.append({"role": role, "content": content.split("<|im_end|>")[0]})
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()  # the generation prompt
    return messages


@dataclass
class FakeServer:
    script: Script = field(default=lambda req, i: Reply())
    requests: list[dict] = field(default_factory=list)
    loads: list[dict] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    """'chat' per request and 'load <step>' per weight reload, in order."""
    port: int = 0
    """0 picks a free port."""
    distinct_choices: bool = False
    """Append i "+" to the text of choice i of an `n` request ("cba", "cba+", ...)."""
    ignore_n: bool = False
    """Answer an `n` request with one choice, as a server without `n` support would."""
    weights_dir: str | None = None
    """The folder `GET /prime_rl/weights` says weights load from (unset: it does not say)."""
    adapters_root: str | None = None
    """Serve `GET /prime_rl/adapters` as a LoRA server with this root (unset: no such route)."""
    load_status: int = 200
    """The status a weight reload is answered with (not 200: it fails, as a vLLM whose engine died)."""
    hold_loads: threading.Event | None = None
    """A weight reload, once recorded, waits for this event before it is answered."""

    def __post_init__(self):
        from prime_rl.inference.authenticated import Authenticated

        app = FastAPI()
        app.add_middleware(Authenticated)  # under a run secret, it takes what our servers take

        @app.get("/health")
        async def health():
            return {}

        @app.post("/prime_rl/load_weights")
        async def load(req: Request):
            body = await req.json()
            self.loads.append(body)
            self.events.append(f"load {body['step']}")
            if self.hold_loads is not None:
                await asyncio.to_thread(self.hold_loads.wait)
            if self.load_status != 200:
                return JSONResponse(
                    {"error": "EngineCore encountered an issue"}, status_code=self.load_status
                )
            return {"step": body["step"]}

        @app.get("/prime_rl/weights")
        async def weights():
            folder = {"weights_dir": self.weights_dir} if self.weights_dir else {}
            return {"step": self.loads[-1]["step"] if self.loads else 0, **folder}

        @app.get("/prime_rl/adapters")
        async def adapters():
            if self.adapters_root is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return {"enabled": True, "max_rank": 8, "root": self.adapters_root, "adapters": {}}

        @app.post("/fake/broadcast")
        async def broadcast(req: Request):
            # What a trainer's collective broadcast leaves behind: the server serves a new step
            # (recorded apart from file loads, which a broadcast run never asks for).
            body = await req.json()
            self.loads.append({**body, "broadcast": True})
            self.events.append(f"broadcast {body['step']}")
            return {"step": body["step"]}

        @app.get("/fake/events")
        async def events():
            return self.events

        @app.post("/v1/chat/completions")
        async def chat(req: Request):
            body = await req.json()
            index = len(self.requests)
            self.requests.append(body)
            self.events.append("chat")
            reply = self.script(body, index)
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if reply.status != 200:
                return JSONResponse({"error": {"message": "injected failure"}}, status_code=reply.status)
            text = user_text(body)[::-1] if reply.text is None else reply.text
            prompt = "".join(str(m.get("content")) for m in body["messages"])
            n = 1 if self.ignore_n else body.get("n", 1)
            texts = [text + "+" * i if self.distinct_choices else text for i in range(n)]
            choices = [
                {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": "stop"}
                for i, t in enumerate(texts)
            ]
            out = {
                "id": f"chatcmpl-{index}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": choices,
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": sum(len(t) for t in texts),
                    "total_tokens": len(prompt) + sum(len(t) for t in texts),
                },
            }
            if not reply.truncate:
                for choice, t in zip(choices, texts, strict=True):
                    choice["token_ids"] = encode(t) + [0] * reply.eos
                    choice["logprobs"] = {
                        "content": [
                            {"token": chr(c), "logprob": -0.5, "bytes": [c], "top_logprobs": []}
                            for c in encode(t)
                        ]
                        + [{"token": "", "logprob": -0.1, "bytes": [], "top_logprobs": []}] * reply.eos
                    }
                out["prompt_token_ids"] = encode(prompt)
            return out

        @app.post("/v1/completions")
        async def completions(req: Request):
            # The orchestrator's route: the prompt as token ids of the policy's chat template.
            body = await req.json()
            body["messages"] = chatml_messages(body["prompt"])
            index = len(self.requests)
            self.requests.append(body)
            self.events.append("chat")
            reply = self.script(body, index)
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if reply.status != 200:
                return JSONResponse({"error": {"message": "injected failure"}}, status_code=reply.status)
            text = user_text(body)[::-1] if reply.text is None else reply.text
            n = 1 if self.ignore_n else body.get("n", 1)
            texts = [text + "+" * i if self.distinct_choices else text for i in range(n)]
            choices = []
            for i, t in enumerate(texts):
                choice = {"index": i, "text": t, "finish_reason": "stop"}
                if not reply.truncate:
                    ids = [*tokenizer().encode(t, add_special_tokens=False), tokenizer().eos_token_id]
                    choice["token_ids"] = ids
                    choice["logprobs"] = {"token_logprobs": [-0.5] * len(ids)}
                choices.append(choice)
            return {
                "id": f"cmpl-{index}",
                "object": "text_completion",
                "model": body["model"],
                "choices": choices,
            }

        self.app = app

    def __enter__(self) -> FakeServer:
        # The tokenizer (and transformers' import, seconds on a busy machine) before the first
        # request, not inside it: a request then would hold every other route of this server.
        tokenizer()
        if not self.port:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60  # a hang guard: it starts in well under a second
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        # Without waiting for replies still delayed by the script: the test is done with them, and
        # uvicorn's graceful shutdown held the test for the rest of each delay (4-6 s).
        self._server.force_exit = True
        self._server.should_exit = True
        self._thread.join(timeout=10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def main() -> None:
    """A server in its own process, for tests that kill it: `python -m prime_rl.runtime.start
    fake_server PORT [DELAY_S]` (tests/ on PYTHONPATH), started as our processes start: imports with
    the collector paused."""
    import sys

    from prime_rl.runtime.imports import heavy_imports

    with heavy_imports():
        tokenizer()
    delay = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    with FakeServer(script=lambda req, i: Reply(delay_s=delay), port=int(sys.argv[1])):
        threading.Event().wait()


if __name__ == "__main__":
    main()
