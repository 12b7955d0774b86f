"""The reward server (`reward-server`) on its own, with a stand-in model: every route but /health
wants the run's secret, a body over the bound is refused unread, connections beyond the bound get
503 at once, and it will not listen beyond loopback without a secret unless told to. (Scoring with a
real reward model: reward_model_test.)"""

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from prime_rl.auth import clients, signing
from prime_rl.inference import reward_server
from prime_rl.inference.reward_server import RewardServerConfig, make_server
from prime_rl.orchestrator.envs.reward_model import RemoteScorer
from prime_rl.orchestrator.rewards.reward_model import RewardModelReward
from prime_rl.runtime import secret

CONVERSATION = [[{"role": "user", "content": "hi"}], [{"role": "assistant", "content": "hello"}]]


class Model:
    """Scores a conversation by its completion's length."""

    def score(self, conversations):
        return [float(len(completion[0]["content"])) for _, completion in conversations]


@pytest.fixture
def serve():
    """Start a reward server with the given config fields; its base URL."""
    servers = []

    def start(**fields) -> str:
        server = make_server(RewardServerConfig(path="unused", port=0, **fields), Model())
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def bearer(value: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {value}"}


def raw(url: str, head: str, timeout_s: float = 10.0) -> bytes:
    """Send `head` (a request line and headers, no body) on a new connection; the whole answer."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(head.encode())
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def test_every_route_but_health_wants_a_signature_of_the_run(run_secret, serve, caplog):
    url = serve()
    body = {"conversations": [CONVERSATION]}
    assert httpx.get(f"{url}/health").status_code == 200
    other_key = signing.sign(b"k" * 32, "POST", "/score", json.dumps(body).encode())
    with caplog.at_level(logging.WARNING, logger="prime_rl.reward_server"):
        assert httpx.post(f"{url}/score", json=body).status_code == 401
        assert httpx.post(f"{url}/score", json=body, headers=bearer(run_secret)).status_code == 401
        assert httpx.post(f"{url}/score", json=body, headers={"Authorization": other_key}).status_code == 401
        assert httpx.get(f"{url}/other", headers=bearer("guess")).status_code == 401
    lines = [r.getMessage() for r in caplog.records if r.name == "prime_rl.reward_server"]
    assert len(lines) == 1 and "no signature" in lines[0]  # the others counted in the next line
    answer = httpx.post(f"{url}/score", json=body, auth=clients.auth())
    assert answer.status_code == 200 and answer.json() == {"scores": [5.0]}


def test_the_orchestrators_client_sends_the_run_secret(run_secret, serve):
    scorer = RemoteScorer(RewardModelReward(type="reward_model", url=serve()), "envs[0].rewards[0]")

    async def score():
        try:
            return await scorer.score_batch([(CONVERSATION[0], CONVERSATION[1])])
        finally:
            await scorer.aclose()

    assert asyncio.run(score()) == [5.0]


def test_a_body_over_the_bound_gets_413_without_being_read(run_secret, serve):
    url = serve(max_body_bytes=1000)
    # Only the headers are sent: the answer comes without the server waiting for the body.
    head = f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {run_secret}\r\nContent-Length: {2**30}\r\n\r\n"
    assert raw(url, head).startswith(b"HTTP/1.0 413 ")
    fits = {"conversations": [CONVERSATION]}
    assert httpx.post(f"{url}/score", json=fits, auth=clients.auth()).status_code == 200
    assert httpx.post(f"{url}/score", json=fits, headers=bearer(run_secret)).status_code == 401


def test_connections_over_the_bound_get_503_at_once_and_a_freed_slot_serves_again(run_secret, serve):
    url = serve(max_connections=2)
    port = int(url.rsplit(":", 1)[1])
    # Two connections that send nothing hold both slots (the server accepts in the order they came).
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    try:
        busy = raw(url, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert busy.startswith(b"HTTP/1.0 503 ") and b"Retry-After: 1" in busy
    finally:
        for s in held:
            s.close()
    # The closed connections' handlers end and give their slots back.
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the slots were not given back"


def test_a_neighbours_trickling_connections_are_cut_and_leave_room_for_the_run(run_secret, serve):
    # The review's slowloris: 16 connections from one address, each sending a byte now and then,
    # had kept the run's client at 503 for minutes.
    url = serve(max_connections=16, max_connections_per_address=8, read_deadline_s=1.0)
    port = int(url.rsplit(":", 1)[1])
    neighbour = []
    for _ in range(16):
        s = socket.socket()
        s.bind(("127.0.0.2", 0))  # another address on this host (loopback is 127/8)
        s.connect(("127.0.0.1", port))
        neighbour.append(s)
    # The run's client, from its own address, is served at once.
    answer = httpx.post(f"{url}/score", json={"conversations": [CONVERSATION]}, auth=clients.auth())
    assert answer.status_code == 200
    # Those over the per-address bound were turned away; the others are closed by the deadline
    # however they trickle (a byte every 0.2 s: each read is quick, the request never whole).
    done = threading.Event()

    def trickle() -> None:
        while not done.wait(0.2):
            for s in neighbour:
                with contextlib.suppress(OSError):
                    s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                    continue  # answered (the 503s were, before the run's client was) or closed
                with contextlib.suppress(OSError):
                    s.send(b"O", socket.MSG_DONTWAIT)

    trickler = threading.Thread(target=trickle)
    trickler.start()
    answers = []
    for s in neighbour:
        s.settimeout(60)
        data = b""
        try:
            while chunk := s.recv(4096):
                data += chunk
        except ConnectionResetError:  # cut while a trickled byte was unread: closed all the same
            pass
        answers.append(data)
    done.set()
    trickler.join()
    for s in neighbour:
        s.close()
    assert sum(a.startswith(b"HTTP/1.0 503 ") for a in answers) == 8
    assert sum(a == b"" for a in answers) == 8  # cut, never answered


def test_it_will_not_listen_beyond_loopback_without_a_secret_unless_told(
    no_secret, serve, capsys, monkeypatch
):
    monkeypatch.setattr(
        reward_server, "setup_logging", lambda process: None
    )  # (it takes over the root logger)
    with pytest.raises(secret.SecretError, match=secret.ENV):
        make_server(RewardServerConfig(path="unused", host="0.0.0.0", port=0), Model())
    serve(host="0.0.0.0", allow_unauthenticated=True)
    # From the command line: one line, before the model is loaded; the shared opt-out flag works too.
    with pytest.raises(SystemExit) as exc:
        reward_server.main(["--path", "nowhere", "--host", "0.0.0.0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and secret.OPT_OUT_FLAG in err
    with pytest.raises(SystemExit) as exc:
        reward_server.main(["--path", "nowhere", "--host", "0.0.0.0", secret.OPT_OUT_FLAG])
    assert exc.value.code == 1 and "path:" in capsys.readouterr().err  # past the bind check
