"""The adaptive async level: down one at once below the target ESS, up one after `raise_after`
calm steps, within [min_level, max_async_level]; the trainer publishes the ESS it is driven by."""

from prime_rl.orchestrator.config import AdaptiveAsyncConfig
from prime_rl.orchestrator.loop.staleness import AsyncLevel, adapt
from prime_rl.runtime.layout import read_trainer_stats, step_dir


def levels(observations, config, start=3, max_level=3):
    state, out = AsyncLevel(start), []
    for ess in observations:
        state = adapt(state, ess, config, max_level)
        out.append(state.level)
    return out


def test_the_level_falls_below_the_target_and_rises_after_calm_steps():
    config = AdaptiveAsyncConfig(enabled=True, target_ess=0.99, margin=0.002, raise_after=2, min_level=1)
    obs = [0.98, 0.97, 0.96, 0.995, 0.995, 0.991, 0.995, 0.995, 0.995, 0.995, None, 0.995, 0.995, 0.995]
    # 0.991 is above the target but within the margin: it holds the level and resets the count.
    assert levels(obs, config) == [2, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3]


def test_no_observation_changes_nothing():
    config = AdaptiveAsyncConfig(enabled=True)
    assert adapt(AsyncLevel(2, 1, 0.5), None, config, 4) == AsyncLevel(2, 1, 0.5)


def test_the_trainer_publishes_its_stats_with_the_weights(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from prime_rl.trainer.parallel.dist import World
    from prime_rl.trainer.weights.publish import Publisher

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    publisher = Publisher(tmp_path, str(tiny_model), World(), keep=2)
    publisher.publish(model, 1, {"is_ratio_ess": 0.97, "mismatch_kl": 0.01})
    publisher.publish(model, 2)
    publisher.close()
    root = tmp_path / "weights"
    assert read_trainer_stats(root, 1) == {"is_ratio_ess": 0.97, "mismatch_kl": 0.01}
    assert step_dir(root, 2).exists() and read_trainer_stats(root, 2) is None
