"""Context parallelism: a micro-batch's positions split across cp ranks (gloo, FSDP2) train exactly
like one rank holding it all, alone and combined with data parallelism; bad layouts are one line."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from prime_rl.trainer.config import TrainedModelConfig, TrainerConfig
from prime_rl.trainer.model import ModelLoadError, build_model
from prime_rl.trainer.parallel.context_parallel import shard_micro_batch
from prime_rl.trainer.parallel.dist import World, WorldError, init_world

sys.path.insert(0, str(Path(__file__).parent))
from trainer_grad_test import ranks_cmd, run_worker, run_workers

CPU = torch.device("cpu")

# The tests that share the module fixtures run on one xdist worker, which computes them once (the
# others, the slow checkpoint test among them, go wherever a worker is free).
SHARES_FIXTURES = pytest.mark.xdist_group("context_parallel")


def shards(sample_lens: list[int], cp: int):
    return [shard_micro_batch(sample_lens, cp, r, None, CPU) for r in range(cp)]


@pytest.mark.parametrize("length", [1, 7, 100, 1001])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_positions_and_owned_tokens_are_partitions(length, cp):
    parts = shards([length], cp)
    positions = torch.cat([s.index[s.index < length] for s in parts])
    assert sorted(positions.tolist()) == list(range(length))  # every position on exactly one rank
    sizes = [int((s.index < length).sum()) for s in parts]
    assert max(sizes) - min(sizes) <= 2 and all(len(s.index) == len(parts[0].index) for s in parts)
    owned = torch.stack([s.owned_tokens(CPU) for s in parts]).sum(0)
    assert owned[0] == 0 and (owned[1:] == 1).all()  # token 0 has no prediction; the rest: one owner
    values = np.arange(1, length + 1)  # what the host takes must be what the device takes
    for s in parts:
        assert s.take_on_host(values).tolist() == s.take(torch.from_numpy(values)).tolist()


def attended_pairs(shard) -> list[tuple[int, int]]:
    """(query position, key position) pairs a rank's plan attends (padding: position `length`)."""
    pairs = []
    for seg in shard.attention.segments:
        for i in range(seg.q_len):
            q = int(shard.index[seg.q_start + i])
            pairs += [(q, int(shard.key_positions[k])) for k in seg.keys[: seg.offset + i + 1]]
    return pairs


def test_the_split_balances_causal_attention():
    """Rank r holds an early and a late chunk: the attended (query, key) pairs per rank are equal."""
    for cp in (2, 4):
        work = [sum(s.q_len * s.offset + s.q_len * (s.q_len + 1) // 2 for s in shard.attention.segments)
                for shard in shards([4000], cp)]  # fmt: skip
        assert (
            max(work) / min(work) < 1.01
        )  # a contiguous split would give the last rank 2cp - 1 times the first's


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_the_plans_put_together_are_block_diagonal_causal(cp):
    """Every (query, key) pair of the same sample with key <= query is attended exactly once, on the
    rank that holds the query, and no other pair; padding attends only padding."""
    lens = [3, 5, 1, 4, 1, 9, 2]
    n = sum(lens)
    expected = torch.block_diag(*[torch.ones(k, k).tril() for k in lens]).bool()
    got = torch.zeros(n, n, dtype=torch.int64)
    for shard in shards(lens, cp):
        for q, k in attended_pairs(shard):
            if q < n:
                got[q, k] += 1
            else:
                assert k == n  # padding
    assert torch.equal(got, expected.long())


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("lens", [[7, 1, 30, 2, 1, 17, 40, 3], [600, 1, 900, 700]], ids=["short", "long"])
def test_split_attention_equals_dense_attention_with_gradients(cp, lens):
    """Each rank's packed attention over its plan, with the other ranks' keys handed over as the
    all-to-all would, equals masked dense attention of the whole micro-batch, gradients included:
    short samples (batched, gathered) and long ones (each on its piece of the rows)."""
    from dataclasses import replace

    from prime_rl.trainer.attention import packed_attention

    torch.manual_seed(0)
    n, hq, hkv, d = sum(lens), 4, 2, 8
    q, k, v = (torch.randn(1, h, n, d, requires_grad=True) for h in (hq, hkv, hkv))
    mask = torch.block_diag(*[torch.ones(m, m).tril() for m in lens]).bool()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)[
        0
    ].transpose(0, 1)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    out = torch.zeros(n + 1, hq, d)
    for shard in shards(lens, cp):
        local = shard.index.clamp(max=n - 1)
        kv_full = torch.stack([k[0], v[0]]).permute(2, 0, 1, 3)  # [n, 2, Hkv, D]
        received = torch.as_tensor(shard.key_positions[shard.attention.length :])

        def exchange(k_rows, v_rows, received=received, kv_full=kv_full):
            return kv_full[received, 0], kv_full[received, 1]

        plan = replace(shard.attention, exchange=exchange)
        o, _ = packed_attention(None, q[:, :, local], k[:, :, local], v[:, :, local], position_ids=None,
                                packed_attention=plan)  # fmt: skip
        out = out.index_add(0, shard.index, o[0])  # padding lands on row n
    torch.testing.assert_close(out[:n], ref, rtol=0, atol=1e-6)
    grads = torch.autograd.grad(out[:n].square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def one_rank_steps(tiny_model, tmp_path_factory):
    return run_worker(tiny_model, tmp_path_factory.mktemp("cp") / "one.pt", 1, 0, "steps=3")


@pytest.fixture(scope="module")
def dp2_by_cp2(tiny_model, tmp_path_factory) -> dict[str, dict]:
    """4 ranks (2 replicas of 2 cp ranks), from one launch: 3 steps with 5 and 7 samples per replica
    ("steps"), GAE with a critic's gradients with 7 and 5 ("gae"), and a step of two mini-batches
    against two steps on each replica's halves ("halves")."""
    folder = tmp_path_factory.mktemp("dp2cp2")
    runs = [
        (folder / "steps.pt", 5, "steps=3", "cp=2"),
        (folder / "gae.pt", 7, "gae", "cp=2"),
        (folder / "halves.pt", 5, "halves", "cp=2"),
    ]
    return dict(zip(["steps", "gae", "halves"], run_workers(tiny_model, 4, *runs), strict=True))


def assert_same_training(one: dict, other: dict) -> None:
    moved = max((one["after"][n] - one["before"][n]).abs().max().item() for n in one["after"])
    assert moved > 1e-4  # the steps trained, so equal parameters mean equal updates
    for name, p in one["after"].items():
        torch.testing.assert_close(other["after"][name], p, rtol=1e-5, atol=1e-6, msg=f"{name} differs")
    for a, b in zip(one["metrics"], other["metrics"], strict=True):
        for key in ("loss", "grad_norm", "loss_tokens", "entropy/all/mean", "mismatch_kl/b/max"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), key


@SHARES_FIXTURES
def test_cp2_trains_like_one_rank(tiny_model, tmp_path, one_rank_steps):
    two = run_worker(tiny_model, tmp_path / "cp2.pt", 2, 0, "steps=3", "cp=2")
    assert_same_training(one_rank_steps, two)
    # The group's tokens are counted once (dp would add filler micro-batches to this count).
    assert [m["tokens"] for m in two["metrics"]] == [m["tokens"] for m in one_rank_steps["metrics"]]


@SHARES_FIXTURES
def test_dp2_by_cp2_trains_like_one_rank(one_rank_steps, dp2_by_cp2):
    assert_same_training(one_rank_steps, dp2_by_cp2["steps"])


@SHARES_FIXTURES
def test_two_mini_batches_under_dp2_by_cp2_are_two_steps_on_each_replicas_halves(dp2_by_cp2):
    """`mini_batches = 2`: each mini-batch normalized by its own global count over the 4 ranks, then
    an update; to the bit what two steps on the halves give (a replica's filler micro-batch included)."""
    halves = dp2_by_cp2["halves"]
    assert halves["local_mbs"] >= 2 and halves["metrics"]["optimizer_steps"] == 2
    assert halves["same"]


@SHARES_FIXTURES
def test_critic_estimators_and_metrics_under_dp2_by_cp2(one_rank_gae, dp2_by_cp2):
    """GAE with a critic, KL in the reward and whitening: the values, returns and moments of a
    context-parallel group count each token once, so gradients and metrics equal one rank's."""
    one, four = one_rank_gae, dp2_by_cp2["gae"]
    assert four["global_tokens"] == one["global_tokens"]
    for name, g in one["grads"].items():
        assert g.abs().max() > 0 or "critic" not in name, name
        torch.testing.assert_close(four["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")
    assert set(four["metrics"]) == set(one["metrics"])
    for key, value in one["metrics"].items():
        assert abs(four["metrics"][key] - value) <= 1e-5 * max(1.0, abs(value)), key


def test_ranks_that_cp_does_not_divide_are_an_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(WorldError, match=r"trainer.parallel.cp = 2 does not divide the 3 trainer ranks"):
        init_world(2)


def test_cp_longer_than_the_micro_batch_is_a_config_error():
    with pytest.raises(ValidationError, match=r"parallel.cp = 8 cuts each micro-batch into 16 chunks"):
        TrainerConfig(seq_len=8, parallel={"cp": 8})


def test_a_model_whose_attention_cannot_be_split_names_the_key(tiny_model, tmp_path):
    folder = tmp_path / "sliding"
    folder.mkdir()
    for f in Path(tiny_model).iterdir():
        (folder / f.name).symlink_to(f)
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    (folder / "config.json").unlink()
    config.update(use_sliding_window=True, sliding_window=16, layer_types=["sliding_attention"] * 2)
    (folder / "config.json").write_text(json.dumps(config))
    world = World(rank=0, world_size=2, cp=2)  # checked before anything distributed happens
    with pytest.raises(
        ModelLoadError, match=r"trainer.parallel.cp = 2 for trainer.model.name = .*sliding-window.*use cp = 1"
    ):
        build_model(TrainedModelConfig(name=str(folder)), world)


def test_the_trainer_console_script_says_it_in_one_line(tiny_model):
    trainer = str(Path(sys.executable).parent / "trainer")
    proc = subprocess.run(
        [trainer, "--model.name", str(tiny_model), "--parallel.cp", "2"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "trainer: error: trainer.parallel.cp = 2 does not divide the 1 trainer ranks: "
        "the ranks must be data-parallel replicas of cp ranks each"
    ]


def test_cp2_checkpoints_and_resumes_like_an_uninterrupted_rank(tiny_model, tmp_path):
    """Killed-and-resumed at a checkpoint under cp = 2 (the trainer as users run it: torchrun, the
    filesystem transport, cp rank 0 reading and sharing), the weights after 3 steps equal those of one
    rank trained 3 steps straight; the token export is one file per data-parallel rank."""
    import os

    from safetensors.torch import load_file

    from prime_rl.transport.file_transport import FileSender
    from prime_rl.transport.packing import pack

    sys.path.insert(0, str(Path(__file__).parent))
    from trainer_test import contract, samples

    def run(name: str, ranks: int, cp: int, max_steps: int, feed: range) -> Path:
        data, out = tmp_path / f"{name}-data", tmp_path / name
        sender = FileSender(data)
        for step in feed:
            for mb in pack(samples(step, n=12), 128, 1, name, step, orchestrator=contract())[0]:
                sender.send(mb)
        toml = tmp_path / f"{name}.toml"
        toml.write_text(
            f'output_dir = "{out}"\nmax_steps = {max_steps}\nseq_len = 128\n[model]\nname = "{tiny_model}"\n'
            f"[parallel]\ncp = {cp}\n[optim]\nlr = 1e-3\neps = 1e-3\n[ckpt]\ninterval = 2\nresume_step = -1\n"
            f'[export]\nenabled = true\n[transport]\ntype = "filesystem"\ndir = "{data}"\nrun_id = "{name}"\n'
            "timeout_s = 60\n"
        )
        cmd = [sys.executable, "-m", "prime_rl.trainer.main", "@", str(toml)]
        if ranks > 1:
            cmd = ranks_cmd(ranks, "-m", "prime_rl.trainer.main", "@", str(toml))
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out

    run("cp", 2, 2, 2, range(2))
    resumed = run("cp", 2, 2, 3, range(2, 3))
    straight = run("one", 1, 1, 3, range(3))
    assert sorted(p.name for p in (resumed / "trainer" / "tokens" / "step_2").iterdir()) == [
        "READY",
        "rank_0.jsonl",
    ]
    base = load_file(Path(tiny_model) / "model.safetensors")
    a, b = (load_file(o / "weights" / "step_3" / "model.safetensors") for o in (resumed, straight))
    assert max((b[k] - base[k]).abs().max().item() for k in base) > 1e-3  # it trained
    for name, w in b.items():
        torch.testing.assert_close(a[name], w, rtol=1e-5, atol=1e-6, msg=f"{name} differs")
