"""The orchestrator's preflight: checks of the code its config names (env modules and their
arguments, custom advantage and reward functions, the teacher's tokenizer, reward model folders),
run when it starts, before any real work; `rl` runs them too (`launcher/preflight.py`), before it
launches vLLM.

Invariant: every check is cheap, at most importing a module and reading a signature or a JSON
file: no env is instantiated, no dataset, tokenizer or weights loaded, nothing of the env side or
the loop imported. Every problem found is one sentence naming the config key and its value (secret-
looking values hidden, `config/redact.py`), and all of them together are one `ConfigError` (exit 2,
no traceback).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from prime_rl.config import raise_problems
from prime_rl.config.plugins import load_function, plugin_problem
from prime_rl.config.redact import redact
from prime_rl.environments import env_module_name, exports_v1_taskset
from prime_rl.model.local import tokenizer_mismatch
from prime_rl.model.reward import RewardModelError, check_reward_model_dir
from prime_rl.orchestrator.rewards import CustomReward, unknown_kwargs
from prime_rl.orchestrator.rewards.reward_model import RewardModelReward
from prime_rl.runtime.imports import heavy_imports

if TYPE_CHECKING:
    from prime_rl.orchestrator.config import OrchestratorConfig


def env_problem(key: str, env_id: str, args: dict[str, Any]) -> str | None:
    """Why env `env_id` cannot load with `args` as its taskset config, judged by importing its
    module and validating `args` against the taskset's config class. `key` is the env's entry,
    e.g. 'envs[0]'."""
    where = f"{key}.id = {env_id!r}"
    name = env_module_name(env_id)
    try:
        spec = importlib.util.find_spec(name)
        if spec is None:  # one of verifiers' own tasksets?
            spec = importlib.util.find_spec(f"verifiers.v1.tasksets.{name}")
            name = f"verifiers.v1.tasksets.{name}" if spec is not None else name
    except (ImportError, ValueError):  # a dotted name whose parent package is missing; an empty name
        spec = None
    if spec is None:
        return (
            f"{where}: no module '{name}' (an env id names a module, dashes as underscores, any "
            "'owner/' prefix dropped); install the env's package or put the folder holding it on PYTHONPATH"
        )
    try:
        module = importlib.import_module(name)
    except Exception as e:  # the env's own code, or a dependency of it, failed while importing
        return f"{where}: importing module '{name}' raised {type(e).__name__}: {e}"
    if not exports_v1_taskset(module):
        if callable(getattr(module, "load_environment", None)):
            return (
                f"{where}: module '{name}' ({spec.origin}) is a classic verifiers env (load_environment); "
                "verifiers 0.4 runs v1 envs only: port it to a v1 Taskset (docs/environments.md, "
                "'From a classic env to v1')"
            )
        return f"{where}: module '{name}' ({spec.origin}) exports no verifiers.v1 Taskset in __all__"
    import verifiers.v1 as vf  # imported already: the module exports a v1 Taskset
    from pydantic import ValidationError

    try:
        vf.resolve_env_config({"taskset": {"id": env_id, **args}})
    except ValidationError as e:  # one clause per wrong key, named as in `args`
        why = "; ".join(f"{'.'.join(map(str, err['loc'][1:])) or 'args'}: {err['msg']}" for err in e.errors())
        return (
            f"{key}.args = {redact(args)!r}: the taskset config of env '{env_id}' does not accept them: {why}"
        )
    except Exception as e:
        return (
            f"{key}.args = {redact(args)!r}: the taskset config of env '{env_id}' does not accept them: {e}"
        )
    return None


def teacher_problem(key: str, teacher: str, student: str) -> str | None:
    """Why a teacher cannot score the student's token ids: a tokenizer that is not the student's."""
    why = tokenizer_mismatch(student, teacher)
    return (
        f"{key} = {teacher!r}: {why}; a teacher must share the student's tokenizer, as it reads the student's token ids"
        if why
        else None
    )


def reward_model_problem(key: str, path: str) -> str | None:
    """Why the folder at `path` is not a reward model, from its config.json alone."""
    try:
        check_reward_model_dir(path)
    except RewardModelError as e:
        return f"{key}: {e}"
    return None


def reward_problem(key: str, reward: Any) -> str | None:
    """Why an env's reward function cannot join its rubric: a user's that does not load or does
    not take its `kwargs`, a reward model folder that is not one. `key`: e.g. 'envs[0].rewards[1]'."""
    if isinstance(reward, RewardModelReward):
        return reward_model_problem(f"{key}.path", reward.path) if reward.path is not None else None
    problem = plugin_problem(key, reward)
    if problem or not isinstance(reward, CustomReward):
        return problem
    unknown = unknown_kwargs(load_function(reward.type, f"{key}.type"), reward.kwargs)  # loads: checked above
    return (
        f"{key}.kwargs = {redact(reward.kwargs)!r}: '{reward.type}' takes no argument(s) {unknown}"
        if unknown
        else None
    )


def orchestrator_problems(config: OrchestratorConfig, prefix: str = "") -> list[str]:
    """Every problem of `config`; `prefix` is where it sits in a larger config ('orchestrator.' in rl's)."""
    problems = [env_problem(f"{prefix}envs[{i}]", e.id, e.args) for i, e in enumerate(config.envs)]
    problems += [env_problem(f"{prefix}eval.envs[{i}]", e.id, e.args) for i, e in enumerate(config.eval.envs)]
    advantages = [(f"{prefix}advantage", config.advantage)]
    advantages += [(f"{prefix}envs[{i}].advantage", env.advantage) for i, env in enumerate(config.envs)]
    problems += [plugin_problem(key, advantage) for key, advantage in advantages if advantage is not None]
    if config.teacher is not None and config.teacher.model:
        problems.append(teacher_problem(f"{prefix}teacher.model", config.teacher.model, config.model.name))
    for i, env in enumerate(config.envs):
        problems += [reward_problem(f"{prefix}envs[{i}].rewards[{j}]", r) for j, r in enumerate(env.rewards)]
    return [p for p in problems if p]


def check_orchestrator(config: OrchestratorConfig) -> None:
    with heavy_imports():  # the envs' modules (and verifiers), the plugins the config names
        problems = orchestrator_problems(config)
    raise_problems(problems)
