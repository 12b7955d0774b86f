"""The orchestrator's start-up check that every inference server loads weights from the folder its
run's trainer publishes them to (`orchestrator/loop/weights_dir.py`), against the fake server;
`tests/integration/by_hand_test.py` runs it against real vLLM."""

import asyncio

import pytest

from fake_server import FakeServer
from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.loop.servers import ServerPool
from prime_rl.orchestrator.loop.weights_dir import WeightsDirMismatch, check_weights_dirs


def check(servers: list[FakeServer], output_dir, adapter: bool = False) -> None:
    pool = ServerPool(ClientConfig(base_urls=[s.base_url for s in servers]))
    asyncio.run(check_weights_dirs(pool, output_dir, adapter=adapter))


def test_a_server_loading_from_another_run_folder_stops_the_orchestrator_naming_both(tmp_path):
    ours, theirs = tmp_path / "manual", tmp_path / "outputs"
    with (
        FakeServer(weights_dir=str(ours / "weights")) as good,
        FakeServer(weights_dir=str(theirs / "weights")) as bad,
    ):
        check([good], ours)  # the same output_dir: they meet
        with pytest.raises(WeightsDirMismatch) as e:
            check([good, bad], ours)
    msg = str(e.value)
    assert f"orchestrator.output_dir = '{ours}'" in msg and "<inference.output_dir>/weights" in msg
    assert (
        str(ours / "weights") in msg
        and str(theirs / "weights") in msg
        and bad.base_url.removesuffix("/v1") in msg
    )
    assert "--output-dir" in msg and "\n" not in msg


def test_a_run_folder_under_a_servers_folder_meets_it(tmp_path):
    with FakeServer(weights_dir=str(tmp_path)) as server:
        check([server], tmp_path / "runs" / "alice")


def test_adapters_are_checked_against_the_adapters_root(tmp_path):
    runs = tmp_path / "runs"
    with FakeServer(adapters_root=str(runs)) as server:
        check([server], runs / "alice", adapter=True)
        with pytest.raises(WeightsDirMismatch, match=r"inference\.lora\.runs_root"):
            check([server], tmp_path / "elsewhere", adapter=True)


def test_a_server_that_does_not_say_is_not_checked(tmp_path):
    with FakeServer() as server:  # a plain vLLM server, an older prime_rl one
        check([server], tmp_path / "run")
        check([server], tmp_path / "run", adapter=True)
