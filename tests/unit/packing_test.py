"""Packing: bounds, whole samples, restarting positions, rank balance and equal micro-batch counts."""

import random

import numpy as np
import pytest

from prime_rl.transport.messages import TrainingSample
from prime_rl.transport.packing import pack, pack_bins


def sample(
    n_prompt: int, n_completion: int, env: str = "e", temperature: float = 1.0, advantage: float = 0.25
) -> TrainingSample:
    return TrainingSample(
        prompt_ids=[1] * n_prompt,
        completion_ids=[2] * n_completion,
        completion_mask=[1] * n_completion,
        completion_logprobs=[-0.5] * n_completion,
        advantage=advantage,
        reward=1.0,
        env_name=env,
        temperature=temperature,
    )


def random_samples(n: int, seed: int = 0) -> list[TrainingSample]:
    rng = random.Random(seed)
    return [sample(rng.randint(5, 60), rng.randint(1, 200), env=rng.choice(["a", "b"])) for _ in range(n)]


def test_micro_batches_respect_seq_len_and_keep_samples_whole():
    samples = random_samples(200)
    per_rank = pack(samples, seq_len=512, num_ranks=1, run_id="r", step=0)
    total = 0
    for mb in per_rank[0]:
        mb.validate(seq_len=512)
        arrays = mb.arrays()
        starts = np.cumsum([0, *mb.sample_lens[:-1]])
        # Positions restart at 0 at every sample boundary and count up inside it.
        for start, n in zip(starts, mb.sample_lens, strict=True):
            assert list(arrays["position_ids"][start : start + n]) == list(range(n))
        total += mb.num_tokens
    assert total == sum(len(s) for s in samples)  # nothing lost, nothing duplicated


def test_first_fit_decreasing_packs_tightly():
    samples = random_samples(300, seed=1)
    bins = pack_bins(samples, seq_len=1024)
    tokens = sum(len(s) for s in samples)
    lower_bound = -(-tokens // 1024)
    assert len(bins) <= lower_bound + 1


def test_ranks_get_equal_counts_and_balanced_tokens():
    samples = random_samples(101, seed=2)
    per_rank = pack(samples, seq_len=256, num_ranks=4, run_id="r", step=3)
    counts = {len(mbs) for mbs in per_rank}
    assert len(counts) == 1
    loads = [sum(mb.num_tokens for mb in mbs) for mbs in per_rank]
    assert max(loads) - min(loads) <= 256
    for rank, mbs in enumerate(per_rank):
        assert all(mb.header.rank == rank and mb.header.step == 3 for mb in mbs)
        assert [mb.index for mb in mbs] == list(range(len(mbs)))


def test_filler_micro_batches_carry_no_loss():
    per_rank = pack([sample(10, 10)], seq_len=64, num_ranks=3, run_id="r", step=0)
    assert [len(mbs) for mbs in per_rank] == [1, 1, 1]
    fillers = [mbs[0] for mbs in per_rank if mbs[0].sample_lens == [1]]
    assert len(fillers) == 2 and all(not mb.arrays()["loss_mask"].any() for mb in fillers)
    # An empty step still sends one (filler) micro-batch to every rank.
    assert [len(mbs) for mbs in pack([], 64, 2, "r", 0)] == [1, 1]


def test_loss_mask_and_logprobs_are_aligned_to_tokens_and_advantages_travel_per_sample():
    mb = pack([sample(3, 2), sample(2, 1, advantage=-1.0)], seq_len=64, num_ranks=1, run_id="r", step=0)[0][0]
    a = mb.arrays()
    assert mb.sample_lens == [5, 3]
    assert list(a["loss_mask"]) == [0, 0, 0, 1, 1, 0, 0, 1]
    assert list(a["logprobs"]) == [0, 0, 0, -0.5, -0.5, 0, 0, -0.5]
    # one field, one meaning: the rollout's scalar advantage per sample; no per-token terms here
    assert mb.advantages == [0.25, -1.0] and "token_advantages" not in a


def test_different_temperatures_never_share_a_micro_batch():
    samples = [sample(5, 5, temperature=1.0), sample(5, 5, temperature=0.7)]
    mbs = pack(samples, seq_len=64, num_ranks=1, run_id="r", step=0)[0]
    assert sorted(mb.temperature for mb in mbs) == [0.7, 1.0]


def test_overlong_sample_is_an_error_naming_the_env():
    with pytest.raises(ValueError, match=r"env 'long'.*seq_len = 16"):
        pack([sample(10, 10, env="long")], seq_len=16, num_ranks=1, run_id="r", step=0)


def routed(s: TrainingSample, layers: int = 3, k: int = 2, experts: int = 300) -> TrainingSample:
    import msgspec

    from prime_rl.transport.messages import ROUTE_DTYPES, route_dtype

    dtype = route_dtype(experts)
    rng = np.random.default_rng(len(s))
    routes = rng.integers(0, experts, size=(len(s), layers, k)).astype(ROUTE_DTYPES[dtype])
    return msgspec.structs.replace(s, routes=routes.tobytes(), route_shape=[layers, k], route_dtype=dtype)


def test_routes_travel_with_their_tokens_through_packing_and_the_wire():
    import msgspec

    from prime_rl.transport.messages import MicroBatch

    samples = [routed(sample(5, 7)), routed(sample(3, 20)), routed(sample(9, 4))]
    mbs = [mb for rank in pack(samples, 64, 2, "r", 0) for mb in rank]
    decoded = [msgspec.msgpack.decode(msgspec.msgpack.encode(mb), type=MicroBatch) for mb in mbs]
    got = {}
    for mb in decoded:
        mb.validate()
        if mb.routes:  # ids above 255 survive: two bytes each with 300 experts
            start = 0
            for n in mb.sample_lens:
                got[n] = mb.arrays()["routes"][start : start + n]
                start += n
    for s in samples:
        np.testing.assert_array_equal(got[len(s)], s.route_array())
    assert max(int(a.max()) for a in got.values()) > 255


def test_samples_packed_together_must_all_carry_routes_or_none():
    with pytest.raises(ValueError, match=r"disagree about routes: 1 of 2 carry them"):
        pack([routed(sample(5, 7)), sample(3, 4)], 64, 1, "r", 0)


def test_routes_of_the_wrong_size_name_the_sample():
    import msgspec

    bad = msgspec.structs.replace(routed(sample(5, 7)), route_shape=[3, 3])
    with pytest.raises(
        ValueError, match=r"env 'e'.* bytes of routes do not fit 12 tokens x route_shape \[3, 3\]"
    ):
        bad.validate()
