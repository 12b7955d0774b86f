"""On-policy distillation: teacher logprobs read at the right positions, turned into per-token
advantages on model tokens only, packed on top of the rollout's advantage, and a failing teacher
failing the rollout instead of training it without its teacher signal."""

import asyncio
import json
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from prime_rl.model.local import tokenizer_mismatch
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs.teacher import Teacher, TeacherError, parse_prompt_logprobs
from prime_rl.orchestrator.envs_config import TeacherConfig
from prime_rl.orchestrator.loop.failures import FailureStreak, RolloutsFailing
from prime_rl.orchestrator.loop.samples import rollout_to_samples
from prime_rl.orchestrator.rollout import Rollout, Turn
from prime_rl.runtime.net import free_port
from prime_rl.transport.packing import pack

MODELS = Path(__file__).parents[2] / "models"


def choice(index: int, ids: list[int], logprob) -> dict:
    """One prompt's choice in a vLLM completions answer with prompt logprobs: None first, then each
    token's (plus a top-1 alternative, which must not be picked)."""
    entries = [None] + [
        {str(t): {"logprob": logprob(i, t), "rank": 2}, "999": {"logprob": -0.01, "rank": 1}}
        for i, t in enumerate(ids[1:], 1)
    ]
    return {"index": index, "text": "x", "prompt_logprobs": entries}


def test_prompt_logprobs_are_read_for_the_actual_tokens_of_each_prompt():
    seqs = [[5, 6, 7, 8], [9, 10]]
    # Choices may come in any order: matched to prompts by index.
    answer = {"choices": [choice(1, seqs[1], lambda i, t: -10.0), choice(0, seqs[0], lambda i, t: -float(i))]}
    assert parse_prompt_logprobs(answer, seqs) == [[-1.0, -2.0, -3.0], [-10.0]]
    with pytest.raises(TeacherError, match=re.escape("3 prompt logprobs for 4 tokens (prompt 0)")):
        parse_prompt_logprobs({"choices": [{"index": 0, "prompt_logprobs": [None, {}, {}]}]}, seqs[:1])
    with pytest.raises(TeacherError, match="miss token 7 at position 2"):
        bad = [None, {"6": {"logprob": 0}}, {}, {}]
        parse_prompt_logprobs({"choices": [{"index": 0, "prompt_logprobs": bad}]}, seqs[:1])
    with pytest.raises(TeacherError, match="answered 1 prompts of 2"):
        parse_prompt_logprobs({"choices": [choice(0, seqs[0], lambda i, t: 0.0)]}, seqs)


def two_turn_rollout() -> Rollout:
    # Turn 2's prompt extends turn 1's prompt + completion with 2 env tokens (41, 42): one sample.
    t1 = Turn([1, 2], [10, 11], [1, 1], [-0.5, -1.0], teacher_logprobs=[-0.25, -3.0])
    t2 = Turn([1, 2, 10, 11, 41, 42], [12], [1], [-2.0], teacher_logprobs=[-1.0])
    return Rollout("env", 0, 0, reward=1.0, turns=[t1, t2])


def test_token_advantages_are_weighted_teacher_minus_student_on_model_tokens_only():
    (sample,) = rollout_to_samples(two_turn_rollout(), advantage=0.5, distill_weight=2.0)
    assert sample.completion_ids == [10, 11, 41, 42, 12]
    assert sample.token_advantages == [2 * 0.25, 2 * -2.0, 0.0, 0.0, 2 * 1.0]
    (plain,) = rollout_to_samples(two_turn_rollout(), advantage=0.5)
    assert plain.token_advantages == []
    # Packed, the rollout's advantage and the teacher's per-token terms travel apart.
    mb = pack([sample], seq_len=64, num_ranks=1, run_id="r", step=0)[0][0]
    assert mb.advantages == [0.5]
    assert np.allclose(mb.arrays()["token_advantages"], [0.0, 0.0, 0.5, -4.0, 0.0, 0.0, 2.0])


class FlakyTeacher(BaseHTTPRequestHandler):
    """Serves /models; /completions fails with 503 for the first `fail` calls, then answers."""

    fail = 0
    posts = 0

    def _send(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, {"data": [{"id": "teacher"}]})

    def do_POST(self):
        type(self).posts += 1
        prompts = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        if type(self).posts <= type(self).fail:
            return self._send(503, {"error": "busy"})
        self._send(200, {"choices": [choice(k, ids, lambda i, t: -0.1 * t) for k, ids in enumerate(prompts)]})


@pytest.fixture
def teacher_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FlakyTeacher)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("fail", "ok"), [(1, True), (5, False)])
def test_a_group_is_one_request_and_a_teacher_that_keeps_failing_fails_its_rollouts(teacher_url, fail, ok):
    FlakyTeacher.fail, FlakyTeacher.posts = fail, 0
    group = [
        Rollout("env", 0, 0, turns=[Turn([1, 2], [10, 11], [1, 1], [-0.5, -1.0])]),
        Rollout("env", 0, 0, error="HTTP 500"),  # failed already: not sent, returned as it is
        two_turn_rollout(),
    ]

    async def go():
        teacher = Teacher(TeacherConfig(base_url=teacher_url, model="teacher", retries=1))
        await teacher.check()
        try:
            return await teacher.score_group(group)
        finally:
            await teacher.aclose()

    out = asyncio.run(go())
    assert out[1] is group[1]
    assert FlakyTeacher.posts == 2  # the whole group in one request, then one retry
    if ok:  # one failure, then the retry answers: logprob -0.1 x token id
        assert not out[0].failed and out[0].turns[0].teacher_logprobs == pytest.approx([-1.0, -1.1])
        assert out[0].metrics["teacher_kl"] == pytest.approx(((-0.5 + 1.0) + (-1.0 + 1.1)) / 2)
        assert [t.teacher_logprobs for t in out[2].turns] == [
            pytest.approx([-1.0, -1.1]),
            pytest.approx([-1.2]),
        ]
    else:
        assert out[0].failed and out[2].failed and "failed 2 time(s), last: HTTP 503" in out[0].error


@pytest.mark.parametrize("down", [False, True])
def test_a_teacher_failing_group_after_group_stops_the_run(teacher_url, down):
    # A teacher that answers 503 stops the run after `limit` failed groups; one whose server is gone
    # (connection refused: it may be restarting) after `unreachable_s` seconds of nothing but that.
    FlakyTeacher.fail, FlakyTeacher.posts = 100, 0
    group = [Rollout("env", 0, 0, turns=[Turn([1, 2], [10, 11], [1, 1], [-0.5, -1.0])])]
    url = f"http://127.0.0.1:{free_port()}/v1" if down else teacher_url
    streak = FailureStreak(limit=2, unreachable_s=0.0)
    expected = "no server could be reached" if down else "the last 2 groups failed entirely"

    async def go():
        teacher = Teacher(TeacherConfig(base_url=url, model="teacher", retries=0))
        try:
            first = await teacher.score_group(group)
            streak.record("env", first)
            with pytest.raises(RolloutsFailing, match=f"env 'env': {expected}") as e:
                streak.record("env", await teacher.score_group(group))
            return first, e.value
        finally:
            await teacher.aclose()

    first, error = asyncio.run(go())
    assert first[0].failed and "TeacherError" in first[0].error  # the first group fails its rollouts
    assert "TeacherError" in str(error) and error.retryable  # the teacher's server: a restart may help


def test_a_teacher_with_another_tokenizer_is_named(tmp_path):
    student = MODELS / "sum_digits-tiny"
    assert tokenizer_mismatch(str(student), str(MODELS / "reverse_text-tiny")) is None
    other = tmp_path / "teacher"
    shutil.copytree(student, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert "vocabulary" in tokenizer_mismatch(str(student), str(other))


def test_distillation_config_refuses_what_would_lose_the_teacher_signal():
    env = {"id": "reverse-text"}
    with pytest.raises(ValueError, match=re.escape("set filters = []")):
        OrchestratorConfig(teacher={}, envs=[env])
    with pytest.raises(ValueError, match=re.escape("envs[0].sampling.temperature must be 1.0")):
        OrchestratorConfig(teacher={}, filters=[], envs=[{**env, "sampling": {"temperature": 0.7}}])
    OrchestratorConfig(teacher={}, filters=[], envs=[env])
