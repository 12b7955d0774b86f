"""Load verifiers v1 environments, with their tasks as the example streams the loop dispatches.

Invariant: an env that cannot be loaded, or has no tasks, is an `EnvError` naming the env and its
config key; nothing else of a bad env reaches the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic

from prime_rl.environments import EnvError
from prime_rl.orchestrator.envs.env_rewards import make_scorer
from prime_rl.orchestrator.envs.reward_model import RewardModels
from prime_rl.orchestrator.envs.rewards import RewardRunner
from prime_rl.orchestrator.envs.scoring import Scorer
from prime_rl.orchestrator.envs.v1_env import V1Env, default_runner, load_v1_env
from prime_rl.orchestrator.envs_config import EnvConfig, EvalEnvConfig
from prime_rl.orchestrator.messages import ConfigT, EnvView


@dataclass
class LoadedEnv(Generic[ConfigT]):
    """A loaded env, training (`LoadedEnv[EnvConfig]`) or eval (`LoadedEnv[EvalEnvConfig]`): the
    verifiers env that runs its rollouts, with its config and its tasks as the loop streams them."""

    config: ConfigT
    vf_env: Any
    examples: Any

    @property
    def name(self) -> str:
        return self.config.resolved_name

    @property
    def group_scoring(self) -> bool:
        """Whether the rubric scores the group together (then one `run_group` call per group)."""
        return bool(getattr(self.vf_env, "requires_group_rollouts", False))

    def view(self) -> EnvView[ConfigT]:
        """What the loop sees of it: everything but the verifiers env, which stays on this side."""
        return EnvView(self.config, self.examples, self.group_scoring)


def load_any_env(env_id: str, args: dict[str, Any], sandbox=None) -> V1Env:
    """The v1 env `env_id` with `args` as its taskset config, its tools run in `sandbox`."""
    try:
        return load_v1_env(env_id, args, sandbox)
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(f"env '{env_id}' could not be loaded: {type(e).__name__}: {e}") from None


def own_hooks(task) -> set[str]:
    """The names of a task's own rewards and metrics."""
    return {fn.__name__ for kind in ("reward", "metric") for fn in task.hooks(kind)}


def load_env(
    config: EnvConfig,
    rewards: RewardRunner | None = None,
    reward_models: RewardModels | None = None,
    key: str = "envs[0]",
    score: bool = True,
) -> LoadedEnv[EnvConfig]:
    """`key` names the env's config entry in errors, e.g. 'envs[1]'. Without `score`, only for its
    tasks: no reward model is loaded (the env workers score), while the other reward functions are
    built, so that it tells group scoring as the workers' does."""
    vf_env = load_any_env(config.id, config.args, config.sandbox)
    models = (reward_models or RewardModels()) if score else None
    try:
        vf_env.use(
            make_scorer(
                config.rewards,
                f"{key}.rewards",
                rewards or default_runner(),
                models,
                own_hooks(vf_env.first),
            )
        )
    except EnvError as e:
        raise EnvError(f"env '{config.id}': {e}") from None
    return LoadedEnv(config, vf_env, vf_env.examples())


def load_eval_env(config: EvalEnvConfig, rewards: RewardRunner | None = None) -> LoadedEnv[EvalEnvConfig]:
    vf_env = load_any_env(config.id, config.args, config.sandbox)
    vf_env.use(Scorer(rewards or default_runner()))
    return LoadedEnv(config, vf_env, vf_env.examples(config.num_examples))
