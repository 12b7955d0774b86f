"""How `rl` splits the machine's cores between vLLM and the trainer."""

from prime_rl.launcher.config import DeploymentConfig
from prime_rl.launcher.placement import placement


def test_vllm_cpu_and_trainer_get_separate_cores_by_default():
    p = placement(DeploymentConfig(), [0, 1], cpu_build=True, max_async_level=1)
    assert (p.vllm_omp_cpus, p.trainer_cpus, p.trainer_threads) == ([0], [1], 1)
    # Overlapping generation and training: the API server and orchestrator keep off the trainer's core.
    assert p.inference_cpus == p.orchestrator_cpus == [0]
    p = placement(DeploymentConfig(trainer_ranks=2), list(range(8)), cpu_build=True, max_async_level=2)
    assert (p.vllm_omp_cpus, p.trainer_cpus, p.trainer_threads) == ([0, 1, 2, 3], [4, 5, 6, 7], 2)
    assert p.orchestrator_cpus == [0, 1, 2, 3]


def test_synchronous_runs_leave_the_api_server_and_orchestrator_free_unless_told():
    p = placement(DeploymentConfig(), [0, 1], cpu_build=True, max_async_level=0)
    assert (p.vllm_omp_cpus, p.trainer_cpus, p.inference_cpus, p.orchestrator_cpus) == ([0], [1], None, None)
    p = placement(DeploymentConfig(pin_orchestrator=True), [0, 1], cpu_build=True, max_async_level=0)
    assert p.inference_cpus == p.orchestrator_cpus == [0]
    p = placement(DeploymentConfig(pin_orchestrator=False), [0, 1], cpu_build=True, max_async_level=1)
    assert (p.vllm_omp_cpus, p.inference_cpus, p.orchestrator_cpus) == ([0], None, None)


def test_explicit_cores_win_and_cuda_builds_are_not_split():
    p = placement(DeploymentConfig(inference_cpus=[1], trainer_cpus=[0], trainer_threads=3), [0, 1], True)
    assert (p.inference_cpus, p.vllm_omp_cpus, p.trainer_cpus, p.trainer_threads) == ([1], [1], [0], 3)
    assert p.orchestrator_cpus == [1]
    p = placement(DeploymentConfig(), list(range(4)), cpu_build=False)
    assert (p.inference_cpus, p.vllm_omp_cpus, p.trainer_cpus, p.trainer_threads) == (None, None, None, 4)
    assert p.orchestrator_cpus is None
    p = placement(DeploymentConfig(inference_cpus=[0, 1]), list(range(4)), cpu_build=False)
    assert (p.inference_cpus, p.vllm_omp_cpus, p.orchestrator_cpus) == ([0, 1], None, [0, 1])
    p = placement(DeploymentConfig(), [0], cpu_build=True)  # one core: everything shares it
    assert (p.vllm_omp_cpus, p.trainer_cpus, p.orchestrator_cpus, p.trainer_threads) == (None, None, None, 1)


def test_two_servers_on_two_cores_take_one_core_each_and_the_trainer_shares_the_second():
    p = placement(DeploymentConfig(inference_servers=2), [0, 1], cpu_build=True, max_async_level=1)
    assert (p.server_omp_cpus, p.server_cpus, p.trainer_cpus) == ([[0], [1]], [[0], [1]], [1])
    assert p.orchestrator_cpus == [0]
    p = placement(DeploymentConfig(inference_servers=2), list(range(8)), cpu_build=True)
    assert (p.server_omp_cpus, p.trainer_cpus) == ([[0, 1], [2, 3]], [4, 5, 6, 7])
    p = placement(DeploymentConfig(inference_servers=3, inference_cpus=[0, 1]), [0, 1, 2], cpu_build=True)
    assert p.server_omp_cpus == [[0], [1], [0]]


def test_in_engine_mode_a_one_thread_trainer_fills_idle_cores_and_the_front_end_takes_its_core():
    """Async on 2 cores: vLLM's compute keeps the inference core (the engine binds it), the front end
    is pinned to the trainer's core, and the trainer's one thread runs wherever a core is idle."""
    engine = DeploymentConfig(inference_mode="engine")
    p = placement(engine, [0, 1], cpu_build=True, max_async_level=1)
    assert (p.vllm_omp_cpus, p.inference_cpus, p.orchestrator_cpus) == ([0], None, [1])
    assert (p.trainer_cpus, p.trainer_threads) == (None, 1)


def test_in_engine_mode_the_split_stays_where_it_was_not_measured_faster_or_was_set():
    engine = DeploymentConfig(inference_mode="engine")
    # Synchronous: generation and training take turns, nothing to fill.
    p = placement(engine, [0, 1], cpu_build=True, max_async_level=0)
    assert (p.trainer_cpus, p.orchestrator_cpus) == ([1], None)
    # A trainer of several threads stays on its cores (a descheduled thread stalls the others).
    p = placement(engine, list(range(4)), cpu_build=True, max_async_level=1)
    assert (p.vllm_omp_cpus, p.trainer_cpus, p.trainer_threads, p.orchestrator_cpus) == (
        [0, 1],
        [2, 3],
        2,
        None,
    )
    p = placement(engine.model_copy(update={"trainer_threads": 2}), [0, 1], cpu_build=True, max_async_level=1)
    assert (p.trainer_cpus, p.orchestrator_cpus) == ([1], None)
    # Cores or pinning given: as told.
    p = placement(
        engine.model_copy(update={"pin_orchestrator": True}), [0, 1], cpu_build=True, max_async_level=1
    )
    assert (p.inference_cpus, p.orchestrator_cpus, p.trainer_cpus) == ([0], [0], [1])
    p = placement(
        engine.model_copy(update={"pin_orchestrator": False}), [0, 1], cpu_build=True, max_async_level=1
    )
    assert (p.orchestrator_cpus, p.trainer_cpus) == (None, [1])
    p = placement(engine.model_copy(update={"trainer_cpus": [1]}), [0, 1], cpu_build=True, max_async_level=1)
    assert (p.orchestrator_cpus, p.trainer_cpus) == (None, [1])
    # Server mode and CUDA builds: unchanged.
    p = placement(DeploymentConfig(), [0, 1], cpu_build=True, max_async_level=1)
    assert (p.orchestrator_cpus, p.trainer_cpus) == ([0], [1])
    p = placement(engine, [0, 1], cpu_build=False, max_async_level=1)
    assert (p.orchestrator_cpus, p.trainer_cpus) == (None, None)
