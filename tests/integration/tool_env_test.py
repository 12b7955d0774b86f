"""A tool-use rollout against a real vLLM server: the orchestrator reads the model's hermes tool call
from its tokens, runs the task's tool in-process, the model answers with the result, and the
rollout trains as one sample holding exactly the sampled tokens (the tool's response in between
with loss mask 0)."""

from pathlib import Path

import pytest
import torch
from token_checks import check_exact, rollouts_of
from tool_add.transcripts import tool_schemas
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.orchestrator.envs_config import SamplingConfig
from prime_rl.orchestrator.loop.samples import turn_stats

# One worker for the module: its tests share the module's vLLM server (`served`), started once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tool_server")]

MODEL = Path(__file__).resolve().parents[2] / "models" / "tool_add-tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory, start_vllm):
    out = tmp_path_factory.mktemp("tool-inference")
    with start_vllm(MODEL, out, 512) as s:  # no tool parser: the orchestrator reads the calls
        yield s


def test_a_tool_call_rollout_runs_the_tool_and_trains_on_the_exact_tokens(served):
    sampling = SamplingConfig(temperature=1.0, max_tokens=64)

    def called(rollouts):
        return any(r.tool_calls and len(r.turns) == 2 and turn_stats(r).samples == 1 for r in rollouts)

    rollouts, wire = rollouts_of(served, "tool-add", sampling, 4, until=called)
    assert called(rollouts)
    tools = tool_schemas()  # what the orchestrator renders into the prompt
    hf = (
        AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32),
        AutoTokenizer.from_pretrained(MODEL),
    )
    for r in rollouts:
        check_exact(r, wire, hf, tools=tools)
    r = next(r for r in rollouts if r.tool_calls and len(r.turns) == 2)
    call, result = r.completion[0], r.completion[1]
    assert call["role"] == "assistant" and call["tool_calls"][0]["function"]["name"] == "add"
    assert result["role"] == "tool"  # the tool ran on the model's arguments
    assert r.tool_calls == 1 and r.tool_errors == 0


def test_a_tool_env_runs_in_an_env_worker(served, tmp_path):
    """The same tool rollouts through `orchestrator.env_workers`: the worker process plays the env and
    runs the tool, and the rollouts come back over zmq with their tool calls and turns."""
    import asyncio

    from prime_rl.orchestrator.config import OrchestratorConfig
    from prime_rl.orchestrator.envs.local import LocalEnvs
    from prime_rl.orchestrator.loop.examples import ExampleSource
    from prime_rl.orchestrator.loop.workers import WorkerPool
    from prime_rl.orchestrator.messages import GroupJob

    config = OrchestratorConfig(
        model={"name": str(MODEL)},
        output_dir=tmp_path / "run",
        env_workers=1,
        envs=[{"id": "tool-add", "group_size": 8, "sampling": {"temperature": 1.0, "max_tokens": 64}}],
        client={"base_urls": [f"{served.base}/v1"], "timeout_s": 60},
        transport={"type": "filesystem", "run_id": "test"},
    )

    async def go() -> list:
        pool = WorkerPool(config, LocalEnvs(config, rollouts=False))
        (env,), _ = await pool.start()
        examples, out = ExampleSource(env.examples, 0), []
        try:
            for job_id in range(4):
                e = examples.next()
                out += await pool.run(
                    GroupJob(job_id, env.name, e.example_id, e.task, 8, 0, f"{served.base}/v1")
                )
                if any(r.tool_calls and len(r.turns) == 2 for r in out):
                    break
        finally:
            await pool.close()
        return out

    rollouts = asyncio.run(go())
    assert not [r.error for r in rollouts if r.failed]
    r = next(r for r in rollouts if r.tool_calls and len(r.turns) == 2)
    assert r.completion[1]["role"] == "tool" and r.tool_calls == 1
    assert turn_stats(r).samples == 1 and r.reward is not None
