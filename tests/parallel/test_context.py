"""mgtutor.parallel.context: ring attention on CPU ranks equals full attention, forward and back.

The merge rule, the block kernel, the splits and the work they give each rank are pure
functions, tested in this process. The ring itself needs ranks: one launch of 3 ranks (a ring of
2 cannot tell sending right from sending left) runs every layout and mask, forward and backward,
a probe whose values name their rank, the order of backward's sends and products, Ulysses, and
a ring over a subgroup; the tests below each read their part of its results.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import mgtutor
from mgtutor.parallel import context
from mgtutor.parallel.comms import Comm, record_comms, record_ops

SHAPE = (2, 3, 24, 8)  # batch, heads, sequence, head dimension: 24 divides by 2 x 3 ranks
LAYOUTS = {"contiguous": context.split_contiguous, "zigzag": context.split_zigzag}
WORLD = 3


def _qkv(seed: int = 0, shape: tuple[int, ...] = SHAPE) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4)]


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5


# --- pure functions --------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_lse_is_sdpa_with_the_log_of_its_normalizer(causal: bool) -> None:
    q, k, v, _ = _qkv()
    pos = torch.arange(SHAPE[2]) if causal else None
    out, lse = context.attention_with_lse(q, k, v, pos, pos)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    scores = _scores(q, k)
    if causal:
        scores = scores.masked_fill(torch.ones(24, 24, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(scores, dim=-1))


def test_a_row_that_sees_no_key_gets_zero_and_minus_infinity() -> None:
    q, k, v, _ = _qkv()
    out, lse = context.attention_with_lse(q, k, v, torch.arange(24), torch.arange(24) + 100)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


def test_merging_two_blocks_of_keys_gives_attention_over_both() -> None:
    q, k, v, _ = _qkv()
    q = q * 30  # scores in the hundreds: exp() of them overflows, the merge must not
    first, second = torch.arange(0, 24, 2), torch.arange(1, 24, 2)  # any two disjoint blocks
    out_a, lse_a = context.attention_with_lse(q, k[..., first, :], v[..., first, :])
    out_b, lse_b = context.attention_with_lse(q, k[..., second, :], v[..., second, :])
    out, lse = context.merge_partials(out_a, lse_a, out_b, lse_b)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v))
    assert torch.allclose(lse, torch.logsumexp(_scores(q, k), dim=-1))
    assert not torch.allclose((out_a + out_b) / 2, out)  # the check can fail: averaging does


def test_merging_a_fully_masked_block_changes_nothing_and_two_give_zeros() -> None:
    q, k, v, _ = _qkv()
    out_a, lse_a = context.attention_with_lse(q, k, v)
    nothing = torch.zeros_like(out_a), torch.full_like(lse_a, float("-inf"))
    out, lse = context.merge_partials(out_a, lse_a, *nothing)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
    out, lse = context.merge_partials(*nothing, *nothing)
    assert torch.equal(out, nothing[0]) and bool(torch.isneginf(lse).all())


def test_splits_give_every_position_once_in_the_documented_order() -> None:
    assert [p.tolist() for p in context.split_contiguous(8, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [p.tolist() for p in context.split_zigzag(8, 2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    for split in LAYOUTS.values():
        for world in (1, 2, 3, 4):
            assert sorted(torch.cat(split(48, world)).tolist()) == list(range(48))
    with pytest.raises(ValueError, match="must divide by world_size 4"):
        context.split_contiguous(10, 4)
    with pytest.raises(ValueError, match="2 \\* world_size = 6"):
        context.split_zigzag(9, 3)


def test_zigzag_is_torchs_head_tail_order() -> None:
    module = "torch.distributed.tensor.experimental._context_parallel._load_balancer"
    balancer = pytest.importorskip(
        module, reason=f"torch {torch.__version__} has no context-parallel load balancer"
    )._HeadTailLoadBalancer
    for length, world in ((8, 2), (24, 3), (32, 4)):
        order = balancer(length, world, "cpu")._generate_indices()[0]
        assert order.tolist() == torch.cat(context.split_zigzag(length, world)).tolist()


def _pairs_per_rank(layout: list[torch.Tensor]) -> list[int]:
    """Query-key pairs each rank computes over a whole ring pass, causal."""
    totals = []
    for q_pos in layout:
        rows_cols = [context.needed_block(q_pos, k_pos, causal=True) for k_pos in layout]
        totals.append(sum(len(rows) * len(cols) for rows, cols in rows_cols))
    return totals


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_the_contiguous_split_loads_the_last_rank_and_zigzag_evens_it(world: int) -> None:
    n = 4 * world  # rows per rank: two zig-zag chunks of n / 2
    contiguous = _pairs_per_rank(context.split_contiguous(n * world, world))
    assert contiguous == [n * n * (r + 1) for r in range(world)]  # r + 1 blocks, each whole
    zigzag = _pairs_per_rank(context.split_zigzag(n * world, world))
    c = n // 2
    assert zigzag == [4 * c * c + (world - 1) * 2 * c * c] * world  # own block, then halves
    assert sum(zigzag) == sum(contiguous)  # the same work in all, spread evenly


def test_needed_block_without_a_mask_is_the_whole_block() -> None:
    rows, cols = context.needed_block(torch.arange(4), torch.arange(10, 16), causal=False)
    assert rows.tolist() == [0, 1, 2, 3] and cols.tolist() == list(range(6))
    rows, cols = context.needed_block(torch.arange(4), torch.arange(10, 16), causal=True)
    assert len(rows) == len(cols) == 0


# --- the ring, on 3 ranks --------------------------------------------------------------------


_ORDERED = ("c10d.send", "aten.mm", "aten.bmm")  # the sends and the matrix products


def _planned_order(layout: list[torch.Tensor], rank: int, causal: bool) -> list[str]:
    """What a ring that overlaps runs, step by step: the next block's send posted first (but
    at the last step), then this step's two products (scores, weighted values) if it has work."""
    world, order = len(layout), []
    for step in range(world):
        if step < world - 1:
            order.append("c10d.send")
        rows, _ = context.needed_block(layout[rank], layout[(rank - step) % world], causal)
        order += ["aten.bmm", "aten.bmm"] if len(rows) else []
    return order


def _ring_worker(shape: tuple[int, ...]) -> dict[Any, Any]:
    mgtutor.setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, grad = _qkv(shape=shape)
    results: dict[Any, Any] = {}
    for name, split in LAYOUTS.items():
        for causal in (False, True):
            layout = split(shape[2], world)
            mine = layout[rank]
            local = [t[..., mine, :].clone().requires_grad_() for t in (q, k, v)]
            trace: list[dict] = []
            with FlopCounterMode(display=False) as flops, record_ops(*_ORDERED) as order:
                out = context.ring_attention(*local, layout, causal=causal, trace=trace)
            (out * grad[..., mine, :]).sum().backward()
            results[name, causal] = {
                "rows": mine,
                "out": out.detach(),
                "grads": [t.grad for t in local],
                "flops": flops.get_total_flops(),  # the matmuls that ran
                "order": order,
                "planned order": _planned_order(layout, rank, causal),
                "times": all(
                    step[key] >= 0
                    for step in trace
                    for key in ("compute_s", "wait_s", "compute_cpu_s")
                ),
            }
    # Which block each step merged, read from the values: rank r's values are all r, and
    # attention over a block of constant values returns that constant.
    layout = context.split_contiguous(shape[2], world)
    mine = layout[rank]
    received: list[int] = []

    def recording_merge(*partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        received.append(round(partials[2].flatten()[0].item()))
        return context.merge_partials(*partials)

    tagged = torch.full_like(v[..., mine, :], float(rank))
    context.ring_attention(
        q[..., mine, :], k[..., mine, :], tagged, layout, causal=False, merge=recording_merge
    )
    results["received"] = received
    local = [t[..., mine, :].clone().requires_grad_() for t in (q, k, v)]
    out = context.ring_attention(*local, layout, causal=False)
    with record_ops(*_ORDERED) as order, record_comms() as sent:
        out.sum().backward()
    results["backward"] = {"order": order, "sent": [c.sent for c in sent if c.sent]}
    # Ulysses and the bytes each design sends, recorded as they run.
    with record_comms() as ring_bytes:
        context.ring_attention(*[t[..., mine, :] for t in (q, k, v)], layout, causal=True)
    with record_comms() as ulysses_bytes:
        ulysses = context.ulysses_attention(*[t[..., mine, :] for t in (q, k, v)], layout)
    results["ulysses"] = {"rows": mine, "out": ulysses}
    results["bytes"] = {"ring": _records(ring_bytes), "ulysses": _records(ulysses_bytes)}
    try:
        context.ulysses_attention(*[t[..., :2, mine, :] for t in (q, k, v)], layout)
    except ValueError as error:
        results["two heads"] = str(error)
    # A ring over ranks 1 and 2 only: its neighbours are global ranks, not group ranks.
    pair = dist.new_group([1, 2])
    if rank:
        layout = context.split_zigzag(shape[2], 2)
        mine = layout[rank - 1]
        local = [t[..., mine, :] for t in (q, k, v)]
        results["subgroup"] = {
            "rows": mine,
            "out": context.ring_attention(*local, layout, causal=True, group=pair),
        }
    return results


@functools.lru_cache(maxsize=1)
def _ring_run() -> list[dict[Any, Any]]:
    return mgtutor.launch(_ring_worker, SHAPE, world_size=WORLD, backend="gloo", timeout=60).results


def _full(causal: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    q, k, v, grad = _qkv()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    (out * grad).sum().backward()
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ring_equals_full_attention_forward_and_backward(layout: str, causal: bool) -> None:
    out, grads = _full(causal)
    for rank, result in enumerate(_ring_run()):
        mine = result[layout, causal]
        rows = mine["rows"]
        assert torch.allclose(mine["out"], out[..., rows, :]), (rank, "output")
        for name, got, want in zip("qkv", mine["grads"], grads):
            assert torch.allclose(got, want[..., rows, :]), (rank, f"d{name}")


def test_blocks_arrive_from_the_left_read_from_their_values() -> None:
    # Rank r merges r's block, then r-1's, then r-2's. A ring sending left gives the same
    # outputs without a mask; only the values received tell the direction.
    for rank, result in enumerate(_ring_run()):
        assert result["received"] == [(rank - step) % WORLD for step in range(WORLD)]


def test_forward_sends_the_next_block_before_computing() -> None:
    # Every step posts the next block's send before its own products, with the mask or without,
    # on every rank (steps with no work under the mask compute nothing). A send posted after
    # its step's work, at any step, fails it; when the wait comes is not seen (no operator).
    for result in _ring_run():
        for name in LAYOUTS:
            for causal in (False, True):
                run = result[name, causal]
                assert run["order"] == run["planned order"], (name, causal)


def test_backward_sends_the_next_block_before_computing() -> None:
    # Keys and values leave ahead of each step's work; each block's gradients follow it.
    block = torch.zeros(SHAPE)[..., : SHAPE[2] // WORLD, :].nbytes * 2  # float64 rows
    for result in _ring_run():
        order = result["backward"]["order"]
        assert order.index("c10d.send") < min(
            order.index(m) for m in ("aten.mm", "aten.bmm") if m in order
        )
        assert result["backward"]["sent"] == [2 * block] * (2 * WORLD - 1)


def test_the_flops_that_ran_follow_the_causal_work_of_each_split() -> None:
    batch, heads, length, dim = SHAPE
    n, per_pair = length // WORLD, 4 * dim * heads * batch  # q.k and the weighted sum of v
    contiguous = [r["contiguous", True]["flops"] // per_pair for r in _ring_run()]
    assert contiguous == [n * n * (rank + 1) for rank in range(WORLD)]
    zigzag = [r["zigzag", True]["flops"] // per_pair for r in _ring_run()]
    assert zigzag == [zigzag[0]] * WORLD and sum(zigzag) == sum(contiguous)
    assert [r["zigzag", False]["flops"] // per_pair for r in _ring_run()] == [n * length] * WORLD
    assert all(r["zigzag", True]["times"] for r in _ring_run())


def test_ulysses_equals_full_attention_and_sends_less_than_the_ring() -> None:
    out, _ = _full(causal=True)
    for result in _ring_run():
        assert torch.allclose(result["ulysses"]["out"], out[..., result["ulysses"]["rows"], :])
        assert "divide by 3 ranks" in result["two heads"]
    block = torch.zeros(SHAPE)[..., : SHAPE[2] // WORLD, :].nbytes * 2  # float64 rows
    ring, ulysses = _ring_run()[0]["bytes"]["ring"], _ring_run()[0]["bytes"]["ulysses"]
    assert [(op, sent) for op, sent, _ in ring if sent] == [("c10d.send", 2 * block)] * (WORLD - 1)
    sent = [(op, sent) for op, sent, _ in ulysses]
    assert sent == [("c10d.alltoall_base_", block * (WORLD - 1) // WORLD)] * 4


def test_ring_over_a_subgroup_uses_global_ranks() -> None:
    out, _ = _full(causal=True)
    for result in _ring_run()[1:]:
        assert torch.allclose(result["subgroup"]["out"], out[..., result["subgroup"]["rows"], :])
    assert "subgroup" not in _ring_run()[0]


# --- torch's context_parallel on CPU ranks ---------------------------------------------------


def _records(comms: list[Comm]) -> list[tuple[str, int, int]]:
    return [(c.operator, c.sent, c.received) for c in comms]


def _torch_context_parallel_on_cpu(causal: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mgtutor.setup()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v = _qkv(shape=(1, 2, 8, 4))[:3]
    positions = torch.arange(8).unsqueeze(0)
    # The math backend: the default CPU kernel has no DTensor rule before 2.13, and from 2.13
    # DTensor derives one by tracing it, which takes about a minute here.
    with sdpa_kernel(SDPBackend.MATH):
        full = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        try:
            with context_parallel(mesh, buffers=[q, k, v, positions], buffer_seq_dims=[2, 2, 2, 1]):
                mine = positions[0].clone()
                with record_comms() as sent:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        except (NotImplementedError, RuntimeError, TypeError):
            return {"raised": True}
    return {
        "rows": mine.tolist(),
        "equal": torch.allclose(out, full[..., mine, :]),
        "sent": _records(sent),
        "block": out.nbytes,
    }


def _has_context_parallel() -> bool:
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_context_parallel(), reason="this torch has no context_parallel")
def test_torchs_context_parallel_on_cpu_gathers_k_and_v_for_unmasked_attention() -> None:
    # Notebook 14's point: on CPU ranks torch's context_parallel does not run its ring (that is
    # for CUDA kernels); without a mask DTensor gathers K and V whole (two all-gathers) and the
    # result equals full attention; with the causal mask it fails.
    unmasked = mgtutor.launch(_torch_context_parallel_on_cpu, False, world_size=2, backend="gloo")
    for rank, r in enumerate(unmasked.results):
        assert r["rows"] == context.split_zigzag(8, 2)[rank].tolist()  # head-tail, mask or not
        assert r["equal"]
        # each rank sends its block to the other and receives the other's: its own stays
        gather = ("_c10d_functional.all_gather_into_tensor", r["block"], r["block"])
        assert r["sent"] == [gather, gather]
    causal = mgtutor.launch(_torch_context_parallel_on_cpu, True, world_size=2, backend="gloo")
    assert causal.results == [{"raised": True}] * 2
