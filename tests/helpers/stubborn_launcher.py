"""A launcher whose one child ignores SIGTERM, for signals_test: prints the child's pid, then waits
for signals with rl's handlers installed (grace period 2 s)."""

import subprocess
import sys
import time
from pathlib import Path

from prime_rl.launcher.child import Child
from prime_rl.launcher.config import RLConfig
from prime_rl.launcher.supervisor import Launcher, install_signal_handlers

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"

launcher = Launcher(RLConfig(output_dir=sys.argv[1]))
launcher.grace_s = 2.0
proc = subprocess.Popen(
    [sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True, start_new_session=True
)
assert proc.stdout.readline().strip() == "ready"
launcher.children.append(Child("stubborn", proc, Path(sys.argv[1]) / "stubborn.log"))
install_signal_handlers(launcher)
print(proc.pid, flush=True)
while True:
    time.sleep(0.1)
