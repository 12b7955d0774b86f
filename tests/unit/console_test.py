"""What `rl` shows on the console from a child's output, and what reaches only the log file."""

import io
import logging
from pathlib import Path

from prime_rl.launcher.child import _pump
from prime_rl.orchestrator.rollout import Rollout, failure_reason, most_common_failure
from prime_rl.runtime.logging_setup import adopt_verifiers_logging, setup_logging

OUTPUT = """\
14:35:41 orchestrator step 12 | reward 0.399 | trained 128 filtered 0 failed 1 stale 0
14:35:41 orchestrator rollout failed: reverse-text example 7: env error: EmptyModelResponseError('no content')
14:35:41 orchestrator step 13: 9 rollouts failed, 9 of them with APIConnectionError (each one is in ...)
some vLLM progress line
(EngineCore pid=15514) INFO 11-28 00:57:48 [multiproc_executor.py:479] [shutdown] Executor: waiting for worker exit count=1
14:35:43 trainer step 12 | loss -0.0019
"""


def test_console_has_step_lines_and_warnings_but_not_per_rollout_failures(tmp_path, capsys):
    _pump("orchestrator", io.StringIO(OUTPUT), tmp_path / "o.log", console=True)
    shown = capsys.readouterr().out.splitlines()
    assert shown == [f"[orchestrator] {line}" for line in OUTPUT.splitlines() if "step 1" in line]
    assert (tmp_path / "o.log").read_text() == OUTPUT  # the log keeps everything


ENGINE_DIED = """\
14:35:41 orchestrator step 9 | reward 0.568 | trained 120 filtered 8 failed 0 stale 0
(MainProcess pid=5661) ERROR 11-28 22:47:21 [async_llm.py:906] AsyncLLM output_handler failed.
(MainProcess pid=5661) ERROR 11-28 22:47:21 [async_llm.py:906] Traceback (most recent call last):
(MainProcess pid=5661) ERROR 11-28 22:47:21 [async_llm.py:906]     raise self._format_exception(outputs) from None
(MainProcess pid=5661) ERROR 11-28 22:47:21 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.
Traceback (most recent call last):
  File "vllm/v1/engine/core_client.py", line 1235, in get_output_async
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
14:35:42 orchestrator vLLM's engine core in this process died: restarting the engine (1 of 3, client.max_restarts); the groups that were on it go to the next dispatch
Traceback (most recent call last):
orchestrator: error: vLLM's engine in this process could not restart: RuntimeError: boom
"""


def test_vllms_records_and_the_lines_that_continue_them_stay_in_the_log(tmp_path, capsys):
    """vLLM's own error record of a dead engine core (its traceback too) goes to the log only: the
    console says it once, in the orchestrator's line."""
    _pump("orchestrator", io.StringIO(ENGINE_DIED), tmp_path / "o.log", console=True)
    shown = capsys.readouterr().out.splitlines()
    assert shown == [
        "[orchestrator] " + ENGINE_DIED.splitlines()[0],
        "[orchestrator] " + ENGINE_DIED.splitlines()[8],
        "[orchestrator] Traceback (most recent call last):",
        "[orchestrator] orchestrator: error: vLLM's engine in this process could not restart: RuntimeError: boom",
    ]
    assert (tmp_path / "o.log").read_text() == ENGINE_DIED


def test_a_log_that_cannot_be_written_is_said_once_and_the_output_still_drained(capsys):
    # /dev/full fails every write with ENOSPC, as a full disk does: no thread traceback, one line,
    # the child's output is read to its end (it never blocks on a full pipe), its error line shown.
    output = "".join(f"14:35:4{i} vllm progress {i}\n" for i in range(5)) + "inference: error: boom\n"
    _pump("inference", io.StringIO(output), Path("/dev/full"), console=False)
    captured = capsys.readouterr()
    assert captured.err.count("rl: cannot write /dev/full (No space left on device)") == 1, captured.err
    assert captured.out.splitlines() == ["[inference] inference: error: boom"]


def test_verifiers_abort_line_is_left_out_of_the_log(capsys):
    import verifiers  # detaches its logger at import, as in the orchestrator

    assert verifiers
    setup_logging("orchestrator")
    adopt_verifiers_logging()  # what the orchestrator does once its envs are loaded
    logging.getLogger("verifiers.legacy.envs.environment.SingleTurnEnv").error(
        "Aborted rollout due to EmptyModelResponseError('no content')"
    )
    logging.getLogger("verifiers.rubrics").error("reward function raised")  # other errors stay
    err = capsys.readouterr().err
    assert "Aborted rollout" not in err and "orchestrator reward function raised" in err


def test_failures_count_together_by_the_kinds_in_their_chain():
    chain = "env error: ModelError() -> APIConnectionError('Connection error.') -> ReadError('')"
    assert failure_reason(chain) == "ModelError -> APIConnectionError -> ReadError"
    failures = [
        Rollout(env_name="e", example_id=i, policy_version=0, error=e)
        for i, e in enumerate([chain, chain.replace("error.", "reset"), "TimeoutError: after 2 s"])
    ]
    assert most_common_failure(failures) == ("ModelError -> APIConnectionError -> ReadError", 2)


def test_the_client_drops_idle_connections_before_any_server_closes_them(tmp_path):
    # vLLM's (and uvicorn's) default keep-alive is 5 s; servers `inference` starts keep them longer.
    import asyncio

    from prime_rl.engine.server import server_env
    from prime_rl.inference.config import InferenceConfig
    from prime_rl.orchestrator.config import ClientConfig
    from prime_rl.orchestrator.envs.client import Clients
    from prime_rl.orchestrator.envs.sampler import KEEPALIVE_EXPIRY_S

    sampler = Clients(ClientConfig(), "m").get("http://127.0.0.1:9/v1")

    async def keepalive() -> float:
        session = sampler._open()  # the model calls' aiohttp session
        try:
            return session.connector._keepalive_timeout
        finally:
            await sampler.close()

    assert asyncio.run(keepalive()) == KEEPALIVE_EXPIRY_S <= 5 - 2
    env = server_env(InferenceConfig(output_dir=tmp_path), base={})
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) >= 10 * KEEPALIVE_EXPIRY_S


def test_a_run_with_its_own_vllm_cache_and_a_long_path_still_gets_its_inference_folder(tmp_path):
    # With VLLM_CACHE_ROOT set and TMPDIR moved to /tmp (the run path is too long for vLLM's unix
    # sockets), nothing else created <output_dir>/inference, and a stop could not open its stop.log.
    from prime_rl.engine.server import server_env
    from prime_rl.inference.config import InferenceConfig

    out = tmp_path / ("deep-" * 12) / "run"
    env = server_env(InferenceConfig(output_dir=out), base={"VLLM_CACHE_ROOT": str(tmp_path / "cache")})
    assert not env["TMPDIR"].startswith(str(out)) and env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache")
    assert (out / "inference").is_dir()


def test_runs_share_vllms_own_cache(tmp_path):
    # A cache per run made every server start inspect the model's class in a subprocess that imports
    # vLLM again (8 s of a 20 s start on 2 cores) and, on GPUs, compile its kernels again.
    from prime_rl.engine.server import server_env
    from prime_rl.inference.config import InferenceConfig

    env = server_env(InferenceConfig(output_dir=tmp_path / "run"), base={})
    assert "VLLM_CACHE_ROOT" not in env  # vLLM's default: the user's cache folder
    assert not (tmp_path / "run" / "inference" / "cache").exists()
