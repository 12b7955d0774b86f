"""`uv run reward-server --path models/rm --port 8001`: a reward model behind HTTP.

Routes: GET /health answers {"status": "ok"} once the model is loaded; POST /score takes
{"conversations": [[prompt_messages, completion_messages], ...]} and answers {"scores": [...]},
one float per conversation, in order. The orchestrator's reward model (an env's `rewards` entry of
type `reward_model`) with a `url` speaks this protocol, and batches its calls, so one request is one
forward pass here.

Invariants: a request is scored whole or not at all: a malformed one gets HTTP 400 naming what is
wrong, a failing forward pass HTTP 500, never a partial list. With a run secret (`runtime/secret.py`) every
route but /health wants it (`Authorization: Bearer <secret>`; 401 and one log line otherwise), and
without one the server listens on loopback only, unless told otherwise (`allow_unauthenticated`).
What one client can make it hold is bounded: a body over `max_body_bytes` gets 413 with nothing of
it read, and at most `max_connections` connections are served at once, each with a read timeout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pydantic import Field

from prime_rl.auth import signing
from prime_rl.auth.ratelimit import RateLimited
from prime_rl.config import RootConfig, parse_config
from prime_rl.model.reward import RewardModel, RewardModelError, load_reward_model
from prime_rl.runtime import secret
from prime_rl.runtime.logging_setup import setup_logging

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

    max_body_bytes: int = Field(default=64 * 2**20, ge=1)
    """Largest request body read; a bigger one gets HTTP 413 before any of it is read."""

    max_connections: int = Field(default=16, ge=1)
    """Connections served at once (each may hold a body of up to `max_body_bytes` while it waits for
    the model); one more gets HTTP 503 at once, which the orchestrator's client retries after a
    back-off, rather than a thread and a body of its own."""

    max_connections_per_address: int = Field(default=8, ge=1)
    """Connections served at once from one address: a neighbour's many connections leave room for
    the run's client (one more gets HTTP 503 at once)."""

    read_deadline_s: float = Field(default=30.0, gt=0)
    """A request (its line, headers and body) must arrive whole within this long of its first
    wait, however slowly its bytes trickle: a connection past it is closed."""

    allow_unauthenticated: bool = False
    """Listen beyond loopback without a run secret (PRIME_RL_SECRET or PRIME_RL_SECRET_FILE), so that
    anyone who reaches the port may use it (also: --prime-rl-allow-unauthenticated)."""


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` at once and `per_address` from one
    address; the one more gets 503."""

    daemon_threads = True
    request_queue_size = 128  # (socketserver's 5 drops a burst of connections: clients wait 1 s or more)
    _BUSY_BODY = b'{"error": "too many connections; retry"}'
    BUSY = (
        b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
    )

    def __init__(self, address, handler, max_connections: int, per_address: int, refusals):
        self.slots = threading.BoundedSemaphore(max_connections)
        self.per_address, self.refusals = per_address, refusals
        self.by_address: dict[str, int] = {}
        self.counting = threading.Lock()
        super().__init__(address, handler)

    def _take(self, address: str) -> bool:
        with self.counting:
            if self.by_address.get(address, 0) >= self.per_address:
                return False
            if not self.slots.acquire(blocking=False):
                return False
            self.by_address[address] = self.by_address.get(address, 0) + 1
            return True

    def _give(self, address: str) -> None:
        with self.counting:
            self.by_address[address] -= 1
            if not self.by_address[address]:
                del self.by_address[address]
            self.slots.release()

    def process_request(self, request, client_address):
        if not self._take(client_address[0]):
            self.refusals.say(f"refused a connection from {client_address[0]}: too many connections")
            # Answered from the accept loop, without reading the request: a small send to a new socket
            # does not block.
            with contextlib.suppress(OSError):
                request.sendall(self.BUSY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._give(client_address[0])
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give(client_address[0])


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
    """The server, bound (refused, `SecretError`, beyond loopback without a secret or the opt-out)."""
    secret.require_for_bind(config.host, "reward-server", config.allow_unauthenticated)
    lock = threading.Lock()  # one forward pass at a time: they share the model and the cores
    verifier = signing.Verifier()
    refusals = RateLimited(log)

    class Handler(BaseHTTPRequestHandler):
        timeout = config.read_deadline_s

        def handle_one_request(self):
            # The deadline covers reading the request whole: bytes trickled one at a time each
            # reset a per-read timeout, never this. (Scoring, after the read, is not bounded here.)
            self._reading = True
            timer = threading.Timer(config.read_deadline_s, self._cut)
            timer.daemon = True
            timer.start()
            try:
                super().handle_one_request()
            finally:
                timer.cancel()

        def _cut(self) -> None:
            if self._reading:
                refusals.say(f"closed a connection from {self.client_address[0]}: no whole request in time")
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)

        def _answer(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _refused(self, body: bytes = b"") -> bool:
            """Whether the request is not signed by the run (then answered 401, and logged)."""
            if secret.value() is None:
                return False
            given = self.headers.get(secret.HEADER)
            caller, why = verifier.check(self.command, self.path, given, signing.body_digest(body))
            if caller == signing.OWNER:
                return False
            refusals.say(f"refused {self.command} {self.path} from {self.client_address[0]}: {why}")
            self._answer(401, {"error": f"this server takes only the run's signed requests ({why})"})
            return True

        def _body(self) -> bytes | None:
            """The request's body, read only up to `max_body_bytes` (None: answered 400 or 413)."""
            try:
                size = int(self.headers.get("Content-Length", 0))
            except ValueError:
                size = -1
            if size < 0:
                self._answer(400, {"error": "Content-Length is not a byte count"})
            elif size > config.max_body_bytes:
                self.close_connection = True  # the body is never read, so the connection is useless
                self._answer(413, {"error": f"body of {size} bytes; at most {config.max_body_bytes}"})
            else:
                body = self.rfile.read(size)
                self._reading = False
                return body if len(body) == size else None
            return None

        def do_GET(self):
            self._reading = False
            if self.path.rstrip("/") == "/health":
                self._answer(200, {"status": "ok"})
            elif self.path.startswith(signing.PROVE_PATH + "?") and secret.value() is not None:
                self._answer(*signing.proof_answer(self.path.partition("?")[2]))
            elif not self._refused():
                self._answer(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            body = self._body()  # (bounded, and read whole before the signature can be checked)
            if body is None or self._refused(body):
                return
            if self.path.rstrip("/") != "/score":
                return self._answer(404, {"error": f"no route {self.path}"})
            try:
                conversations = parse_conversations(body)
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

    return _BoundedServer(
        (config.host, config.port),
        Handler,
        config.max_connections,
        config.max_connections_per_address,
        refusals,
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The opt-out every server of the run takes, as `secret.require_for_bind` names it.
    argv = ["--allow-unauthenticated" if a == secret.OPT_OUT_FLAG else a for a in argv]
    config = parse_config(RewardServerConfig, argv, prog="reward-server")
    setup_logging("reward_server")
    try:
        secret.require_for_bind(config.host, "reward-server", config.allow_unauthenticated)
        model = load_reward_model(config.path, config.max_length, config.threads)
        server = make_server(config, model)
    except secret.SecretError as e:
        sys.stderr.write(f"reward-server: error: {e}\n")
        raise SystemExit(2) from None
    except RewardModelError as e:
        sys.stderr.write(f"reward-server: error: path: {e}\n")
        raise SystemExit(1) from None
    host, port = server.server_address[:2]
    log.info("serving %s at http://%s:%d", config.path, host, port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
