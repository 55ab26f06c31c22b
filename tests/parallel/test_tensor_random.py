"""mgtutor.parallel.tensor_random and the layers that use it: Megatron-LM's two dropout seeds.

The tracker's own tests run in this process; one launch of 2 ranks checks the masks a split
``ParallelGPTLayer`` draws: replicated regions alike on both ranks (and one process's), split
regions not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mgtutor
from mgtutor.parallel.gpt_layer import GPTLayer, ParallelGPTLayer
from mgtutor.parallel.tensor_random import (
    TENSOR_PARALLEL_OFFSET,
    RNGStatesTracker,
    model_parallel_seed,
)

SEED = 3


def _draws(seed: int, n: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def test_fork_draws_from_its_own_state_and_leaves_the_default_alone():
    tracker = RNGStatesTracker(5)
    torch.manual_seed(0)
    want_default = torch.rand(6)
    torch.manual_seed(0)
    with tracker.fork():
        first = torch.rand(3)
    default = torch.rand(6)
    with tracker.fork():
        second = torch.rand(3)
    assert torch.equal(default, want_default)  # the forked draws took nothing from it
    assert torch.equal(torch.cat([first, second]), _draws(5, 6))  # the state carried on


def test_fork_restores_the_default_state_after_an_error():
    tracker = RNGStatesTracker(5)
    torch.manual_seed(0)
    want = torch.rand(2)
    torch.manual_seed(0)
    with pytest.raises(RuntimeError), tracker.fork():
        raise RuntimeError("inside the fork")
    assert torch.equal(torch.rand(2), want)


def test_model_parallel_seed_seeds_the_default_alike_and_the_tracker_per_rank():
    drawn = {}
    for rank in (0, 1):
        tracker = model_parallel_seed(SEED, tp_rank=rank)
        with tracker.fork():
            forked = torch.rand(4)
        drawn[rank] = (torch.rand(4), forked)
    assert torch.equal(drawn[0][0], drawn[1][0])
    assert torch.equal(drawn[0][0], _draws(SEED, 4))
    for rank in (0, 1):
        assert torch.equal(drawn[rank][1], _draws(SEED + TENSOR_PARALLEL_OFFSET + rank, 4))
    assert not torch.equal(drawn[0][1], drawn[1][1])


def test_tracker_refuses_a_device_it_cannot_fork():
    with pytest.raises(ValueError, match="'cpu' or a CUDA device"):
        RNGStatesTracker(0, "meta")


def _masks(default_seed: int, forked_seed: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    layer, x = GPTLayer(8, 2, p=0.5), torch.randn(2, 4, 8)
    torch.manual_seed(default_seed)
    layer.rng, layer.dropout_masks = RNGStatesTracker(forked_seed), []
    layer(x)
    return layer.dropout_masks


def test_gpt_layer_draws_the_attention_mask_forked_and_the_residual_ones_from_the_default():
    base = _masks(1, 10)
    other_fork = _masks(1, 11)
    other_default = _masks(2, 10)
    assert len(base) == 3  # the attention's, then the two residual dropouts'
    assert not torch.equal(base[0], other_fork[0])
    assert all(torch.equal(a, b) for a, b in zip(base[1:], other_fork[1:]))
    assert torch.equal(base[0], other_default[0])
    assert not any(torch.equal(a, b) for a, b in zip(base[1:], other_default[1:]))


def test_gpt_layer_refuses_what_it_cannot_record_or_recompute():
    layer, x = GPTLayer(8, 2, p=0.5, mask="float"), torch.randn(1, 4, 8)
    layer.dropout_masks = []
    with pytest.raises(ValueError, match="mask='bool'"):
        layer(x)
    layer = GPTLayer(8, 2, p=0.5, rng=RNGStatesTracker(0))
    layer.checkpoint_core = True
    with pytest.raises(ValueError, match="checkpoint_core with rng"):
        layer(x)


def _split_masks() -> dict[str, Any]:
    import torch.distributed as dist

    mgtutor.setup(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layer, x = GPTLayer(8, 2, p=0.5), torch.randn(2, 4, 8)
    out = {}
    for sp in (False, True):
        parallel = ParallelGPTLayer(layer, sequence_parallel=sp)
        parallel.rng, parallel.dropout_masks = model_parallel_seed(SEED, tp_rank=rank), []
        parallel(x.chunk(world, dim=1)[rank] if sp else x)
        out["sp" if sp else "tp"] = parallel.dropout_masks
    return out


def test_split_layer_masks_agree_where_replicated_and_differ_where_split():
    ranks = mgtutor.launch(_split_masks, world_size=2, timeout=120).results
    torch.manual_seed(0)
    layer, x = GPTLayer(8, 2, p=0.5), torch.randn(2, 4, 8)
    layer.rng, layer.dropout_masks = model_parallel_seed(SEED, tp_rank=0), []
    layer(x)
    (tp0, tp1), (sp0, sp1) = ((ranks[0][mode], ranks[1][mode]) for mode in ("tp", "sp"))
    assert not torch.equal(tp0[0], tp1[0])  # each rank's heads
    for mine, theirs, one in zip(tp0[1:], tp1[1:], layer.dropout_masks[1:]):
        assert torch.equal(mine, theirs) and torch.equal(mine, one)  # replicated: one process's
    assert not any(torch.equal(a, b) for a, b in zip(sp0, sp1))  # each rank's tokens
