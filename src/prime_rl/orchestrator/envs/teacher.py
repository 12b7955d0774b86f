"""On-policy distillation: a teacher model, served by its own vLLM server, scores the student's tokens.

After a group's rollouts finish, every model call's prompt and sampled tokens go to the teacher in
one completions request (a list of token-id prompts) with `prompt_logprobs`, so the teacher reads exactly the student's token ids
(never re-tokenized text) and returns its logprob of every one. `rollout_to_samples` turns them into
per-token advantages, weight x (log p_teacher - log p_student): minus the per-token reverse KL, the
signal of on-policy distillation, added to the env's advantage scaled by `advantage_weight`.

Invariant: a rollout trains with teacher logprobs for every one of its sampled tokens or not at all:
a teacher that fails (after its retries) or answers with the wrong number of logprobs fails the
rollout with the reason; a teacher that keeps failing stops the run through the general bound on
failing groups (`orchestrator.max_failed_groups`, `failures.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from prime_rl.auth import clients
from prime_rl.orchestrator.envs.http_retry import post_json
from prime_rl.orchestrator.envs_config import TeacherConfig
from prime_rl.orchestrator.rollout import Rollout, Turn, failed_rollout
from prime_rl.runtime import tls

log = logging.getLogger("prime_rl.orchestrator")


class TeacherError(RuntimeError):
    """The teacher could not score a sequence; the message says why."""


class Teacher:
    """The client of a teacher server: logprobs of token sequences, with retries."""

    def __init__(self, config: TeacherConfig):
        import httpx

        self.config = config
        self.model = config.model
        self.base = config.base_url.rstrip("/")
        self._client = httpx.AsyncClient(timeout=config.timeout_s, verify=tls.context(), auth=clients.auth())
        self._slots = asyncio.Semaphore(config.concurrency)

    async def check(self, wait_s: float = 0.0) -> None:
        """Fail fast when the server does not serve `model`. A server that cannot be reached yet is
        asked again for up to `wait_s` seconds: `rl` starts the orchestrator while it starts the
        teacher's server."""
        import httpx

        deadline, waited = time.monotonic() + wait_s, False
        while True:
            try:
                response = await self._client.get(f"{self.base}/models", timeout=10)
                response.raise_for_status()
                served = [m["id"] for m in response.json().get("data", [])]
                break
            except httpx.TransportError as e:
                if not waited:
                    log.info("waiting for the teacher server %s (%s)", self.base, type(e).__name__)
                    waited = True
                if time.monotonic() >= deadline:
                    raise TeacherError(
                        f"teacher.base_url: {self.config.base_url} does not answer /models: {e}"
                    ) from None
                await asyncio.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
            except (httpx.HTTPError, ValueError, KeyError) as e:
                raise TeacherError(
                    f"teacher.base_url: {self.config.base_url} does not answer /models: {e}"
                ) from None
        if self.model and self.model not in served:
            raise TeacherError(
                f"teacher.model: '{self.model}' is not served at {self.config.base_url} (it serves {served})"
            )
        if not served:
            raise TeacherError(f"teacher.base_url: {self.config.base_url} serves no model")
        self.model = self.model or served[0]

    async def logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """The teacher's logprob of each token of each sequence after the ones before it
        (len(ids) - 1 values per sequence), from one request: one HTTP round trip per group."""
        body = {
            "model": self.model,
            "prompt": sequences,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
        }
        async with self._slots:
            answer = await post_json(
                self._client,
                f"{self.base}/completions",
                body,
                retries=self.config.retries,
                timeout_s=self.config.timeout_s,
                what=f"teacher at {self.config.base_url}",
                error=TeacherError,
            )
        return parse_prompt_logprobs(answer, sequences)

    async def score_group(self, rollouts: list[Rollout]) -> list[Rollout]:
        """The rollouts with teacher logprobs on every turn; if the teacher fails, every rollout it
        was asked about fails with the reason (already failed ones are returned as they are)."""
        where = [(i, j) for i, r in enumerate(rollouts) if not r.failed for j in range(len(r.turns))]
        if not where:
            return list(rollouts)
        sequences = [rollouts[i].turns[j].prompt_ids + rollouts[i].turns[j].completion_ids for i, j in where]
        try:
            values = await self.logprobs(sequences)
        except TeacherError as e:
            return [
                r
                if r.failed
                else failed_rollout(r.env_name, r.example_id, r.policy_version, f"TeacherError: {e}")
                for r in rollouts
            ]
        turns: dict[int, list[Turn]] = {}
        for (i, j), lp in zip(where, values, strict=True):
            turn = rollouts[i].turns[j]
            turns.setdefault(i, []).append(replace(turn, teacher_logprobs=lp[len(turn.prompt_ids) - 1 :]))
        return [
            replace(r, turns=turns[i], metrics={**r.metrics, "teacher_kl": reverse_kl(turns[i])})
            if i in turns
            else r
            for i, r in enumerate(rollouts)
        ]

    async def aclose(self) -> None:
        await self._client.aclose()


def parse_prompt_logprobs(answer: dict, sequences: list[list[int]]) -> list[list[float]]:
    """For each sequence, the logprob of each of its tokens but the first, from a vLLM completions
    answer with `prompt_logprobs` (one choice per prompt, matched by `index`)."""
    try:
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        entries_per_prompt = [c["prompt_logprobs"] for c in choices]
    except (KeyError, TypeError):
        raise TeacherError("the teacher's answer has no prompt_logprobs (is it a vLLM server?)") from None
    if len(entries_per_prompt) != len(sequences):
        raise TeacherError(f"the teacher answered {len(entries_per_prompt)} prompts of {len(sequences)}")
    out = []
    for k, (entries, ids) in enumerate(zip(entries_per_prompt, sequences, strict=True)):
        if not isinstance(entries, list) or len(entries) != len(ids):
            got = len(entries) if isinstance(entries, list) else 0
            raise TeacherError(
                f"the teacher returned {got} prompt logprobs for {len(ids)} tokens (prompt {k})"
            )
        values = []
        for i in range(1, len(ids)):
            found = (entries[i] or {}).get(str(ids[i]))
            if found is None:
                raise TeacherError(
                    f"the teacher's prompt logprobs miss token {ids[i]} at position {i} (prompt {k})"
                )
            values.append(float(found["logprob"]))
        out.append(values)
    return out


def reverse_kl(turns: list[Turn]) -> float:
    """Mean over sampled tokens of log p_student - log p_teacher (the per-token reverse KL estimate)."""
    diffs = [
        s - t
        for turn in turns
        for s, t, m in zip(
            turn.completion_logprobs, turn.teacher_logprobs or [], turn.completion_mask, strict=False
        )
        if m
    ]
    return sum(diffs) / len(diffs) if diffs else 0.0
