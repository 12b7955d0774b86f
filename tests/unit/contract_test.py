"""The run contract between orchestrator and trainer: each rule on its own, and two processes
started by hand from configs written apart that cannot work together, which both stop with one line
naming both keys (whichever starts first)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fake_server import FakeServer
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.config import contract_side as orchestrator_side
from prime_rl.runtime.net import free_port
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.config import contract_side as trainer_side
from prime_rl.transport.contract import OrchestratorSide, Setting, TrainerSide, problems

BIN = Path(sys.executable).parent
ENVS = str(Path(__file__).parents[1] / "envs")


def sides(orchestrator: dict, trainer: dict, dp: int = 1) -> tuple[OrchestratorSide, TrainerSide]:
    return orchestrator_side(OrchestratorConfig(**orchestrator), "s"), trainer_side(
        TrainerConfig(**trainer), dp
    )


def test_defaults_agree_and_each_rule_names_both_keys():
    assert problems(*sides({}, {})) == []
    assert problems(*sides({"filters": []}, {"advantage": {"type": "gae"}})) == []
    cases = [
        ({}, {"advantage": {"type": "gae"}}, 1,
         ["'trainer.advantage.type' = 'gae'", "'orchestrator.filters[0].type' = 'zero_advantage'"]),
        ({"filters": [], "dynamic_sampling": {"enabled": True}}, {"advantage": {"type": "gae"}}, 1,
         ["'trainer.advantage.type' = 'gae'", "'orchestrator.dynamic_sampling.enabled' = true"]),
        ({"advantage": {"type": "reinforce_baseline"}}, {}, 1,
         ["'orchestrator.advantage.type' = 'reinforce_baseline'", "'trainer.advantage.batch_normalize' = 'none'"]),
        ({"filters": [], "teacher": {"advantage_weight": 0.5}}, {"advantage": {"batch_normalize": "all"}}, 1,
         ["'trainer.advantage.batch_normalize' = 'all'", "'orchestrator.teacher.advantage_weight' = 0.5"]),
        ({"seq_len": 1024}, {"seq_len": 512}, 1, ["'orchestrator.seq_len' = 1024", "'trainer.seq_len' = 512"]),
        ({"trainer_ranks": 2}, {}, 1, ["'orchestrator.trainer_ranks' = 2", "the trainer has 1"]),
    ]  # fmt: skip
    for orchestrator, trainer, dp, phrases in cases:
        (found,) = problems(*sides(orchestrator, trainer, dp))
        assert all(p in found for p in phrases), (found, phrases)
    # what the orchestrator may do alone stays allowed
    assert problems(*sides({"filters": [], "teacher": {"advantage_weight": 0.5}}, {})) == []
    assert (
        problems(
            *sides({"advantage": {"type": "reinforce_baseline"}}, {"advantage": {"batch_normalize": "all"}})
        )
        == []
    )


def test_a_refusal_setting_prints_as_toml():
    assert str(Setting.of("a.b", True)) == "'a.b' = true" and str(Setting.of("c", "x")) == "'c' = 'x'"


def start(script: str, *args, cwd: Path) -> subprocess.Popen:
    """The console script, its stderr to a file (a pipe nobody reads while we wait on the other
    process could fill up and stall it)."""
    env = {**os.environ, "PYTHONPATH": ENVS}
    with (cwd / f"{script}.err").open("w") as err:
        return subprocess.Popen([str(BIN / script), *map(str, args)], cwd=cwd, env=env,
                                stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip


def finish(p: subprocess.Popen, cwd: Path, timeout: float = 240) -> str:
    """Its stderr once it exits; killed (and its stderr shown) if it does not within `timeout`."""
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        pytest.fail(
            f"{p.args[0]} still ran after {timeout} s: {(cwd / f'{Path(p.args[0]).name}.err').read_text()[-3000:]}"
        )
    return (cwd / f"{Path(p.args[0]).name}.err").read_text()


@pytest.mark.parametrize("first", ["orchestrator", "trainer"])
def test_mismatched_processes_started_by_hand_both_stop_with_one_line(tmp_path, tiny_model, first):
    port = free_port()
    common = f'output_dir = "{tmp_path / "run"}"\nmax_steps = 3\n'
    (tmp_path / "trainer.toml").write_text(
        f'{common}[transport]\nport = {port}\n[model]\nname = "{tiny_model}"\n'
        '[advantage]\ntype = "gae"\nbatch_normalize = "all"\n'
    )
    with FakeServer() as server:
        (tmp_path / "orchestrator.toml").write_text(
            f'{common}batch_size = 8\n[transport]\nport = {port}\n[model]\nname = "{tiny_model}"\n'
            f'[client]\nbase_urls = ["{server.base_url}"]\n[[envs]]\nid = "reverse-text"\ngroup_size = 4\n'
        )  # the default filters drop groups of equal rewards, which GAE's critic needs
        commands = {
            "orchestrator": ("orchestrator", "@", "orchestrator.toml"),
            "trainer": ("trainer", "@", "trainer.toml"),
        }
        procs = {first: start(*commands[first], cwd=tmp_path)}
        other = "trainer" if first == "orchestrator" else "orchestrator"
        procs[other] = start(*commands[other], cwd=tmp_path)
        outs = {name: finish(p, tmp_path) for name, p in procs.items()}
    for name, p in procs.items():
        stderr = outs[name]
        assert p.returncode == 2, (name, stderr[-3000:])
        assert "Traceback" not in stderr, (name, stderr[-3000:])
        (line,) = [x for x in stderr.splitlines() if x.startswith(f"{name}: error:")]
        assert "'trainer.advantage.type' = 'gae'" in line and "'orchestrator.filters[0].type'" in line, line
