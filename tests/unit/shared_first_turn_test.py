"""A group's identical first turns as one request (`policy.SharedFirstTurn`): with a sampler that
streams, each seat gets its completion as soon as that one ends, and the request is out before the
group's other episodes start; a failure reaches the seats still waiting."""

import asyncio

import pytest

from prime_rl.engine.sampling import Completion, SamplingArgs
from prime_rl.orchestrator.envs.policy import SharedFirstTurn

ARGS = SamplingArgs(max_tokens=4)


def completion(i: int) -> Completion:
    return Completion([i], [-0.5], str(i), "stop")


class Streaming:
    """Ends completions 1 and 0 at once, then the rest when `release` is set (or fails then)."""

    streams = True

    def __init__(self, fail: bool = False):
        self.release = asyncio.Event()
        self.fail = fail
        self.calls = 0

    async def sample(self, prompt_ids, args, n, on_each=None, on_submitted=None):
        self.calls += 1
        if on_each is None:  # a request of its own
            return [completion(i) for i in range(n)]
        on_submitted()
        on_each(1, completion(1))
        on_each(0, completion(0))
        await self.release.wait()
        if self.fail:
            raise ConnectionError("engine gone")
        for i in range(2, n):
            on_each(i, completion(i))
        return [completion(i) for i in range(n)]


async def settle() -> None:
    for _ in range(10):  # event-loop turns, no wall clock: every ready callback runs
        await asyncio.sleep(0)


def test_each_seat_gets_its_completion_as_soon_as_it_ends():
    async def go():
        shared, sampler = SharedFirstTurn(3), Streaming()
        seats = [asyncio.ensure_future(shared.sample(sampler, [1, 2], ARGS)) for _ in range(3)]
        await shared.sent
        await settle()
        early = [s.done() for s in seats]
        sampler.release.set()
        return early, await asyncio.gather(*seats), sampler

    early, got, sampler = asyncio.run(go())
    assert early == [True, True, False]  # the first two ended with the request still running
    assert [c.token_ids for c in got] == [[0], [1], [2]] and sampler.calls == 1


def test_a_failure_after_some_completions_ended_reaches_only_the_seats_still_waiting():
    async def go():
        shared, sampler = SharedFirstTurn(3), Streaming(fail=True)
        seats = [asyncio.ensure_future(shared.sample(sampler, [1, 2], ARGS)) for _ in range(3)]
        await settle()
        sampler.release.set()
        return await asyncio.gather(*seats, return_exceptions=True)

    first, second, third = asyncio.run(go())
    assert first.token_ids == [0] and second.token_ids == [1]
    assert isinstance(third, ConnectionError)


def test_a_sampler_that_does_not_stream_hands_out_the_completions_together():
    class Whole:
        def __init__(self):
            self.release = asyncio.Event()

        async def sample(self, prompt_ids, args, n):
            await self.release.wait()
            return [completion(i) for i in range(n)]

    async def go():
        shared, sampler = SharedFirstTurn(2), Whole()
        seats = [asyncio.ensure_future(shared.sample(sampler, [1, 2], ARGS)) for _ in range(2)]
        await shared.sent  # out at once: no engine to say when it is in
        await settle()
        waiting = not any(s.done() for s in seats)
        sampler.release.set()
        return waiting, await asyncio.gather(*seats)

    waiting, got = asyncio.run(go())
    assert waiting and [c.token_ids for c in got] == [[0], [1]]


@pytest.mark.parametrize("differs", [True, False])
def test_a_first_turn_that_differs_or_comes_after_size_is_its_own_request(differs):
    async def go():
        shared, sampler = SharedFirstTurn(2), Streaming()
        sampler.release.set()
        for _ in range(2):
            await shared.sample(sampler, [1, 2], ARGS)
        await shared.sample(sampler, [9] if differs else [1, 2], ARGS)
        return sampler.calls

    assert asyncio.run(go()) == 2


class Recorded:
    """Answers at once, recording each request's prompt, size and whether it was cancelled."""

    def __init__(self):
        self.requests: list[list] = []
        self.release = asyncio.Event()

    async def sample(self, prompt_ids, args, n):
        request = [list(prompt_ids), n, "asked"]
        self.requests.append(request)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            request[2] = "cancelled"
            raise
        return [completion(i) for i in range(n)]


@pytest.mark.parametrize("guess", [[1, 2], [7]])
def test_a_guessed_first_turn_is_the_groups_request_or_is_replaced_by_the_seats_own(guess):
    """`prefetch` requests the group's first turn before any seat asks: a seat asking for the same
    prompt takes it; a seat asking for another replaces it (cancelled), and the group shares that."""

    async def go():
        shared, sampler = SharedFirstTurn(2), Recorded()
        shared.prefetch(sampler, guess, ARGS)
        await settle()
        seats = [asyncio.ensure_future(shared.sample(sampler, [1, 2], ARGS)) for _ in range(2)]
        await settle()
        sampler.release.set()
        return await asyncio.gather(*seats), sampler.requests

    got, requests = asyncio.run(go())
    assert [c.token_ids for c in got] == [[0], [1]]
    if guess == [1, 2]:
        assert requests == [[[1, 2], 2, "asked"]]
    else:
        assert requests == [[[7], 2, "cancelled"], [[1, 2], 2, "asked"]]
