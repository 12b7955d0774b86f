"""The shipped configs of the three-terminal run (`configs/reverse_text/{inference,trainer,
orchestrator}.toml`) meet as they are, and run what `rl.toml` runs."""

from pathlib import Path

import pytest

from prime_rl.config.cli import parse_config
from prime_rl.inference.config import InferenceConfig
from prime_rl.launcher.config import RLConfig
from prime_rl.launcher.machine import here
from prime_rl.launcher.plan import plan
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.trainer.config import TrainerConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "reverse_text"


@pytest.fixture
def three(monkeypatch):
    monkeypatch.chdir(REPO)  # their model paths are relative to the repo
    return (
        parse_config(InferenceConfig, ["@", str(CONFIGS / "inference.toml")]),
        parse_config(TrainerConfig, ["@", str(CONFIGS / "trainer.toml")]),
        parse_config(OrchestratorConfig, ["@", str(CONFIGS / "orchestrator.toml")]),
    )


def test_the_three_configs_agree_on_what_they_share(three):
    inference, trainer, orch = three
    # The server loads weights only from <its output_dir>/weights: where the trainer publishes them.
    assert inference.output_dir == trainer.output_dir == orch.output_dir
    assert inference.model.name == trainer.model.name == orch.model.name
    assert (trainer.max_steps, trainer.seq_len) == (orch.max_steps, orch.seq_len)
    assert orch.client.base_urls == [f"http://{inference.server.host}:{inference.server.port}/v1"]
    assert trainer.transport == orch.transport and orch.trainer_ranks == 1


def test_they_run_what_rl_toml_runs(three, monkeypatch):
    monkeypatch.chdir(REPO)
    rl = parse_config(RLConfig, ["@", str(CONFIGS / "rl.toml")])
    wired = plan(rl, here(rl))  # the three configs `rl` writes and starts
    r_inference, r_orch, r_trainer = wired.inference, wired.orchestrator, wired.trainer
    inference, trainer, orch = three
    ours = {"output_dir": inference.output_dir}
    assert inference == r_inference.model_copy(update=ours)
    assert orch == r_orch.model_copy(update={**ours, "transport": orch.transport})
    # `rl` resumes a rerun from the newest checkpoint (resume_step -1), as the trainer config does.
    assert trainer == r_trainer.model_copy(update={**ours, "transport": trainer.transport})
