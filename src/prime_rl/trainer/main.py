"""`uv run trainer @ trainer.toml`; several ranks: `uv run python -m prime_rl.trainer.parallel.torchrun
--nproc-per-node N -m prime_rl.trainer.main @ trainer.toml`.

RL's wiring of the trainers' one loop (`trainer/loop.py`): its micro-batches come from the
orchestrator (`data.StepReceiver`), and after each step it publishes the weights of step + 1 (files
or the collective broadcast) and exports tokens when configured.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from prime_rl.config import parse_config
from prime_rl.runtime import activity, secret
from prime_rl.runtime.layout import refusal_path
from prime_rl.runtime.logging_setup import setup_logging
from prime_rl.runtime.shutdown import Stopped, exit_stopped, take_signals
from prime_rl.trainer.config import TrainerConfig, contract_side
from prime_rl.trainer.data import StepReceiver, share_with_cp_group
from prime_rl.trainer.loop import Steps, metrics_log, resume, train_loop
from prime_rl.trainer.losses import LossFn
from prime_rl.trainer.memory import keep_freed_memory
from prime_rl.trainer.parallel.dist import World, init_world, init_world_or_exit, patient, run_rank
from prime_rl.trainer.preflight import check_trainer
from prime_rl.trainer.rl.trainer import Trainer
from prime_rl.trainer.run import NEEDS_USER, USER_ERRORS
from prime_rl.trainer.weights.checkpoint import Checkpointer, checkpoint_root
from prime_rl.trainer.weights.publish import Publisher
from prime_rl.transport.config import resolve_run_id
from prime_rl.transport.endpoints import make_receiver, transport_dir
from prime_rl.transport.messages import MicroBatch
from prime_rl.transport.zmq_transport import rank_address

log = logging.getLogger("prime_rl.trainer")


def step_line_extras(metrics: dict[str, float]) -> str:
    """The clip's share of the loss tokens, the critic's and the KL controller's figures for the
    step's log line, when they exist. The clip's share is shown because, in an async run, it is
    how much the ratio to the older sampler holds the step back: a share that stays above a few
    percent means each update moves the policy far (docs/algorithms.md)."""
    parts = []
    clipped = [metrics[k] for k in ("clipped_low/all/mean", "clipped_high/all/mean") if k in metrics]
    if clipped:
        parts.append(f"clipped {100 * sum(clipped):.1f}%")
    if "critic/value_loss/all/mean" in metrics:
        parts.append(f"value_loss {metrics['critic/value_loss/all/mean']:.4f}")
        parts.append(f"explained_var {metrics.get('critic/explained_variance', float('nan')):.3f}")
        if not metrics.get("critic/policy_trained", 1.0):
            parts.append("critic warm-up")
    if "kl_reward/beta" in metrics:
        parts.append(f"kl {metrics['kl_reward/kl_per_sample']:.4f} beta {metrics['kl_reward/beta']:.4f}")
    return " | " + " | ".join(parts) if parts else ""


def transport_source(config: TrainerConfig, output_dir: Path) -> str:
    """Where the first rank's micro-batches come from, for the line that says the trainer waits."""
    if config.transport.type == "zmq":
        return rank_address(config.transport, 0, resolve_run_id(config.transport, output_dir))
    return str(transport_dir(config.transport, output_dir))


TRAINER_STATS_OF = {"is_ratio_ess": "is_ratio/all/ess", "mismatch_kl": "mismatch_kl/all/mean"}
"""What a published step carries for the orchestrator (`layout.TRAINER_STATS`): name -> step metric."""


def step_line(step: int, metrics: dict[str, float]) -> str:
    """The trainer's line for a step."""
    if not metrics["loss_tokens"]:
        return (
            f"step {step} | no samples: every rollout of the step was filtered or failed, nothing trained | "
            f"{metrics['time/step']:.1f}s (wait for data {metrics['time/wait_for_data']:.1f}s)"
        )
    return (
        f"step {step} | loss {metrics['loss']:.4f} | entropy {metrics.get('entropy/all/mean', float('nan')):.3f} | "
        f"mismatch_kl {metrics.get('mismatch_kl/all/mean', float('nan')):.2e} | grad_norm {metrics['grad_norm']:.3f} | "
        f"{metrics['throughput/tokens_per_s']:.0f} tok/s | {metrics['time/step']:.1f}s (wait for data "
        f"{metrics['time/wait_for_data']:.1f}s, train {metrics['time/train']:.1f}s){step_line_extras(metrics)}"
    )


def receive(config: TrainerConfig, world: World, output_dir: Path, start: int) -> StepReceiver | None:
    """This rank's micro-batches from the orchestrator; None on a cp peer (its group's first rank
    shares them: the orchestrator sends to data-parallel ranks)."""
    if world.cp_rank != 0:
        return None
    run_id = resolve_run_id(config.transport, output_dir)
    return StepReceiver(
        make_receiver(
            config.transport, run_id, world.dp_rank, output_dir, start_step=start, seq_len=config.seq_len
        ),
        config.seq_len,
        contract_side(config, world.dp),
        refusal_path(output_dir),
    )


def train(config: TrainerConfig, world: World | None = None, loss_fn: LossFn | None = None) -> None:
    world = world or init_world(config.parallel.cp, config.parallel.ep, config.dist_timeout_s)
    keep_freed_memory(world)
    output_dir = Path(config.output_dir)
    activity.start(f"trainer-rank{world.rank}", "trainer", output_dir)
    # (io: reading a large model or checkpoint is progress, however long it takes)
    activity.doing("loading the model and its checkpoint", io=True)
    trainer = Trainer(config, world, loss_fn)
    checkpointer = Checkpointer(
        checkpoint_root(output_dir),
        world,
        config.ckpt.keep,
        trainer.model,
        trainer.optimizer,
        trainer.scheduler,
        critic=(trainer.critic, trainer.critic_optimizer) if trainer.critic is not None else None,
        state=trainer.extra_state,
    )
    start, state = resume(config, world, checkpointer)
    trainer.load_extra_state(state)
    broadcaster = None
    if config.weight_broadcast.type == "collective":
        from prime_rl.trainer.weights.broadcast import Broadcaster

        broadcaster = Broadcaster(config.weight_broadcast, Path(config.output_dir))
    publisher = Publisher(output_dir, config.model.name, world, config.publish.keep, broadcaster, config.lora)
    receiver = receive(config, world, output_dir, start)
    # Steps after the checkpoint are trained again: their old records would be duplicates.
    metrics = metrics_log(
        world,
        output_dir / "trainer" / "metrics.jsonl",
        start,
        config.wandb,
        config=config.model_dump(mode="json"),
    )
    if metrics is not None:  # (no console marker: `rl` keeps this line in the trainer's log)
        log.info("ready for the orchestrator's micro-batches (%s)", transport_source(config, output_dir))

    def batches(step: int) -> list[MicroBatch]:
        # (cp peers take theirs from their group's first rank, a trainer rank)
        activity.doing(
            f"waiting for the micro-batches of step {step}", "orchestrator" if receiver else "trainer", step
        )
        # A cp peer waits for its leader's data in a collective while the leader waits for the
        # orchestrator (up to transport.timeout_s); the leader's own side waits as usual.
        data_wait_s = config.transport.timeout_s + config.dist_timeout_s if receiver is None else 0.0
        with patient(world, data_wait_s, world.cp_group):
            return share_with_cp_group(receiver.get(step) if receiver else None, world)

    def after(step: int, metrics: dict[str, float], results: list) -> dict[str, float]:
        """Publish the weights of step + 1 (with the stats the orchestrator reads), export tokens."""
        stats = {k: metrics[m] for k, m in TRAINER_STATS_OF.items() if m in metrics}
        activity.doing(f"step {step}: publishing the weights of step {step + 1}", "", step, io=True)
        out = {"time/publish_blocking": publisher.publish(trainer.model, step + 1, stats)}
        out["time/publish_write"] = publisher.last_write_s
        if publisher.last_broadcast is not None:
            out["weights/broadcast"] = publisher.last_broadcast
        if config.export.enabled:
            from prime_rl.trainer.export import export_tokens

            export_tokens(output_dir, step, results, world)
        return out

    steps = Steps(batches, step_line, after, "prime_rl.trainer", "trainer.dist_timeout_s")
    try:
        train_loop(config, world, trainer, checkpointer, start, steps, metrics)
    finally:
        publisher.close()
        if metrics is not None:
            metrics.close()
        if receiver is not None:
            receiver.receiver.close()


FAKE_GPU_HELP = (
    "--fake-gpu [--ranks N]: instead of training, run one step of this config's trainer on a fake GPU\n"
    "(no GPU needed; dp x cp = N ranks, default 8) and report a device mix-up or a host sync in one line."
)


def fake_gpu_flags(argv: list[str]) -> tuple[list[str], bool, int | None]:
    """(the other arguments, --fake-gpu given, --ranks N): the dry run's flags are not config."""
    rest, fake, ranks, i = [], False, None, 0
    while i < len(argv):
        if argv[i] == "--fake-gpu":
            fake = True
        elif argv[i] == "--ranks" and i + 1 < len(argv) and argv[i + 1].isdigit() and int(argv[i + 1]) > 0:
            ranks, i = int(argv[i + 1]), i + 1
        elif argv[i] == "--ranks":
            sys.stderr.write("trainer: error: --ranks takes a positive number of trainer ranks (dp x cp)\n")
            raise SystemExit(2)
        else:
            rest.append(argv[i])
        i += 1
    if ranks is not None and not fake:
        sys.stderr.write(
            "trainer: error: --ranks is for --fake-gpu (torchrun sets the ranks of a real run)\n"
        )
        raise SystemExit(2)
    return rest, fake, ranks


def main(argv: list[str] | None = None) -> None:
    # Ctrl-C or SIGTERM stops the trainer within seconds wherever it waits (the orchestrator's data,
    # the other ranks, a checkpoint), with one line: the first rank's (`prime_rl.runtime.shutdown`).
    setup_logging("trainer")
    take_signals(announce=os.environ.get("RANK", "0") == "0")
    try:
        argv, fake_gpu, ranks = fake_gpu_flags(sys.argv[1:] if argv is None else list(argv))
        config = parse_config(
            TrainerConfig, argv, prog="trainer", check=check_trainer, commands=FAKE_GPU_HELP
        )
        try:  # by hand without one: the run's, from its output folder (`rl` gives its own)
            secret.ensure(config.output_dir)
        except secret.SecretError as e:
            sys.stderr.write(f"trainer: error: {e}\n")
            raise SystemExit(2) from None
        if fake_gpu:
            from prime_rl.trainer.gpu.dry_run import main_dry_run

            return main_dry_run(config, ranks)
        world = init_world_or_exit(config.parallel.cp, "trainer", config.parallel.ep, config.dist_timeout_s)
    except Stopped:  # before the ranks' work (`run_rank` says the line from there on)
        exit_stopped()
    setup_logging(f"trainer[{world.rank}]" if world.distributed else "trainer")
    run_rank(
        world, "trainer", lambda: train(config, world), USER_ERRORS, NEEDS_USER, "trainer.dist_timeout_s"
    )


if __name__ == "__main__":
    main()
