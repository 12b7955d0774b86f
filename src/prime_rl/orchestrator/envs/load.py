"""Load verifiers environments (classic or v1), with their reward functions and datasets.

Invariant: an env that cannot be loaded, or whose dataset lacks what a rollout needs, is an
`EnvError` naming the env and its config key; nothing else of a bad env reaches the loop.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Generic

from prime_rl.environments import EnvError, env_module_name, load_vf_env
from prime_rl.orchestrator.envs.env_rewards import attach_rewards
from prime_rl.orchestrator.envs.reward_model import RewardModels
from prime_rl.orchestrator.envs.rewards import RewardRunner
from prime_rl.orchestrator.envs.v1_env import is_v1_module, load_v1_env
from prime_rl.orchestrator.envs_config import EnvConfig, EvalEnvConfig
from prime_rl.orchestrator.messages import ConfigT, EnvView

REQUIRED_COLUMNS = ("prompt", "example_id")


def check_columns(dataset, env_id: str, which: str) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in dataset.column_names]
    if missing:
        raise EnvError(
            f"env '{env_id}': its {which} dataset lacks the column(s) {missing} (it has {dataset.column_names}); "
            "a classic verifiers env needs 'prompt' (or 'question') and gets 'example_id' from verifiers"
        )
    if len(dataset) == 0:
        raise EnvError(f"env '{env_id}': its {which} dataset is empty")


@dataclass
class LoadedEnv(Generic[ConfigT]):
    """A loaded env, training (`LoadedEnv[EnvConfig]`) or eval (`LoadedEnv[EvalEnvConfig]`): the
    verifiers env that runs its rollouts, with its config and dataset."""

    config: ConfigT
    vf_env: Any
    dataset: Any

    @property
    def name(self) -> str:
        return self.config.resolved_name

    @property
    def group_scoring(self) -> bool:
        """Whether the rubric scores the group together (then one `run_group` call per group)."""
        return bool(getattr(self.vf_env, "requires_group_rollouts", False))

    def view(self) -> EnvView[ConfigT]:
        """What the loop sees of it: everything but the verifiers env, which stays on this side."""
        return EnvView(self.config, self.dataset, self.group_scoring)


def load_any_env(env_id: str, args: dict[str, Any], rewards: RewardRunner | None = None):
    """A classic verifiers env, or a `verifiers.v1` one (by what its module exports), with its
    reward functions run by `rewards` (classic envs; v1 runs its own scoring, off the loop's hot path
    in its interception machinery)."""
    module = env_module(env_id)
    if module is not None and is_v1_module(module):
        try:
            return load_v1_env(env_id, args)
        except Exception as e:
            raise EnvError(
                f"verifiers.v1 env '{env_id}' could not be loaded: {type(e).__name__}: {e}"
            ) from None
    vf_env = load_vf_env(env_id, args)
    if rewards is not None:
        rewards.install(vf_env)
    return vf_env


def env_module(env_id: str):
    """The module an env id names (as verifiers resolves it), or None if it does not import."""
    try:
        return importlib.import_module(env_module_name(env_id))
    except Exception:
        return None  # the loader says why, with the env's name


def load_env(
    config: EnvConfig,
    rewards: RewardRunner | None = None,
    reward_models: RewardModels | None = None,
    key: str = "envs[0]",
    score: bool = True,
) -> LoadedEnv[EnvConfig]:
    """`key` names the env's config entry in errors, e.g. 'envs[1]'. Without `score`, only for its
    dataset: no reward model is loaded (the env workers score), while the other reward functions
    join the rubric so that it scores groups as the workers' does."""
    vf_env = load_any_env(config.id, config.args, rewards)
    models = (reward_models or RewardModels()) if score else None
    try:
        attach_rewards(vf_env, config.rewards, f"{key}.rewards", rewards, models)
    except EnvError as e:
        raise EnvError(f"env '{config.id}': {e}") from None
    try:
        dataset = vf_env.get_dataset()
    except Exception as e:
        raise EnvError(f"env '{config.id}': its training dataset cannot be built: {e}") from None
    check_columns(dataset, config.id, "training")
    return LoadedEnv(config, vf_env, dataset)


def load_eval_env(config: EvalEnvConfig, rewards: RewardRunner | None = None) -> LoadedEnv[EvalEnvConfig]:
    vf_env = load_any_env(config.id, config.args, rewards)
    try:
        dataset = vf_env.get_eval_dataset(n=config.num_examples)
    except Exception as e:
        raise EnvError(f"eval env '{config.id}': its eval dataset cannot be built: {e}") from None
    check_columns(dataset, config.id, "eval")
    return LoadedEnv(config, vf_env, dataset)


def rollout_input(row: dict[str, Any]) -> dict[str, Any]:
    """The fields verifiers' run_rollout needs from a dataset row."""
    keys = ("prompt", "example_id", "answer", "info", "task")
    return {k: row[k] for k in keys if k in row and row[k] is not None}
