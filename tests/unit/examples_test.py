"""The example stream: each epoch a seeded permutation of the taskset, read as a stream (at most the
shuffle buffer held), resumable from its cursor, and a clear error for an empty or failing taskset."""

import itertools

import pytest

from prime_rl.environments import EnvError
from prime_rl.orchestrator.loop.examples import Cursor, ExampleSource


class Counted:
    """A re-iterable taskset stand-in that counts the items read (`n=None`: endless)."""

    def __init__(self, n: int | None, fail_at: int | None = None):
        self.n, self.fail_at, self.read = n, fail_at, 0

    def __iter__(self):
        for i in itertools.count() if self.n is None else range(self.n):
            if i == self.fail_at:
                raise ValueError(f"row {i} is broken")
            self.read += 1
            yield i


def draw(source: ExampleSource, k: int) -> list[int]:
    return [source.next() for _ in range(k)]


def test_each_epoch_is_a_seeded_permutation_of_the_whole_taskset():
    source = ExampleSource(Counted(50), seed=3, buffer=8)
    first, second = draw(source, 50), draw(source, 50)
    assert sorted(first) == sorted(second) == list(range(50))
    assert first != list(range(50)) and second != first  # shuffled, differently each epoch
    assert source.cursor == Cursor(1, 50) and source.epoch_size == 50
    assert draw(ExampleSource(Counted(50), seed=3, buffer=8), 100) == first + second
    assert draw(ExampleSource(Counted(50), seed=4, buffer=8), 50) != first


def test_the_taskset_is_read_as_a_stream_holding_at_most_the_buffer():
    tasks = Counted(None)  # endless: listing it would never return
    source = ExampleSource(tasks, seed=0, buffer=16)
    drawn = draw(source, 200)
    assert tasks.read <= 200 + 16
    assert len(set(drawn)) == 200 and drawn != sorted(drawn)
    assert all(x < 200 + 16 for x in drawn)


def test_a_resumed_source_continues_with_the_same_next_examples():
    run = ExampleSource(Counted(10), seed=1, buffer=3)
    draw(run, 7)
    saved = Cursor(run.cursor.epoch, run.cursor.position)
    resumed = ExampleSource(Counted(10), seed=1, cursor=saved, buffer=3)
    assert draw(resumed, 15) == draw(run, 15)  # across the end of the epoch too


def test_an_empty_or_failing_taskset_is_an_env_error_naming_the_env():
    with pytest.raises(EnvError, match="env 'words': its taskset has no tasks"):
        ExampleSource(Counted(0), seed=0, name="words").next()
    source = ExampleSource(Counted(None, fail_at=5), seed=0, buffer=2, name="words")
    with pytest.raises(
        EnvError, match=r"env 'words': reading its next task failed .*ValueError: row 5 is broken"
    ):
        draw(source, 10)


def test_examples_to_dispatch_again_survive_the_progress_file_and_old_entries_are_dropped(caplog):
    import json

    from prime_rl.orchestrator.loop.progress import again_from_json
    from prime_rl.orchestrator.messages import Example

    saved = json.loads(
        json.dumps([["words", 7, {"idx": 7, "prompt": "word7", "word": "word7"}], ["words", 3]])
    )
    assert again_from_json(saved) == [("words", Example(7, {"idx": 7, "prompt": "word7", "word": "word7"}))]
    assert "1 example(s) to dispatch again were saved by an older version" in caplog.text
