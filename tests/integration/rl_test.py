"""`rl` end to end: real vLLM, real env, trainer and orchestrator, weights reloaded every step."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers.cores import deployment_keys
from prime_rl.runtime import secret
from prime_rl.runtime.monitor import read_metrics
from prime_rl.runtime.net import free_port

pytestmark = pytest.mark.slow

RL = str(Path(sys.executable).parent / "rl")
ENVS = str(Path(__file__).parents[1] / "envs")


def write_config(tmp_path: Path, model: Path, env_id: str, steps: int, extra: str = "") -> Path:
    """An `rl` config for a test run; `extra` is more TOML, appended. The run is placed on this xdist
    worker's cores unless `extra` places it (cores or several servers, which spread by themselves),
    and served by a vLLM server unless `extra` says how (`rl`'s own default, "auto", is the engine
    on one machine: the engine-mode test runs that)."""
    extra = served(extra)
    toml = tmp_path / "rl.toml"
    toml.write_text(
        f"""
model = "{model}"
output_dir = "{tmp_path / "run"}"
max_steps = {steps}
seq_len = 256
max_async_level = 1

[inference.server]
port = {free_port()}

[trainer.optim]
lr = 3e-3

[orchestrator]
batch_size = 32

[orchestrator.transport]
port = {free_port()}

[[orchestrator.envs]]
id = "{env_id}"
group_size = 8
sampling = {{ temperature = 1.0, max_tokens = 24 }}
{placed(extra)}"""
    )
    return toml


def served(extra: str) -> str:
    """`extra` with the policy served by a vLLM server, unless it chooses the inference mode."""
    if "inference_mode" in extra:
        return extra
    line = 'inference_mode = "server"\n'
    if "[deployment]\n" in extra:
        return extra.replace("[deployment]\n", f"[deployment]\n{line}", 1)
    return f"{extra}\n[deployment]\n{line}"


def placed(extra: str) -> str:
    """`extra` with this worker's cores under `[deployment]`, unless it places the run itself (cores,
    several servers, which spread by themselves, or a SLURM job)."""
    keys = deployment_keys()
    if not keys or any(k in extra for k in ("inference_cpus", "trainer_cpus", "inference_servers", "slurm")):
        return extra
    if "[deployment]\n" in extra:
        return extra.replace("[deployment]\n", f"[deployment]\n{keys}", 1)
    return f"{extra}\n[deployment]\n{keys}"


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            out.append(pid)
        except ProcessLookupError:
            pass
    return out


def child_pids(pid: int) -> list[int]:
    return [c.pid for c in psutil.Process(pid).children()]


def test_rl_trains_reloads_weights_and_reward_rises(tiny_model, tmp_path):
    toml = write_config(tmp_path, tiny_model, "short-answer-env", steps=8)
    env = {**os.environ, "PYTHONPATH": ENVS}
    proc = subprocess.run([RL, "@", str(toml)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[orchestrator]" in proc.stdout and "[trainer]" in proc.stdout  # the compact console view
    run = tmp_path / "run"
    orch = [json.loads(line) for line in (run / "orchestrator" / "metrics.jsonl").read_text().splitlines()]
    trainer = [json.loads(line) for line in (run / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in orch] == list(range(8)) and [m["step"] for m in trainer] == list(range(8))
    versions = [m["policy_version"] for m in orch]
    assert versions[-1] >= 5 and versions == sorted(versions)  # weights were reloaded as training went
    assert all(s - v <= 1 for s, v in enumerate(versions))  # max_async_level = 1
    for m in orch:
        buckets = sum(m[f"rollouts/all/{b}_total"] for b in ("trained", "filtered", "failed", "stale"))
        assert (
            m["rollouts/all/dispatched_total"]
            == buckets + m["rollouts/all/inflight"] + m["rollouts/all/waiting"]
        )
    assert trainer[0]["mismatch_kl/all/mean"] < 1e-3  # float32 vLLM and trainer agree on the start weights
    # A healthy run fails no rollout for the framework's sake (a connection closed under a request
    # did, when vLLM's keep-alive timer matched the client's): only the model may cause failures.
    errors = [r["error"] for f in (run / "rollouts").glob("step_*.jsonl") for r in map(json.loads, f.open())
              if r.get("error")]  # fmt: skip
    assert all("EmptyModelResponse" in e for e in errors), errors
    assert "rollout failed" not in proc.stdout and "Aborted rollout" not in proc.stdout  # logs only
    # The console carries the start, step, eval and done lines, and a step's failure summary (the
    # untrained model may reply empty); everything else is in the logs.
    console_line = re.compile(
        r"rl: |\[(orchestrator|trainer)\] \S+ (orchestrator|trainer) "
        r"(step \d+ \||eval at step \d+ \||step \d+: \d+ rollouts failed)"
    )
    assert [line for line in proc.stdout.splitlines() if not console_line.match(line)] == []
    rewards = [m["reward/all/mean"] for m in orch]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, rewards
    for name in ("inference", "orchestrator", "trainer"):
        assert (run / "logs" / f"{name}.log").stat().st_size > 0
        assert (run / "configs" / f"{name}.toml").exists()
    # The run's secret: readable by its owner only, and in no config, log or console line.
    secret_file = run / secret.FILE_NAME
    assert secret_file.stat().st_mode & 0o777 == 0o600
    value = secret.read(secret_file)
    written = [
        f.read_text(errors="replace") for f in (*run.glob("configs/*"), *run.glob("logs/*")) if f.is_file()
    ]
    assert all(value not in text for text in (*written, proc.stdout, proc.stderr))


def test_in_engine_mode_the_orchestrator_serves_the_policy_itself_reward_rises_and_a_crash_heals(
    tiny_model, tmp_path
):
    """`rl`'s default on one machine (`deployment.inference_mode = "auto"`) is the engine mode: no
    inference server; vLLM's engine runs in the orchestrator's process, loads each published step by
    a call and serves the trainer's logprobs.
    The orchestrator killed alone mid-run (its engine's processes orphaned) is restarted with a new
    engine, the run trains every step once, and no process of the run outlives it."""
    extra = '[deployment]\ninference_mode = "auto"\nmax_restarts = 1\nrestart_backoff_s = 0.5\n'
    toml = write_config(tmp_path, tiny_model, "short-answer-env", steps=8, extra=extra)
    run = tmp_path / "run"
    orch_m = run / "orchestrator" / "metrics.jsonl"
    env = {**os.environ, "PYTHONPATH": ENVS}
    out_path, err_path = tmp_path / "rl.out", tmp_path / "rl.err"  # files: a full pipe would stall rl
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen([RL, "@", str(toml)], stdout=out, stderr=err, text=True, env=env)
    seen: set[int] = set()
    killed = None
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            # The engine's processes are the orchestrator's children: every descendant is noted.
            with contextlib.suppress(psutil.NoSuchProcess):
                seen.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))
                if killed is None and orch_m.exists() and len(orch_m.read_text().splitlines()) >= 3:
                    [killed] = [
                        c.pid
                        for c in psutil.Process(proc.pid).children()
                        if "orchestrator" in " ".join(c.cmdline()[:2])
                    ]
                    os.kill(killed, signal.SIGKILL)  # not its group: what a crash of the process leaves
            time.sleep(0.5)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # a failed wait or check above: stop the run before reporting it
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
    out, err = out_path.read_text(), err_path.read_text()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert killed is not None and "orchestrator" in err and "restarting it" in err, err[-3000:]
    assert (
        "rl: policy served by vLLM's engine in the orchestrator's process (deployment.inference_mode = auto"
        in out
    )
    assert not (run / "logs" / "inference.log").exists()  # no server was started
    log = (run / "logs" / "orchestrator.log").read_text()
    assert "starting vLLM's engine in this process" in log and "EngineCore" in log
    orch = [json.loads(line) for line in orch_m.read_text().splitlines()]
    trainer = [json.loads(line) for line in (run / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in orch] == list(range(8)) and [m["step"] for m in trainer] == list(range(8))
    versions = [m["policy_version"] for m in orch]
    assert versions[-1] >= 5 and versions == sorted(versions)  # each published step was loaded
    assert trainer[0]["mismatch_kl/all/mean"] < 1e-3  # the engine serves the trainer's logprobs
    rewards = [m["reward/all/mean"] for m in orch]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, rewards
    left = []
    for pid in alive(sorted(seen)):
        with contextlib.suppress(psutil.NoSuchProcess):
            left.append(psutil.Process(pid))
    psutil.wait_procs(left, timeout=120)
    assert seen and not alive(sorted(seen))


@pytest.fixture(scope="module")
def critic_run(tiny_model, tmp_path_factory):
    """One `rl` run with a critic (GAE, one warm-up step) and KL in the reward under the adaptive
    controller, stopped with Ctrl-C once the trainer logged 4 steps: the two tests below read it.
    Returns (rl's status, its stdout, its stderr, the trainer's first 4 steps' metrics, the
    processes it started, as seen while it ran)."""
    tmp = tmp_path_factory.mktemp("critic")
    toml = write_config(tmp, tiny_model, "short-answer-env", steps=500)
    flags = ["--orchestrator.filters", "[]", "--trainer.advantage.type", "gae",
             "--trainer.advantage.batch-normalize", "all", "--trainer.critic.warmup-steps", "1",
             "--trainer.kl-reward.beta", "0.1", "--trainer.kl-reward.estimator", "k3",
             "--trainer.kl-reward.target", "1e-6",
             "--trainer.kl-reward.horizon", "32"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ENVS}
    out_path, err_path = tmp / "rl.out", tmp / "rl.err"  # files: a full pipe would stall rl
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen([RL, "@", str(toml), *flags], stdout=out, stderr=err, text=True, env=env)
    metrics = tmp / "run" / "trainer" / "metrics.jsonl"
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 600
        while not (metrics.exists() and len(read_metrics(metrics)) >= 4):
            with contextlib.suppress(psutil.NoSuchProcess):
                seen.update(child_pids(proc.pid))
            assert proc.poll() is None, out_path.read_text()[-3000:] + err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no 4 trainer steps"
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    return proc.returncode, out_path.read_text(), err_path.read_text(), read_metrics(metrics)[:4], seen


@pytest.mark.xdist_group("critic_run")
def test_ctrl_c_stops_everything(critic_run):
    code, out, err, _, seen = critic_run
    assert code == 130, out[-3000:] + err[-3000:]
    assert "stopping every process" in err
    # rl reaps its children; wait for any grandchild on a condition, not a guess of its speed.
    left = []
    for pid in alive(sorted(seen)):
        with contextlib.suppress(psutil.NoSuchProcess):
            left.append(psutil.Process(pid))
    psutil.wait_procs(left, timeout=120)
    assert seen and not alive(sorted(seen))


@pytest.mark.xdist_group("critic_run")
def test_rl_with_a_critic_and_adaptive_kl_in_the_reward(critic_run):
    """GAE with a critic that warms up for one step, and KL in the reward under the adaptive
    controller, through `rl` end to end: the critic trains from step 0, the policy from step 1,
    and beta follows the measured KL."""
    code, out, err, trainer, _ = critic_run
    assert code == 130 and len(trainer) == 4, out[-3000:] + err[-3000:]  # (stopped by Ctrl-C after 4)
    assert "explained_var" in out and "critic warm-up" in out
    assert [m["critic/policy_trained"] for m in trainer] == [0.0, 1.0, 1.0, 1.0]
    assert all(m["critic/value_loss/all/mean"] > 0 and m["critic/grad_norm"] > 0 for m in trainer)
    betas = [m["kl_reward/beta"] for m in trainer]
    kls = [m["kl_reward/kl_per_sample"] for m in trainer]
    assert betas[0] == 0.1 and kls[-1] > 0
    for i in range(3):  # the controller moves beta toward holding the KL at its target
        assert (betas[i + 1] > betas[i]) == (kls[i] > 1e-6), (betas, kls)


@pytest.fixture(scope="module")
def distilled(tiny_model, tmp_path_factory):
    """One `rl` run with `[teacher]`, its rollouts scored by 2 env workers: the two tests below read it.
    (The orchestrator's own teacher calls, without workers, are tested against real vLLM in
    orchestrator_vllm_test.py.)"""
    from prime_rl.model.tiny import TinyModelConfig, make_tiny_model

    tmp = tmp_path_factory.mktemp("distill")
    teacher = make_tiny_model(
        TinyModelConfig(output=tmp / "teacher", seed=1, tokenizer=tiny_model, hidden_size=128, num_layers=1)
    )
    toml = write_config(tmp, tiny_model, "reverse-text", steps=3, extra="""
[teacher.model]
name = "TEACHER"

[orchestrator.teacher]
weight = 1.0
advantage_weight = 0.0
""".replace("TEACHER", str(teacher)))  # fmt: skip
    # At least one token of text per completion: a random model that samples EOS first answers
    # nothing for the teacher to score, which is not what these tests are about.
    toml.write_text(
        toml.read_text().replace("max_tokens = 24 }", "max_tokens = 24, extra_body = { min_tokens = 1 } }")
    )
    assert "min_tokens = 1" in toml.read_text()
    proc = subprocess.run([RL, "@", str(toml), "--orchestrator.filters", "[]", "--orchestrator.env_workers",
                           "2"], capture_output=True, text=True, timeout=900)  # fmt: skip
    return tmp / "run", proc


@pytest.mark.xdist_group("distilled")
def test_rl_distills_from_a_teacher_server_it_starts(distilled):
    """`[teacher]` makes `rl` start a second vLLM server; every sampled token is scored with it, and
    the teacher's signal is what trains (advantage_weight 0)."""
    run, proc = distilled
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "starting the teacher" in proc.stdout
    orch = [json.loads(line) for line in (run / "orchestrator" / "metrics.jsonl").open()]
    assert [m["step"] for m in orch] == [0, 1, 2]
    # Two unrelated random models: the student's tokens are likelier under the student (about 0.05
    # nats per token here, both being near uniform).
    assert all(m["metric/teacher_kl/reverse-text"] > 0.01 for m in orch)
    trainer = [json.loads(line) for line in (run / "trainer" / "metrics.jsonl").open()]
    # The env's advantages are weighted 0: every token advantage is the teacher's term.
    assert len(trainer) == 3 and all(
        m["token_advantage/all/std"] > 0.1 and m["grad_norm"] > 0 for m in trainer
    )


@pytest.mark.xdist_group("distilled")
def test_env_workers_ask_the_teacher_for_every_rollout_against_real_servers(distilled):
    """With env workers, the workers (not the orchestrator) ask the teacher: every rollout of every
    step comes back scored by it, and none fails."""
    run, proc = distilled
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "starting 2 env workers" in (run / "logs" / "orchestrator.log").read_text()
    orch = [json.loads(line) for line in (run / "orchestrator" / "metrics.jsonl").open()]
    assert all(m["rollouts/all/failed"] == 0 for m in orch)
    rollouts = [r for f in sorted((run / "rollouts").glob("step_*.jsonl")) for r in map(json.loads, f.open())]
    assert len(rollouts) == sum(m["rollouts/all/trained"] + m["rollouts/all/filtered"] for m in orch) > 0
    assert all(r["error"] is None and "teacher_kl" in r["metrics"] for r in rollouts), rollouts[0]


@pytest.fixture(scope="module")
def failing_env_run(tiny_model, tmp_path_factory):
    """One `rl` run of an env whose every rollout fails (its reward raises), with restarts allowed:
    the two tests below read it. Returns (rl's status, its stdout, its stderr, its run folder, the
    processes it started, as seen while it ran)."""
    tmp = tmp_path_factory.mktemp("failing_env")
    toml = write_config(tmp, tiny_model, "failing-env", steps=5, extra="[deployment]\nmax_restarts = 3\n")
    env = {**os.environ, "PYTHONPATH": ENVS}
    out_path, err_path = tmp / "rl.out", tmp / "rl.err"  # files: a full pipe would stall rl
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen([RL, "@", str(toml), "--orchestrator.max-failed-groups", "4"], stdout=out,
                                stderr=err, text=True, env=env)  # fmt: skip
    seen: set[int] = set()
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(psutil.NoSuchProcess):
            seen.update(child_pids(proc.pid))
        time.sleep(0.5)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    return proc.returncode, out_path.read_text(), err_path.read_text(), tmp / "run", seen


@pytest.mark.xdist_group("failing_env")
def test_an_env_whose_every_rollout_fails_stops_rl_with_one_line_and_is_not_retried(failing_env_run):
    code, out, err, _, _ = failing_env_run
    console = out + err
    assert code == 2, console[-3000:]
    errors = [line for line in console.splitlines() if "orchestrator: error:" in line]
    assert len(errors) == 1, console[-3000:]
    assert "env 'failing-env': the last 4 groups failed entirely" in errors[0]
    assert "broken_reward has a bug" in errors[0] or "ValueError" in errors[0], errors[0]
    assert "orchestrator.max_failed_groups = 4" in errors[0]
    assert "rl: orchestrator exited with status 2; stopping the others" in console
    assert "restarting it" not in console  # an env error is never retried
    assert "Traceback" not in console


@pytest.mark.xdist_group("failing_env")
def test_a_failing_process_stops_everything(failing_env_run):
    """The orchestrator failing (status 2, the env's error) stops the whole run: vLLM and the trainer
    are gone when `rl` returns, none left behind as an orphan."""
    code, _, err, run, seen = failing_env_run
    assert code not in (0, None), err[-3000:]
    assert "orchestrator exited with status 2" in err
    assert "failing-env" in (run / "logs" / "orchestrator.log").read_text()
    assert {"inference", "trainer"} <= {p.stem for p in (run / "logs").glob("*.log")} and len(seen) >= 3
    # rl reaps its children; a grandchild is waited for on a condition, not a guess of its speed.
    left = []
    for pid in alive(sorted(seen)):
        with contextlib.suppress(psutil.NoSuchProcess):
            left.append(psutil.Process(pid))
    psutil.wait_procs(left, timeout=120)
    assert not alive(sorted(seen))
