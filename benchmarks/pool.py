"""What a membership change of the inference pool costs a step: a server joins, then leaves.

    uv run python benchmarks/pool.py [--steps 40] [--join-at 8] [--leave-after 10] [--mode server|engine]
                                     [--weights filesystem|collective]

Runs `rl @ configs/reverse_text/rl.toml` (its own vLLM server, or vLLM's engine in the orchestrator
with `--mode engine`), starts a second server with `inference --pool.join <run dir>` before the run
so that its start-up (vLLM's, tens of seconds on 2 cores) is not in any step, holds it back from the
pool until trainer step `--join-at` (its registration is what is measured), and sends it SIGTERM
`--leave-after` steps after it joined (it drains and leaves). From the orchestrator's metrics it
prints, for each change, the step time over the 3 steps before, the step in which it happened, and
the 3 steps after, with their ratios to the steps before; and the share of the groups the new
server took in the 3 steps after it joined (the fair share of 2 servers is 0.5).

On 2 cores the two servers and the trainer share the same cores, so a second server adds little
throughput here: the figure that matters is what the change costs the steps around it, which the
limit (no change at all) puts at 1.00x.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prime_rl.runtime.monitor import read_metrics
from prime_rl.runtime.net import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = REPO / "models" / "reverse_text-tiny"


def orchestrator_steps(out: Path) -> list[dict]:
    path = out / "orchestrator" / "metrics.jsonl"
    return [m for m in read_metrics(path) if "time/step" in m] if path.exists() else []


def wait_for(condition, what: str, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.2)


def measure(args, out: Path) -> tuple[list[dict], str]:
    port = free_port()
    rl_cmd = [str(BIN / "rl"), "@", str(REPO / "configs/reverse_text/rl.toml"), "--output_dir", str(out),
              "--max_steps", str(args.steps), "--deployment.inference_mode", args.mode,
              "--orchestrator.eval.at_start", "false", "--orchestrator.eval.interval", str(args.steps + 1),
              "--trainer.weight_broadcast.type", args.weights]  # fmt: skip
    rl = subprocess.Popen(rl_cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    # The second server starts now (its vLLM loads meanwhile) and registers once the pool's address
    # is written where it looks (`door`), at step `--join-at`.
    wait_for(lambda: (out / ".secret").exists(), "the run's secret", rl)
    door = out / "door"
    door.mkdir()
    log = (out / "second.log").open("w")
    second_cmd = [str(BIN / "inference"), "--model.name", str(MODEL), "--output-dir", str(out),
                  "--server.port", str(port), "--pool.join", str(door), "--pool.drain-s", "60"]  # fmt: skip
    env = {**os.environ, "PRIME_RL_SECRET_FILE": str(out / ".secret")}
    second = subprocess.Popen(
        second_cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    name = f"127.0.0.1:{port}"
    try:
        wait_for(lambda: len(orchestrator_steps(out)) >= args.join_at, f"step {args.join_at}", rl)
        # The door opens: the pool address, where the second server looks for it.
        (door / "orchestrator").mkdir()
        (door / "orchestrator" / "pool.json").write_text((out / "orchestrator" / "pool.json").read_text())
        wait_for(
            lambda: any(m.get(f"pool/{name}/step") is not None for m in orchestrator_steps(out)),
            "the join",
            rl,
        )
        joined = len(orchestrator_steps(out))
        wait_for(lambda: len(orchestrator_steps(out)) >= joined + args.leave_after, "the leave", rl)
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=300)
        rl.wait(timeout=1800)
    finally:
        for proc in (second, rl):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL) if proc is second else proc.send_signal(signal.SIGINT)
                proc.wait()
    if rl.returncode != 0:
        raise SystemExit(f"rl failed ({rl.returncode}); see {out / 'logs'}")
    return orchestrator_steps(out), name


def around(steps: list[dict], at: int) -> tuple[float, float, float]:
    """Mean step time over the 3 steps before `at`, at `at`, and over the 3 after."""
    t = [m["time/step"] for m in steps]
    before = t[max(0, at - 3) : at]
    after = t[at + 1 : at + 4]
    return sum(before) / len(before), t[at], sum(after) / max(1, len(after))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--join-at", type=int, default=8)
    p.add_argument("--leave-after", type=int, default=10)
    p.add_argument("--mode", choices=["server", "engine"], default="server")
    p.add_argument("--weights", choices=["filesystem", "collective"], default="filesystem")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pool-bench-") as tmp:
        steps, name = measure(args, Path(tmp) / "run")
    members = [sum(m.get(f"pool/{k}", 0) for k in ("serving", "joining", "draining")) for m in steps]
    join = next(i for i, m in enumerate(steps) if m.get(f"pool/{name}/step") is not None)
    leave = next(i for i in range(join + 1, len(steps)) if members[i] < members[join])
    print(
        f"{args.mode} mode, {args.weights} weights, {len(steps)} steps; the second server joined in step "
        f"{join}, left in step {leave}"
    )
    print(
        f"{'change':<8} {'before (s)':>11} {'during (s)':>11} {'after (s)':>10} {'during/before':>14} {'after/before':>13}"
    )
    for what, at in (("join", join), ("leave", leave)):
        before, during, after = around(steps, at)
        print(
            f"{what:<8} {before:>11.2f} {during:>11.2f} {after:>10.2f} {during / before:>13.2f}x {after / before:>12.2f}x"
        )
    window = steps[join + 1 : join + 4]
    mine = sum(m.get(f"pool/{name}/groups", 0) for m in window)
    every = sum(v for m in window for k, v in m.items() if k.startswith("pool/") and k.endswith("/groups"))
    print(
        f"groups the new server took in the 3 steps after joining: {mine} of {every} ({mine / max(every, 1):.2f}; fair share 0.50)"
    )


if __name__ == "__main__":
    main()
