"""`uv run reward-server --path models/rm --port 8001`: a reward model behind HTTP.

Routes: GET /health answers {"status": "ok"} once the model is loaded; POST /score takes
{"conversations": [[prompt_messages, completion_messages], ...]} and answers {"scores": [...]},
one float per conversation, in order. The orchestrator's reward model (an env's `rewards` entry of
type `reward_model`) with a `url` speaks this protocol, and batches its calls, so one request is one
forward pass here.

Invariant: a request is scored whole or not at all: a malformed one gets HTTP 400 naming what is
wrong, a failing forward pass HTTP 500, never a partial list.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pydantic import Field

from prime_rl.config import RootConfig, parse_config
from prime_rl.logging_setup import setup_logging
from prime_rl.model.reward import RewardModel, RewardModelError, load_reward_model

log = logging.getLogger("prime_rl.reward_server")


class RewardServerConfig(RootConfig):
    """reward-server: serves a reward model folder over HTTP."""

    path: str
    """Reward model folder (a one-output *ForSequenceClassification, e.g. from `train-reward-model`)."""

    host: str = "127.0.0.1"
    """Address to listen on."""

    port: int = Field(default=8001, ge=0, le=65535)
    """Port to listen on (0: any free one, printed at start)."""

    max_length: int = Field(default=1024, ge=8)
    """Tokens of a conversation the model sees (the end of it)."""

    threads: int | None = Field(default=None, ge=1)
    """torch CPU threads (default: torch's own choice)."""


def parse_conversations(body: bytes) -> list[tuple[list[dict], list[dict]]]:
    """The request's conversations; ValueError saying what is wrong with it."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"body is not JSON: {e}") from None
    conversations = data.get("conversations") if isinstance(data, dict) else None
    if not isinstance(conversations, list):
        raise ValueError("expected {'conversations': [[prompt_messages, completion_messages], ...]}")
    out = []
    for i, conv in enumerate(conversations):
        if not (isinstance(conv, list) and len(conv) == 2 and all(isinstance(m, list) for m in conv)):
            raise ValueError(f"conversations[{i}] must be [prompt_messages, completion_messages]")
        out.append((conv[0], conv[1]))
    return out


def make_server(config: RewardServerConfig, model: RewardModel) -> ThreadingHTTPServer:
    lock = threading.Lock()  # one forward pass at a time: they share the model and the cores

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path.rstrip("/") == "/health":
                self._answer(200, {"status": "ok"})
            else:
                self._answer(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            if self.path.rstrip("/") != "/score":
                return self._answer(404, {"error": f"no route {self.path}"})
            try:
                conversations = parse_conversations(
                    self.rfile.read(int(self.headers.get("Content-Length", 0)))
                )
            except ValueError as e:
                return self._answer(400, {"error": str(e)})
            try:
                with lock:
                    scores = model.score(conversations) if conversations else []
            except Exception as e:
                log.exception("scoring failed")
                return self._answer(500, {"error": f"{type(e).__name__}: {e}"})
            self._answer(200, {"scores": scores})

        def log_message(self, format, *args):  # the default writes every request to stderr
            log.debug(format, *args)

    return ThreadingHTTPServer((config.host, config.port), Handler)


def main(argv: list[str] | None = None) -> None:
    config = parse_config(RewardServerConfig, argv, prog="reward-server")
    setup_logging("reward_server")
    try:
        model = load_reward_model(config.path, config.max_length, config.threads)
    except RewardModelError as e:
        sys.stderr.write(f"reward-server: error: path: {e}\n")
        raise SystemExit(1) from None
    server = make_server(config, model)
    host, port = server.server_address[:2]
    log.info("serving %s at http://%s:%d", config.path, host, port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
