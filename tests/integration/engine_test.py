"""vLLM's engine in the caller's process (`engine/local.py`), on the reverse-text model: token ids in,
`n` completions out (token ids, one logprob each, the policy version; a prompt past the context as
a refused request), its logprobs are the policy's (the trainer's, `min_tokens` notwithstanding),
and after `load_weights` it serves the new weights. Run in a child process, as the orchestrator
runs it: the engine's processes are that process's children and inherit its settings."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.cores import server_env
from prime_rl.engine.server import is_cpu_build
from prime_rl.trainer.logprobs import forward_logprobs

pytestmark = pytest.mark.slow

PROBE = textwrap.dedent(
    """
    import asyncio, json, os, stat, sys, tempfile
    from pathlib import Path
    import psutil
    from prime_rl.inference.config import InferenceConfig
    from prime_rl.engine.local import LocalEngine

    model, out, new_weights, report = sys.argv[1:5]

    from transformers import AutoTokenizer
    from prime_rl.engine.sampling import BadRequestError, SamplingArgs

    tok = AutoTokenizer.from_pretrained(model)

    def prompt(content):
        return tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)

    async def generate(engine, content, n=1, **extra):
        args = SamplingArgs(temperature=extra.pop("temperature", 1.0), max_tokens=12, extra=extra)
        try:
            out = await engine.generate(prompt(content), args, n)
        except BadRequestError as e:
            return {"refused": str(e)}
        return {"prompt": prompt(content), "completions": [
            {"ids": c.token_ids, "logprobs": c.logprobs, "finish": c.finish_reason, "version": c.version}
            for c in out]}

    async def streamed(engine):
        events = []
        args = SamplingArgs(temperature=1.0, max_tokens=12)
        each = lambda i, c: events.append(["each", i, c.token_ids, c.logprobs, c.text, c.finish_reason])
        out = await engine.generate(prompt("Reverse the text: hello world"), args, 6, on_each=each,
                                    on_submitted=lambda: events.append(["submitted"]))
        stopped = await engine.generate(prompt("Reverse the text: hello world"), SamplingArgs(max_tokens=12, extra={"stop": ["o"]}), 2)
        return {"events": events, "returned": [[c.token_ids, c.logprobs, c.text, c.finish_reason] for c in out],
                "stopped": [[c.token_ids, c.text] for c in stopped]}

    def sockets(folder):
        return sorted(p.name for p in Path(folder).iterdir() if stat.S_ISSOCK(p.lstat().st_mode))

    async def main():
        tempfile.gettempdir()  # settled before the engine starts, as in the orchestrator
        config = InferenceConfig(model={"name": model, "max_model_len": 256}, output_dir=out)
        engine = await LocalEngine(config).start()
        ipc_sockets = sockets(os.environ["TMPDIR"])
        me = psutil.Process()  # the engine's processes are forked: they have this one's command line
        engine_processes = [
            sorted(p.cpu_affinity()) for p in me.children(recursive=True) if p.cmdline() == me.cmdline()
        ]
        result = {
            "n": await generate(engine, "Reverse the text: hello", n=3, min_tokens=12),
            "overlong": await generate(engine, "word " * 400),
            "streamed": await streamed(engine),
        }
        # The model answers "cba" and wants to stop: min_tokens bans the end of turn where it is likely.
        forced = dict(min_tokens=12, temperature=2.0)
        result["before"] = await generate(engine, "Reverse the text: abc", **forced)
        reload = await engine.load_weights(Path(new_weights), 1)
        result["after"] = await generate(engine, "Reverse the text: abc", **forced)
        result["step"], result["reload_s"] = engine.step, reload.seconds
        result["engine_processes"] = engine_processes
        result["ipc_sockets"] = ipc_sockets
        result["log_stats"] = engine.engine.log_stats
        result["weight_bytes"] = sum(await engine.engine.collective_rpc("prime_rl_weight_bytes"))
        engine.close()
        Path(report).write_text(json.dumps(result))

    asyncio.run(main())
    """
)


MODEL = Path(__file__).parents[2] / "models" / "reverse_text-tiny"


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> tuple[dict, Path]:
    """The engine's answers before and after loading the reverse-text model with its lm_head scaled
    (step 1)."""
    tmp = tmp_path_factory.mktemp("engine")
    new = tmp / "step_1"
    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    with torch.no_grad():
        m.lm_head.weight.mul_(3.0)
    m.save_pretrained(new)
    for f in MODEL.glob("tokenizer*"):
        shutil.copy(f, new)
    report, log = tmp / "report.json", tmp / "probe.log"
    env = server_env()  # as `rl` starts an engine-mode orchestrator: the inference cores named
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(max(os.sched_getaffinity(0))))
    with log.open("w") as out:
        # Its own process group: a probe that times out is stopped with the engine it forked.
        proc = subprocess.Popen(
            [sys.executable, "-c", PROBE, str(MODEL), str(tmp / "out"), str(new), str(report)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        code = proc.wait(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0 and report.exists(), log.read_text()[-4000:]
    return {**json.loads(report.read_text()), "bind": env["VLLM_CPU_OMP_THREADS_BIND"]}, new


def test_token_ids_in_give_n_completions_with_one_logprob_per_token(probed):
    answers, _ = probed
    completions = answers["n"]["completions"]
    assert len(completions) == 3
    for c in completions:
        assert len(c["ids"]) == len(c["logprobs"]) == 12 and c["finish"] == "length" and c["version"] == 0
        assert all(lp <= 0.0 for lp in c["logprobs"])
    assert len({tuple(c["ids"]) for c in completions}) > 1  # three samples, not one copied


def test_a_prompt_past_the_context_is_a_refused_request_that_says_so(probed):
    answers, _ = probed
    assert "256" in answers["overlong"]["refused"]


def test_after_load_weights_the_new_weights_are_served_with_the_policys_logprobs(probed):
    """The served logprobs are the trainer's at the temperature, though `min_tokens` banned the end of
    turn the model wanted (`policy_logprobs.py`; vLLM's processed ones differ there by nats)."""
    answers, new = probed
    assert answers["step"] == 1
    for key, weights in (("before", MODEL), ("after", new)):
        (c,) = answers[key]["completions"]
        prompt, completion, served = answers[key]["prompt"], c["ids"], torch.tensor(c["logprobs"])
        assert c["version"] == (1 if key == "after" else 0)
        m = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
        ids = torch.tensor(prompt + completion)
        with torch.no_grad():
            expected, _ = forward_logprobs(m, ids, torch.arange(len(ids)), 2.0)
        assert (served - expected[len(prompt) :]).abs().max() < 1e-3, key


def test_the_workers_weight_bytes_count_the_weights_vllm_cpu_repacks_out_of_the_parameters(
    probed,
):
    """What bounds a trainer's broadcast (`PLAN_SLACK` x these bytes): at least the checkpoint served.
    vllm-cpu keeps the linear layers' weights outside their parameters, which the count missed."""
    answers, _ = probed
    checkpoint = sum(f.stat().st_size for f in MODEL.glob("*.safetensors"))
    assert answers["weight_bytes"] >= checkpoint > 0


def test_the_engines_sockets_are_in_the_runs_private_folder(probed):
    # The probe looked its temp folder up before starting the engine, as the orchestrator does:
    # the sockets still go to the run's folder, which only this user may enter.
    assert probed[0]["ipc_sockets"], "vLLM's sockets were not made in the run's private folder"


def test_the_front_end_keeps_no_per_request_statistics(probed):
    """vLLM's per-request statistics (a latency record and two environment lookups per request per
    engine step) feed only its periodic log lines and a metrics route the engine mode does not serve."""
    answers, _ = probed
    assert answers["log_stats"] is False


@pytest.mark.skipif(not is_cpu_build(), reason="vllm-cpu's executor choice")
def test_on_vllm_cpu_the_engine_core_runs_the_model_on_the_inference_cores_alone(probed):
    """`in_core.py`: with the inference cores named, the engine's only process is its core (no worker
    process beside it), bound to exactly those cores; the answers above came from it."""
    answers, _ = probed
    cores = sorted(int(c) for c in answers["bind"].split(","))
    assert answers["engine_processes"] == [cores]


def test_a_group_request_hands_out_each_completion_as_it_ends_and_says_when_it_is_in(probed):
    """`on_submitted` first (the engine core has the request), then `on_each` per completion in the
    order they end (a shorter one, ended at an earlier engine step, comes first), each equal to what
    the call returns; its text decoded from its tokens. With stop strings, vLLM's own detokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    streamed = probed[0]["streamed"]
    events, returned = streamed["events"], streamed["returned"]
    assert events[0] == ["submitted"] and len(events) == 7
    assert sorted(e[1] for e in events[1:]) == list(range(6))
    for _, i, *completion in events[1:]:
        assert completion == returned[i]
        ids, logprobs, text, _ = completion
        assert len(ids) == len(logprobs) and text == tok.decode(ids, skip_special_tokens=True)
    lengths = [len(e[2]) for e in events[1:]]
    assert lengths == sorted(lengths)
    for ids, text in streamed["stopped"]:
        assert "o" not in text and text == tok.decode(ids, skip_special_tokens=True)[: len(text)]
