"""How `rl` splits the machine's cores between vLLM and the trainer."""

from prime_rl.rl.config import DeploymentConfig
from prime_rl.rl.launcher import placement


def test_vllm_cpu_and_trainer_get_separate_cores_by_default():
    p = placement(DeploymentConfig(), [0, 1], cpu_build=True)
    assert (p.vllm_omp_cpus, p.trainer_cpus, p.trainer_threads) == ([0], [1], 1)
    assert p.inference_cpus is None  # the API server is not pinned, only vLLM's compute threads
    p = placement(DeploymentConfig(trainer_ranks=2), list(range(8)), cpu_build=True)
    assert (p.vllm_omp_cpus, p.trainer_cpus, p.trainer_threads) == ([0, 1, 2, 3], [4, 5, 6, 7], 2)


def test_explicit_cores_win_and_cuda_builds_are_not_split():
    p = placement(DeploymentConfig(inference_cpus=[1], trainer_cpus=[0], trainer_threads=3), [0, 1], True)
    assert (p.inference_cpus, p.vllm_omp_cpus, p.trainer_cpus, p.trainer_threads) == ([1], [1], [0], 3)
    p = placement(DeploymentConfig(), list(range(4)), cpu_build=False)
    assert (p.inference_cpus, p.vllm_omp_cpus, p.trainer_cpus, p.trainer_threads) == (None, None, None, 4)
    p = placement(DeploymentConfig(), [0], cpu_build=True)  # one core: everything shares it
    assert (p.vllm_omp_cpus, p.trainer_cpus, p.trainer_threads) == (None, None, 1)
