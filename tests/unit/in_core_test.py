"""Which `VLLM_CPU_OMP_THREADS_BIND` values name the cores the engine core binds itself to."""

import pytest

from prime_rl.engine.in_core import bound_cores


@pytest.mark.parametrize(
    ("value", "cores"),
    [("1", (1,)), ("0,2", (0, 2)), ("2-3", (2, 3)), ("5,2-4", (2, 3, 4, 5)), (" 1 , 0 ", (0, 1))],
)
def test_a_list_of_cores_is_bound(value, cores):
    assert bound_cores(value) == cores


@pytest.mark.parametrize("value", [None, "", "auto", "nobind", "0|1", "1-", "a,b"])
def test_anything_else_leaves_vllms_worker_process(value):
    assert bound_cores(value) is None
