"""Checks of the code a config names (env modules, custom advantage and loss functions), run when a
process starts, before it does any real work: `rl` runs them before it launches vLLM.

Invariant: every check is cheap, at most importing a module and reading a signature: no env is
instantiated, no dataset, tokenizer or weights loaded. Every problem found is one sentence naming the
config key and its value, and all of them together are one `ConfigError` (exit 2, no traceback).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from typing import TYPE_CHECKING, Any

from prime_rl.config import ConfigError

if TYPE_CHECKING:
    from prime_rl.orchestrator.config import OrchestratorConfig
    from prime_rl.rl.config import RLConfig
    from prime_rl.trainer.config import TrainerConfig


def env_module_name(env_id: str) -> str:
    """The module verifiers imports for an env id: dashes as underscores, any 'owner/' prefix dropped.

    The same rule as verifiers' own `env_module_name`, which is not imported here: importing it loads
    the whole of verifiers (seconds), and this check must stay cheap.
    """
    return env_id.replace("-", "_").split("/")[-1]


def env_problem(key: str, env_id: str, args: dict[str, Any]) -> str | None:
    """Why `verifiers.load_environment(env_id, **args)` cannot work, judged by importing its module
    and matching `args` to its signature only. `key` is the env's entry, e.g. 'envs[0]'."""
    where = f"{key}.id = {env_id!r}"
    name = env_module_name(env_id)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a dotted name whose parent package is missing; an empty name
        spec = None
    if spec is None:
        return (
            f"{where}: no module '{name}' (verifiers imports an env id as a module, dashes as "
            "underscores, any 'owner/' prefix dropped); install the env's package or put the folder "
            "holding it on PYTHONPATH"
        )
    try:
        module = importlib.import_module(name)
    except Exception as e:  # the env's own code, or a dependency of it, failed while importing
        return f"{where}: importing module '{name}' raised {type(e).__name__}: {e}"
    load = getattr(module, "load_environment", None)
    if not callable(load):
        if exports_v1_taskset(module):
            return None  # a verifiers.v1 env: its taskset config validates `args` when it loads
        return (
            f"{where}: module '{name}' ({spec.origin}) has no function load_environment (a classic "
            "verifiers env) and exports no verifiers.v1 Taskset in __all__ (a v1 env)"
        )
    try:
        inspect.signature(load).bind(**args)
    except TypeError as e:
        return f"{key}.args = {args!r}: load_environment of env '{env_id}' does not accept them: {e}"
    except ValueError:
        pass  # no signature to inspect (a builtin): the call itself will tell
    return None


def exports_v1_taskset(module) -> bool:
    """Whether a module exports a `verifiers.v1` Taskset or Env subclass in `__all__`. Cheap: a v1
    env module has imported verifiers.v1 already; without it, the answer is no."""
    v1 = sys.modules.get("verifiers.v1")
    if v1 is None:
        return False
    exported = [getattr(module, n, None) for n in getattr(module, "__all__", [])]
    return any(isinstance(o, type) and issubclass(o, v1.Taskset | v1.Env) for o in exported)


def import_path_problem(key: str, import_path: str) -> str | None:
    """Why the function at 'package.module:function' cannot be loaded (None when it can)."""
    from prime_rl.plugins import PluginError, load_function

    try:
        load_function(import_path, key=key)
    except PluginError as e:
        return str(e)
    return None


def plugin_problem(key: str, config: Any) -> str | None:
    """Why the user's function that a plugin section names (`type` = an import path) cannot load."""
    from prime_rl.plugins import is_import_path

    return import_path_problem(f"{key}.type", config.type) if is_import_path(config.type) else None


def orchestrator_problems(config: OrchestratorConfig, prefix: str = "") -> list[str]:
    problems = [env_problem(f"{prefix}envs[{i}]", e.id, e.args) for i, e in enumerate(config.envs)]
    problems += [env_problem(f"{prefix}eval.envs[{i}]", e.id, e.args) for i, e in enumerate(config.eval.envs)]
    advantages = [(f"{prefix}advantage", config.advantage)]
    advantages += [(f"{prefix}envs[{i}].advantage", env.advantage) for i, env in enumerate(config.envs)]
    problems += [plugin_problem(key, advantage) for key, advantage in advantages if advantage is not None]
    if config.teacher is not None and config.teacher.model:
        problems.append(teacher_problem(f"{prefix}teacher.model", config.teacher.model, config.model.name))
    for i, env in enumerate(config.envs):
        if env.reward_model is not None and env.reward_model.path is not None:
            problems.append(
                reward_model_problem(f"{prefix}envs[{i}].reward_model.path", env.reward_model.path)
            )
    return [p for p in problems if p]


def teacher_problem(key: str, teacher: str, student: str) -> str | None:
    """Why a teacher cannot score the student's token ids: a tokenizer that is not the student's."""
    from prime_rl.orchestrator.envs.teacher import tokenizer_mismatch

    why = tokenizer_mismatch(student, teacher)
    return (
        f"{key} = {teacher!r}: {why}; a teacher must share the student's tokenizer, as it reads the student's token ids"
        if why
        else None
    )


def reward_model_problem(key: str, path: str) -> str | None:
    """Why the folder at `path` is not a reward model, from its config.json alone."""
    from prime_rl.model.reward import RewardModelError, check_reward_model_dir

    try:
        check_reward_model_dir(path)
    except RewardModelError as e:
        return f"{key}: {e}"
    return None


def trainer_problems(config: TrainerConfig, prefix: str = "") -> list[str]:
    problems = [
        plugin_problem(f"{prefix}loss", config.loss),
        plugin_problem(f"{prefix}advantage", config.advantage),
    ]
    if config.weight_broadcast.type == "collective" and not config.weight_broadcast.servers and not prefix:
        # (Under rl the servers are filled in from the deployment.)
        problems.append(
            "'weight_broadcast.type' = 'collective' needs 'weight_broadcast.servers', the inference servers' "
            'URLs (e.g. ["http://127.0.0.1:8000"])'
        )
    return [p for p in problems if p]


def _raise(problems: list[str | None]) -> None:
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError(" ".join(p.rstrip(".") + "." for p in problems))


def check_orchestrator(config: OrchestratorConfig) -> None:
    _raise(orchestrator_problems(config))


def check_trainer(config: TrainerConfig) -> None:
    _raise(trainer_problems(config))


def check_rl(config: RLConfig) -> None:
    teacher = config.teacher
    _raise(
        orchestrator_problems(config.orchestrator, "orchestrator.")
        + trainer_problems(config.trainer, "trainer.")
        + ([teacher_problem("teacher.model.name", teacher.model.name, config.model)] if teacher else [])
    )
