"""PPO's critic in the trainer: warm-up trains only the critic, the value fits the returns, and a
critic that does not load is a one-line error naming the key."""

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.main import train
from prime_rl.trainer.model import ModelLoadError
from prime_rl.trainer.rl.trainer import Trainer
from prime_rl.transport.contract import OrchestratorSide
from prime_rl.transport.messages import TrainingSample
from prime_rl.transport.packing import pack

TRAINER = Path(sys.executable).parent / "trainer"


def samples(n: int = 16, seed: int = 0) -> list[TrainingSample]:
    """The reward is the completion's first token's parity: something a value head can learn."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        c = rng.randint(3, 8)
        completion = [rng.randrange(3, 200) for _ in range(c)]
        out.append(
            TrainingSample(
                prompt_ids=[rng.randrange(3, 200) for _ in range(rng.randint(3, 8))],
                completion_ids=completion,
                completion_mask=[1] * c,
                completion_logprobs=[-5.0] * c,
                advantage=0.0,
                reward=float(completion[0] % 2),
                env_name="e",
            )
        )
    return out


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in module.parameters()])


@pytest.fixture
def gae_trainer(tiny_model, tmp_path):
    config = TrainerConfig(
        model={"name": str(tiny_model)},
        output_dir=str(tmp_path),
        seq_len=256,
        advantage={"type": "gae", "gamma": 1.0, "lam": 0.95},
        critic={"warmup_steps": 1, "optim": {"lr": 3e-3}},
    )
    torch.manual_seed(0)
    return Trainer(config, _world())


def _world():
    from prime_rl.trainer.parallel.dist import World

    return World()


def test_warmup_trains_the_critic_only_then_both(gae_trainer):
    mbs = pack(samples(), 256, 1, "r", 0)[0]
    policy, critic = flat(gae_trainer.model), flat(gae_trainer.critic)
    metrics, _ = gae_trainer.train_step(mbs, step=0)
    assert torch.equal(flat(gae_trainer.model), policy)  # warm-up: the policy is untouched
    assert not torch.equal(flat(gae_trainer.critic), critic)
    assert metrics["critic/policy_trained"] == 0.0 and metrics["lr"] == 0.0
    assert gae_trainer.scheduler.last_epoch == 0  # the policy's schedule starts after the warm-up
    metrics, _ = gae_trainer.train_step(mbs, step=1)
    assert not torch.equal(flat(gae_trainer.model), policy)
    assert metrics["critic/policy_trained"] == 1.0


def test_the_value_fits_the_returns(gae_trainer):
    mbs = pack(samples(), 256, 1, "r", 0)[0]
    history = [gae_trainer.train_step(mbs, step=0)[0] for _ in range(12)]  # warm-up: critic only
    first, last = history[0], history[-1]
    assert last["critic/value_loss/all/mean"] < 0.5 * first["critic/value_loss/all/mean"]
    assert last["critic/explained_variance"] > first["critic/explained_variance"] + 0.2
    assert 0.0 <= last["critic/value_clipped/all/mean"] <= 1.0


def test_a_critic_that_does_not_load_names_the_key(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    config = TrainerConfig(
        model={"name": str(tiny_model)},
        output_dir=str(tmp_path),
        advantage={"type": "gae"},
        critic={"path": str(broken)},
    )
    with pytest.raises(ModelLoadError, match=r"trainer\.critic\.path"):
        train(config)
    proc = subprocess.run(
        [TRAINER, "--model.name", str(tiny_model), "--output-dir", str(tmp_path), "--advantage.type", "gae",
         "--critic.path", str(broken)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "trainer.critic.path" in proc.stderr and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(errors) == 1 and errors[0].startswith("trainer: error: trainer.critic.path"), proc.stderr


def test_resume_restores_the_critic_and_the_kl_controller(tiny_model, tmp_path):
    """4 steps straight equal 2 steps, a restart from the step-2 checkpoint, then 2 more: the same
    policy weights, critic values and adaptive beta at step 3."""
    from safetensors.torch import load_file

    from prime_rl.transport.file_transport import FileSender

    data = tmp_path / "data"
    sender = FileSender(data)
    for step in range(4):
        for mb in pack(samples(seed=step), 256, 1, "c", step, orchestrator=OrchestratorSide("c", 256, 1))[0]:
            sender.send(mb)

    def run(name: str, max_steps: int, resume: bool) -> list[dict]:
        config = TrainerConfig(
            model={"name": str(tiny_model)},
            output_dir=str(tmp_path / name),
            max_steps=max_steps,
            seq_len=256,
            optim={"lr": 1e-3},
            advantage={"type": "gae", "batch_normalize": "all"},
            critic={"warmup_steps": 1, "optim": {"lr": 1e-3}},
            kl_reward={"beta": 0.1, "target": 1e-4, "horizon": 16},
            ckpt={"interval": 2, "resume_step": -1 if resume else None},
            transport={"type": "filesystem", "dir": str(data), "run_id": "c", "timeout_s": 60},
        )
        torch.manual_seed(0)
        train(config)
        import json

        return [json.loads(line) for line in (tmp_path / name / "trainer" / "metrics.jsonl").open()]

    straight = run("straight", 4, False)
    run("resumed", 2, False)
    resumed = run("resumed", 4, True)
    assert [m["step"] for m in resumed] == [0, 1, 2, 3]
    betas = [m["kl_reward/beta"] for m in straight]
    assert betas[0] == 0.1 and betas[3] != betas[0]  # the controller moved beta
    for key in ("kl_reward/beta", "critic/value/all/mean", "critic/value_loss/all/mean", "loss"):
        assert resumed[3][key] == pytest.approx(straight[3][key], rel=1e-5, abs=1e-7), key
    a = load_file(tmp_path / "straight" / "weights" / "step_4" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "weights" / "step_4" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6, msg=key)
