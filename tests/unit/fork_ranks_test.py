"""The test helper that forks a job's ranks (`tests/helpers/fork_ranks.py`) fails as torchrun does:
a failed rank stops the others, and its status is the launch's."""

import subprocess
import sys
from pathlib import Path

FORK_RANKS = Path(__file__).parents[1] / "helpers" / "fork_ranks.py"


def test_a_failed_rank_stops_the_others_and_its_status_is_the_launchs(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "rank = int(os.environ['RANK'])\n"
        "Path(sys.argv[1], f'rank{rank}').write_text(f\"{os.environ['WORLD_SIZE']} {os.environ['MASTER_PORT']}\")\n"
        "if rank == 1:\n"
        "    sys.exit(3)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.run(
        [sys.executable, FORK_RANKS, "2", script, tmp_path], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3, proc.stderr
    assert "rank 1 exited with 3; stopping the others" in proc.stderr
    seen = [(tmp_path / f"rank{r}").read_text().split() for r in (0, 1)]
    assert seen[0] == seen[1] and seen[0][0] == "2"  # one world: its size and rendezvous port
