"""step_time: each term against a hand computation, and the ranking at a fixed global batch.

The CPU ranks that check the terms run in tests/experiments/test_step_check.py; the last test
checks the DDP behaviour the "copies" term rests on."""

from __future__ import annotations

from dataclasses import replace

import pytest

import mgtutor
from mgtutor.plan.compute_time import Device, layer_times, logits_times
from mgtutor.plan.machine import H100_SXM_NODE, MEGATRON_2021, TORCH, Hardware, Link
from mgtutor.plan.plan_rules import refused_layouts
from mgtutor.plan.planner import plan
from mgtutor.plan.shape import Transformer
from mgtutor.plan.step_time import ranked, step_time, time_key

GB = 10**9
# Round numbers: 1e12 FLOP/s, no wave rule, 1e12 B/s memory; 100 GB/s inside a node of 2.
DEVICE = Device("round", ceiling={"fp32": 1e12, "mixed": 1e12}, memory_bandwidth=1e12)
ROUND = Hardware("round", DEVICE, Link(100e9), Link(10e9), gpus_per_node=2, memory=GB**2)
SMALL = Transformer(layers=4, hidden=64, heads=4, seq_len=32, micro_batch=2)
NO_OPT = replace(TORCH, optimizer=False)


def _layer(model=SMALL, hw=ROUND, tp=1, **kw):
    return layer_times(model, hw.device, "fp32", tp, **kw)


def test_one_gpu_is_its_layers_and_its_output_layer():
    model = replace(SMALL, vocab=100)
    t = step_time(plan(model, 1, GB, precision="fp32"), ROUND, software=NO_OPT)
    lt = _layer(model)
    lf, lb, loss_f, loss_b = logits_times(model, DEVICE, "fp32")
    assert t.parts["matmul"] == pytest.approx(4 * lt.matmul + lf + lb)
    assert t.parts["memory-bound"] == pytest.approx(4 * lt.memory + loss_f + loss_b)
    assert t.total == pytest.approx(t.parts["matmul"] + t.parts["memory-bound"])
    assert t.tokens_per_gpu_per_s == pytest.approx(64 / t.total)


def test_tp_forward_is_exposed_and_backward_hides_behind_the_weight_gradient():
    # A slow link: each of the 4 all-reduces per layer (2 forward, 2 backward) outlasts the
    # products around it. The backward ones hide up to the column-parallel weight gradients.
    slow = replace(ROUND, intra=Link(1e8))
    p = plan(SMALL, 2, GB, tp=2, precision="fp32")
    call = (2 * 32 * 64 * 4) / 1e8  # a 2-rank ring sends the whole b·s·h float32 buffer
    lt = _layer(tp=2)
    parts = {
        o: step_time(p, slow, software=replace(NO_OPT, tp_overlap=o)).parts["tp"]
        for o in ("none", "backward", "all")
    }
    assert parts["none"] == pytest.approx(4 * 4 * call)
    assert parts["backward"] == pytest.approx(4 * (2 * call + 2 * call - lt.wgrad_first))
    assert parts["all"] == pytest.approx(
        4 * (2 * call - lt.forward_matmul + 2 * call - lt.wgrad_first)
    )
    # Where the link is fast, the backward ones hide entirely and only the forward remain.
    fast = step_time(p, ROUND, software=NO_OPT)
    assert fast.parts["tp"] == pytest.approx(4 * 2 * (2 * 32 * 64 * 4) / 100e9)


def _dp_plan(m):
    return plan(SMALL, 2, GB, dp=2, precision="fp32", micro_batches=m)


def test_gradients_hide_behind_the_last_micro_batch_only():
    # Gradients are reduced once a step, during the last micro-batch's backward: with 8
    # micro-batches and a reduction lasting 3 backwards, 2 stay exposed (not 0, as hiding
    # behind the whole step's 8 backwards would say).
    lt = _layer()
    backward = 4 * (lt.matmul + lt.memory - lt.forward)
    grads = 4 * SMALL.total  # float32, a 2-rank ring sends it all
    slow = replace(ROUND, intra=Link(grads / (3 * backward)))
    buckets = replace(NO_OPT, bucket_bytes=grads // 100, first_bucket_bytes=0)
    t = step_time(_dp_plan(8), slow, software=buckets)
    assert t.parts["dp"] == pytest.approx(2 * backward)
    assert t.hidden == pytest.approx(backward)
    # Nothing is reduced before the first bucket's gradients exist: half the gradients in it,
    # half the last backward hides nothing.
    halves = replace(buckets, first_bucket_bytes=grads // 2)
    assert step_time(_dp_plan(8), slow, software=halves).parts["dp"] == pytest.approx(
        2.5 * backward
    )
    # Megatron-LM's 2021 local DDP reduces after the backward: all 3 exposed.
    late = replace(MEGATRON_2021, optimizer=False, bucket_bytes=grads // 100)
    assert step_time(_dp_plan(8), slow, software=late).parts["dp"] == pytest.approx(3 * backward)
    # One bucket holding every gradient cannot start before the backward ends.
    assert step_time(_dp_plan(8), slow, software=NO_OPT).parts["dp"] == pytest.approx(3 * backward)


def test_the_last_bucket_waits_after_the_backward():
    lt = _layer()
    backward = 4 * (lt.matmul + lt.memory - lt.forward)
    grads = 4 * SMALL.total
    quick = replace(ROUND, intra=Link(grads / (backward / 2)))  # the reduction: half a backward
    sw = replace(NO_OPT, bucket_bytes=grads // 10, first_bucket_bytes=0)
    t = step_time(_dp_plan(1), quick, software=sw)
    assert t.parts["dp"] == pytest.approx(backward / 2 / 10, rel=0.01)


def test_ddp_copies_for_zero_0_and_torch_s_zero_1_unless_bucket_views():
    copying = replace(ROUND, copy=5e9)
    for zero in (0, 1):
        p = plan(SMALL, 2, GB, dp=2, zero=zero, precision="fp32")
        t = step_time(p, copying, software=NO_OPT)
        assert t.parts["copies"] == pytest.approx(2 * 4 * SMALL.total / 5e9)
        viewed = step_time(p, copying, software=replace(NO_OPT, bucket_view=True))
        assert "copies" not in viewed.parts
    zero2 = plan(SMALL, 2, GB, dp=2, zero=2, precision="fp32")
    assert "copies" not in step_time(zero2, copying, software=NO_OPT).parts


def test_zero_1_gathers_parameters_after_the_step_and_zero_3_hides_gathers():
    p1 = plan(SMALL, 2, GB, dp=2, zero=1, precision="fp32")
    gather = 4 * SMALL.total / 2 / 100e9  # all-gather: (n-1)/n of the parameters
    buckets = replace(NO_OPT, bucket_bytes=4 * SMALL.total // 1000, first_bucket_bytes=0)
    t1 = step_time(p1, ROUND, software=buckets)
    assert t1.parts["dp"] == pytest.approx(gather, rel=0.01)
    p3 = plan(SMALL, 2, GB, dp=2, zero=3, precision="fp32", micro_batches=4)
    t3 = step_time(p3, ROUND, software=NO_OPT)
    # Per micro-batch only the first layer's gather (of 4) and the last one's reduce-scatter
    # wait: 4 x (gather + scatter) / 4.
    assert t3.parts["dp"] == pytest.approx(4 * (gather + gather) / 4, rel=0.01)


def test_fsdp_under_a_pipeline_gathers_once_a_step():
    # As torch's pipeline stage and torchtitan run it (plan_rules.fsdp_in_pipeline): the stage
    # stays unsharded through the step, one all-gather before the first forward and one
    # reduce-scatter in the last backward.
    fsdp = plan(SMALL, 4, GB, dp=2, pp=2, zero=3, precision="fp32", micro_batches=4)
    held = 2 * (SMALL.per_layer) * 4  # 2 layers of float32 parameters on the first stage
    dp = {c.name: c for c in fsdp.collectives if c.group == "dp"}
    assert {n: (c.calls, c.sent_bytes) for n, c in dp.items()} == {
        "reduce_scatter": (1, held // 2),
        "all_gather": (1, held // 2),
    }
    t = step_time(fsdp, ROUND, software=NO_OPT)
    once = (held // 2) / 100e9  # dp=2 stays in a node (ranks tp, then dp, then pp)
    # The first of 2 layers' gather waits, and the reduce-scatter (one bucket) after the last
    # backward; gathering per micro-batch would cost 4 x 2 gathers.
    assert t.parts["dp"] == pytest.approx(once / 2 + once)


def test_pipeline_bubble_and_scatter_gather_sends():
    m = 4
    p = plan(SMALL, 2, GB, pp=2, micro_batches=m, precision="fp32")
    t = step_time(p, ROUND, software=NO_OPT)
    busy = t.parts["matmul"] + t.parts["memory-bound"]
    assert t.parts["bubble"] / (busy + t.parts["bubble"]) == pytest.approx(1 / (m + 1))
    assert t.links["pp"] == "intra" and t.parts["pp"] > 0
    # tp=2 x pp=2 on nodes of 2: each GPU sends b·s·h/2 across nodes, then an all-gather.
    p4 = plan(SMALL, 4, GB, tp=2, pp=2, micro_batches=m, precision="fp32")
    sg = step_time(p4, ROUND, software=NO_OPT)
    whole = step_time(p4, ROUND, software=replace(NO_OPT, scatter_gather=False))
    assert sg.parts["pp"] < whole.parts["pp"]
    piece = 2 * 32 * 64 * 4
    assert whole.parts["pp"] - sg.parts["pp"] == pytest.approx(
        (whole.parts["pp"] / (piece / 10e9)) * (piece / 2 / 10e9 - piece / 2 / 100e9), rel=0.01
    )


def test_groups_across_nodes_use_every_nic_up_to_nvlink_and_nvls_all_reduces_faster():
    h = H100_SXM_NODE
    assert h.group_link(8, 8) is h.intra
    assert h.group_link(16, 1).bandwidth == 50e9  # dp over tp=8: one GPU, one NIC per node
    assert h.group_link(16, 4).bandwidth == 200e9
    assert h.group_link(128, 8).bandwidth == 370e9  # 8 NICs' 400 GB/s, NVLink's 370 bounds
    assert h.intra.collective(480e9, 1, "all_reduce", 8) == pytest.approx(1.0)
    assert h.intra.collective(370e9, 1, "all_reduce", 4) == pytest.approx(1.0)
    assert h.intra.collective(370e9, 1, "all_gather", 8) == pytest.approx(1.0)


def test_nvls_peak_only_above_the_size_nccl_tests_212_calls_too_small():
    """NCCL's maintainer: ~480 GB/s is the peak, and '256M is too small to reach' it."""
    link = H100_SXM_NODE.intra
    for message, busbw in ((64 * 2**20, 370e9), (2**28, 370e9), (2**30, 480e9)):
        sent = 2 * 7 / 8 * message  # one GPU's share of an 8-GPU all-reduce, one call
        assert link.collective(sent, 1, "all_reduce", 8) == pytest.approx(sent / busbw)
        # the same bytes in 4 calls: each call a quarter the size
        quarter = 370e9 if message / 4 <= 2**28 else 480e9
        assert link.collective(sent, 4, "all_reduce", 8) == pytest.approx(sent / quarter)


def test_the_optimizer_step_reads_and_writes_the_shard_once():
    p = plan(SMALL, 2, GB, dp=2, zero=1, precision="fp32")
    t = step_time(p, ROUND)
    shard = p.memory["optimizer_state"] / 8  # fp32 Adam: 4 + 4 + 8 bytes per parameter
    assert t.parts["optimizer"] == pytest.approx(shard * (2 * 8 + 4 + 2 * 4) / 1e12)


def test_ranked_at_a_fixed_global_batch():
    gpt7b = Transformer(32, 4096, 32, 4096, 1, vocab=50257)
    timed = ranked(gpt7b, 8, H100_SXM_NODE, global_batch=64, recompute="selective")
    assert timed and {t.tokens for _, t in timed} == {64 * 4096}
    speeds = [t.tokens_per_gpu_per_s for _, t in timed]
    assert speeds == sorted(speeds, reverse=True)
    assert all(p.micro_batches * p.dp == 64 for p, _ in timed)
    # 4 sequences a step: pp=8 runs 4 micro-batches, which torch's Schedule1F1B refuses (and
    # pp=4 at dp=2 runs 2); ranked keeps what the planner plans, GPipe's included.
    few = {p.layout: p for p, _ in ranked(gpt7b, 8, H100_SXM_NODE, global_batch=4,
                                          recompute="selective")}  # fmt: skip
    refused = {name for name, _ in refused_layouts(gpt7b, 8, micro_batches=4)}
    assert refused and not refused & set(few)
    assert few and all(p.micro_batches >= p.pp for p in few.values())
    gpipe = {p.layout for p, _ in ranked(gpt7b, 8, H100_SXM_NODE, global_batch=4,
                                         recompute="selective", schedule="GPipe")}  # fmt: skip
    assert refused <= gpipe
    # Interleaving holds 1 + (p-1)/(p·m) more activations on the first stage.
    inter = {p.layout: p for p, _ in ranked(gpt7b, 8, H100_SXM_NODE, global_batch=64,
                                            recompute="selective", chunks=2)}  # fmt: skip
    plain = {p.layout: p for p, _ in timed}
    layout = "dp=2 (ZeRO-1) x tp=2 x pp=2"
    m = plain[layout].micro_batches
    assert inter[layout].memory["activations"] == pytest.approx(
        plain[layout].memory["activations"] * (1 + 1 / (2 * m)), rel=1e-6
    )
    key = time_key(H100_SXM_NODE)
    a, b = (p for p, _ in timed[:2])
    assert key(a) <= key(b)


def test_step_time_reads_the_model_recompute_and_sp_the_plan_was_made_for() -> None:
    # One source for them: the plan. Recomputing everything adds a forward's products, sequence
    # parallelism splits the operations between them over tp; the old call, model and hardware
    # both passed, is refused with the new one in the message.
    kept = plan(SMALL, 2, GB, tp=2, precision="fp32")
    full = plan(SMALL, 2, GB, tp=2, precision="fp32", recompute="full")
    sp = plan(SMALL, 2, GB, tp=2, precision="fp32", sequence_parallel=True)
    assert (full.model, full.recompute, sp.sequence_parallel) == (SMALL, "full", True)
    assert step_time(full, ROUND).parts["matmul"] > step_time(kept, ROUND).parts["matmul"]
    split = step_time(sp, ROUND).parts["memory-bound"]
    assert split < step_time(kept, ROUND).parts["memory-bound"]
    with pytest.raises(TypeError, match="keeps the model"):
        step_time(kept, SMALL)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the model the plan was made for"):
        step_time(replace(kept, model=None), ROUND)


def _ddp_grads_share_a_bucket(view: bool) -> bool:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    mgtutor.setup()
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
        gradient_as_bucket_view=view,
    )
    for _ in range(2):  # the views are made on the first step; the second step keeps them
        model.zero_grad(set_to_none=False)
        model(torch.ones(2, 8)).sum().backward()
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    return len(storages) == 1


def test_ddp_gradients_are_bucket_views_only_when_asked():
    # step_time's "copies" term: by default each gradient is its own tensor, copied into the
    # bucket and back; with gradient_as_bucket_view=True all four are views into one bucket.
    assert (
        mgtutor.launch(_ddp_grads_share_a_bucket, False, world_size=2, backend="gloo").results
        == [False] * 2
    )
    assert (
        mgtutor.launch(_ddp_grads_share_a_bucket, True, world_size=2, backend="gloo").results
        == [True] * 2
    )


def test_hardware_flops_is_the_rate_of_a_product_that_fills_every_wave():
    # Hardware.flops (read by notebooks 13 and 17): compute only, the rate of a product whose
    # 256 x 128 tiles fill the 132 SMs exactly; one row more takes a second wave (twice the time).
    from mgtutor.plan.compute_time import gemm_seconds

    rate, device = H100_SXM_NODE.flops["mixed"], H100_SXM_NODE.device
    rows, inner, cols = 256 * 12, 16384, 128 * 11
    one_wave = 2 * rows * inner * cols / rate
    assert gemm_seconds(device, "mixed", rows, inner, cols) == pytest.approx(one_wave)
    assert gemm_seconds(device, "mixed", rows + 1, inner, cols) > 1.9 * one_wave
    assert rate < device.peak["mixed"]
