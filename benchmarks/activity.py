"""What the activity records cost (`prime_rl/runtime/activity.py`, read by `rl`'s watchdog), against
step time.

    uv run python benchmarks/activity.py [--steps 10] [--writes 200000]

1. One state change (`activity.doing` with a new state), a collective's pair of changes
   (`activity.waiting`) and one heartbeat, timed in this process over `--writes` calls.
2. A real run, `rl @ configs/reverse_text/rl.toml --max-steps N` (real vLLM, trainer, orchestrator):
   each process's record counts its state changes (the sequence number in its header); the
   orchestrator's CPU time is sampled from /proc while it runs. Printed: state changes per step and
   per rollout, and what they cost as a share of the trainer's step time and of the orchestrator's
   CPU per rollout (the heartbeat thread's once-a-second write included).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prime_rl.runtime import activity

ROOT = Path(__file__).resolve().parents[1]


def micro(writes: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        activity.start("bench", "trainer", tmp)
        t0 = time.perf_counter()
        for i in range(writes):
            activity.doing(f"step {i}: training", "", i)
        doing_us = (time.perf_counter() - t0) / writes * 1e6
        t0 = time.perf_counter()
        for _ in range(writes):
            with activity.waiting("an all_reduce (sum)", "trainer"):
                pass
        waiting_us = (time.perf_counter() - t0) / writes * 1e6
        record = activity._record
        t0 = time.perf_counter()
        for _ in range(writes):
            record.beat(8)
        beat_us = (time.perf_counter() - t0) / writes * 1e6
        activity.stop()
    return {"doing_us": doing_us, "waiting_us": waiting_us, "beat_us": beat_us}


def cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def real_run(steps: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench-activity-"))
    cmd = [str(Path(sys.executable).parent / "rl"), "@", str(ROOT / "configs/reverse_text/rl.toml"),
           "--max-steps", str(steps), "--output-dir", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    orch_pid, orch_cpu = None, 0.0
    changes: dict[str, int] = {}  # label -> state changes (records go away at a clean exit: sampled)
    while proc.poll() is None:
        for state in activity.read_all(out / "activity"):
            with contextlib.suppress(OSError, struct.error):
                seq = struct.unpack("<Q", state.path.read_bytes()[:8])[0]
                changes[state.label] = max(changes.get(state.label, 0), seq // 2)
            if state.kind == "orchestrator":
                orch_pid = state.pid
        if orch_pid is not None and (c := cpu_s(orch_pid)) is not None:
            orch_cpu = c
        time.sleep(0.2)
    assert proc.returncode == 0, f"rl failed ({proc.returncode}); see {out}/logs"
    trainer = [json.loads(line) for line in (out / "trainer/metrics.jsonl").read_text().splitlines()]
    orch = [json.loads(line) for line in (out / "orchestrator/metrics.jsonl").read_text().splitlines()]
    rollouts = max(m.get("rollouts/all/dispatched_total", 0) for m in orch)  # (eval records lack it)
    step_s = sum(m["time/step"] for m in trainer[1:]) / max(1, len(trainer) - 1)
    run_s = sum(m["time/step"] for m in trainer)
    return {"changes": changes, "rollouts": rollouts, "step_s": step_s, "run_s": run_s, "orch_cpu_s": orch_cpu,
            "steps": steps, "out": str(out)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--writes", type=int, default=200_000)
    args = parser.parse_args()
    m = micro(args.writes)
    print(f"state change {m['doing_us']:.2f} us, collective pair {m['waiting_us']:.2f} us, "
          f"heartbeat {m['beat_us']:.2f} us (mean over {args.writes} calls)")  # fmt: skip
    r = real_run(args.steps)
    print(f"rl on reverse_text, {r['steps']} steps, {r['rollouts']} rollouts, trainer step {r['step_s']:.3f} s "
          f"(output in {r['out']})")  # fmt: skip
    worst = 0.0
    for label, n in sorted(r["changes"].items()):
        per_step = n / r["steps"]
        # State changes, plus one heartbeat a second over the run.
        cost_s = per_step * m["doing_us"] * 1e-6 + r["step_s"] * m["beat_us"] * 1e-6 / activity.BEAT_S
        share = cost_s / r["step_s"]
        worst = max(worst, share)
        print(f"  {label:16s} {per_step:8.1f} state changes per step -> {share:.5%} of step time")
    orch = sum(n for label, n in r["changes"].items() if label == "orchestrator")
    per_rollout_us = orch / r["rollouts"] * m["doing_us"]
    orch_cpu_us = r["orch_cpu_s"] / r["rollouts"] * 1e6
    print(f"orchestrator: {orch / r['rollouts']:.2f} state changes per rollout = {per_rollout_us:.2f} us, "
          f"of its {orch_cpu_us:.0f} us CPU per rollout: {per_rollout_us / orch_cpu_us:.4%}")  # fmt: skip
    print(f"worst process: records cost {worst:.5%} of step time (target < 1%)")


if __name__ == "__main__":
    main()
