"""tests/conftest.py's `_nothing_left_running`: a test that leaves a thread running or a logging
handler on a closed stream fails, and no later test logs into a stream that an earlier one closed.

Each case runs its tests in a pytest of its own (a child process, so that what they leave behind is
not this process's), under a copy of tests/conftest.py, with and without the fixture."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parents[1] / "conftest.py").read_text()

LEAKS = """
import logging
import sys
import threading
import time

stop = threading.Event()


def test_leaves_a_thread_running():
    threading.Thread(target=stop.wait, name="left-behind").start()


def test_leaves_a_thread_that_ends_soon_and_a_daemon():
    threading.Thread(target=time.sleep, args=(0.2,), name="ends-soon").start()
    threading.Thread(target=stop.wait, name="a-daemon", daemon=True).start()


def test_leaves_a_handler_on_its_captured_stream(capsys):
    logging.getLogger("elsewhere").addHandler(logging.StreamHandler(sys.stderr))


def test_lets_the_thread_end():
    stop.set()
"""

LOGGING = """
import logging
import threading

from prime_rl.runtime.logging_setup import setup_logging


def test_a_main_sets_up_logging_on_the_captured_stderr(capsys):
    setup_logging("orchestrator")
    logging.getLogger("prime_rl.orchestrator").warning("while the test runs")


def test_a_later_thread_logs_to_a_live_stream(capsys):
    thread = threading.Thread(target=logging.getLogger("prime_rl.x").warning, args=("later",))
    thread.start()
    thread.join()
    assert "Logging error" not in capsys.readouterr().err
    assert logging.getLogger("prime_rl").level == logging.NOTSET
"""


def without_the_fixture(conftest: str) -> str:
    marker = "@pytest.fixture(autouse=True)\ndef _nothing_left_running"
    assert marker in conftest
    return conftest.replace(marker, "@pytest.fixture\ndef _nothing_left_running")


@pytest.fixture
def run(pytester):
    def run_tests(tests: str, fixture: bool):
        # A faster failure here; still many times the 0.2 s of the thread that ends soon.
        conftest = CONFTEST.replace("LINGER_S = 60.0", "LINGER_S = 5.0")
        assert conftest != CONFTEST
        pytester.makeconftest(conftest if fixture else without_the_fixture(conftest))
        pytester.makepyfile(tests)
        return pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider", "-n", "0")

    return run_tests


def test_a_thread_left_running_and_a_handler_on_a_closed_stream_fail_their_tests(run):
    result = run(LEAKS, fixture=True)
    result.assert_outcomes(passed=4, errors=2)
    out = result.stdout.str()
    assert "ERROR at teardown of test_leaves_a_thread_running" in out
    assert "a thread still running 5 s after the test: left-behind (at " in out
    assert "ERROR at teardown of test_leaves_a_handler_on_its_captured_stream" in out
    assert "logger 'elsewhere' has a handler on a closed stream" in out
    assert "ends-soon" not in out and "a-daemon" not in out  # ended within the wait; a daemon


def test_without_the_fixture_the_same_tests_pass(run):
    run(LEAKS, fixture=False).assert_outcomes(passed=4)


def test_logging_set_up_by_a_test_is_put_back_after_it(run):
    run(LOGGING, fixture=True).assert_outcomes(passed=2)
    # What the fixture prevents: the second test's thread writing to the first test's closed stream.
    result = run(LOGGING, fixture=False)
    result.assert_outcomes(passed=1, failed=1)
    assert "Logging error" in result.stdout.str()
