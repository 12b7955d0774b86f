"""`rl`'s preflight: the inference server's, the orchestrator's and the trainer's checks on their
sections, and the teacher's tokenizer against the policy's, run before `rl` launches anything.

Invariant: the same checks, with the same messages, as each process runs when started by hand, with
keys as `rl`'s config names them ('orchestrator.envs[0]', 'trainer.loss'); all the problems of all
the processes together are one `ConfigError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prime_rl.config import raise_problems
from prime_rl.inference.preflight import inference_problems
from prime_rl.orchestrator.preflight import orchestrator_problems, teacher_problem
from prime_rl.runtime.imports import heavy_imports
from prime_rl.trainer.preflight import trainer_problems

if TYPE_CHECKING:
    from prime_rl.launcher.config import RLConfig


def check_rl(config: RLConfig) -> None:
    from prime_rl.launcher.wiring import served
    from prime_rl.model.local import num_experts

    teacher = config.teacher
    with heavy_imports():  # the envs' modules (and verifiers), the plugins the config names
        problems = (
            inference_problems(
                served(config, num_experts(config.inference.model.name)),
                "inference.",
                lora_key=None if config.inference.lora else "trainer.lora",
                routes_key=None if config.inference.return_routes else "orchestrator.return_routes",
            )
            + orchestrator_problems(config.orchestrator, "orchestrator.")
            + trainer_problems(config.trainer, "trainer.")
            + ([teacher_problem("teacher.model.name", teacher.model.name, config.model)] if teacher else [])
        )
    raise_problems(problems)
