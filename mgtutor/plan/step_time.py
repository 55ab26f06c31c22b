"""A clock for the planner: the predicted time of one training step of a layout, term by term.

:func:`step_time` takes a :class:`~mgtutor.plan.planner.Plan` (what one GPU holds and sends), the
model's shape, a :class:`~mgtutor.plan.machine.Hardware` and a
:class:`~mgtutor.plan.machine.Software` (what the training code overlaps), and returns a
:class:`~mgtutor.plan.machine.StepTime`: the seconds of the stage that finishes last, by part.
:func:`ranked` sorts every layout that fits by it, at a fixed global batch. The assumptions:

* Compute: each matrix product at its sharded shape and each memory-bound operation, per layer
  per micro-batch (:mod:`~mgtutor.plan.compute_time`); recomputation runs in the backward.
* A collective: calls x latency + the bytes one GPU sends / the link's bus bandwidth (the
  planner's bytes carry a ring's 2(n-1)/n or (n-1)/n, as nccl-tests' busbw does). A group
  inside a node uses NVLink; a group spanning nodes with k GPUs on each node gets
  min(NVLink, k NICs): NCCL's rings cross each node once per channel, one NIC per channel
  (nccl-tests#119: 8 A100s with 4 HDR NICs reached 96 GB/s all-reduce busbw, the 4 NICs' 100 of
  line rate). Ranks are numbered tp fastest, then dp, then pp (Megatron-LM, torchtitan).
* Tensor parallelism: forward collectives sit between the products that need them, on the
  critical path; a backward all-reduce of a column-parallel linear's input gradient runs while
  that linear's weight gradient is computed, hidden up to that product's time (Megatron-LM's
  ``LinearWithGradAccumulationAndAsyncCommunication`` with CUDA_DEVICE_MAX_CONNECTIONS=1;
  notebook 13 shows the overlap). ``Software.tp_overlap`` says which a code does.
* The pipeline: :func:`~mgtutor.plan.pipeline_schedule.simulate` plays the schedule with each
  stage's seconds per micro-batch (the last stage adds the output layer and loss) and each
  send's; "bubble" is what the last stage to finish idles without sends, "pp" what sends add.
  A send carries b·s·h/t per GPU, all-gathered over the tensor-parallel group on arrival
  (Megatron-LM's scatter/gather, Narayanan et al. 2021 section 4.1), or b·s·h without it.
* Data parallelism: gradients are reduced once per step, during the last micro-batch's backward
  (``no_sync`` before it) from its first bucket on, so that backward alone hides them, and the
  last bucket not at all
  (Li et al., "PyTorch Distributed", VLDB 2020, section 3.2.3); Megatron-LM's 2021 local DDP
  reduces after the backward. ZeRO-2 reduce-scatters each micro-batch behind its backward;
  ZeRO-1/2 all-gather the parameters after the optimizer step. ZeRO-3 gathers each layer
  behind the previous one's compute, forward and backward, and reduce-scatters behind the
  backward; under a pipeline FSDP keeps the stage unsharded for the step: one gather before
  the first forward, one reduce-scatter in the last backward (torchtitan's
  ``reshard_after_forward=False`` under PP; torch's pipeline stage).
* DDP's bucket copies (ZeRO-0, and torch's ZeRO-1, which runs DDP's reducer): unless gradients
  stay bucket views, each is copied into its bucket and back (torch's ``reducer.hpp``).
* The optimizer step: the shard's state, gradients and parameters, read and written once at the
  memory bandwidth.

Left out: kernel launch and Python overhead, data loading, a ring's latency growing with its
size (no GPU latency is quoted), congestion between groups sharing a link, stragglers.
:mod:`mgtutor.experiments.step_check` checks the terms on CPU ranks it runs.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mgtutor.plan.activation_plan import ELEMENT_BYTES
from mgtutor.plan.compute_time import compute_flops, layer_times, logits_times
from mgtutor.plan.machine import TORCH, Hardware, Link, Software, StepTime
from mgtutor.plan.pipeline_schedule import simulate
from mgtutor.plan.plan_rules import candidate_layouts
from mgtutor.plan.planner import BYTES_PER_PARAMETER, Plan, plan
from mgtutor.plan.shape import Transformer

if TYPE_CHECKING:
    from mgtutor.plan.activation_plan import Recompute

#: The machines, software and a step's parts live in :mod:`mgtutor.plan.machine`; this module
#: predicts with them.
__all__ = ["ranked", "step_time", "time_key"]


def _split(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def _tp_seconds(plan: Plan, link: Link, layers: int, recompute: Recompute) -> tuple[float, ...]:
    """Seconds of one layer's TP collectives per micro-batch: (forward, backward, recompute).

    Forward: 2 all-reduces, or 2 all-gathers and 2 reduce-scatters with sequence parallelism;
    full recomputation runs those again; the rest of the plan's calls are backward. ``layers``:
    the layers per stage the planner counted calls for."""
    forward = backward = again = 0.0
    for c in plan.collectives:
        if c.group != "tp":
            continue
        per = c.calls / (layers * plan.micro_batches)
        call = link.collective(c.sent_bytes / c.calls, 1, c.name, c.size)
        rerun = 2 if recompute == "full" else 0
        forward += 2 * call
        again += rerun * call
        backward += (per - 2 - rerun) * call
    return forward, backward, again


def step_time(
    plan: Plan,
    hardware: Hardware,
    *,
    chunks: int = 1,
    software: Software = TORCH,
    precision: str | None = None,
) -> StepTime:
    """The predicted time of one optimizer step of ``plan`` on ``hardware``, split into parts.

    The model, its recomputation and sequence parallelism are the plan's own (``plan.model``,
    ``plan.recompute``, ``plan.sequence_parallel``): what the planner was told.

    Args:
        plan: a layout from :func:`~mgtutor.plan.planner.plan` (its ``micro_batches``, and its
            ``schedule`` where the planner has one).
        hardware: the machine.
        chunks: model chunks per GPU (v > 1: the interleaved schedule).
        software: what the code overlaps (:class:`~mgtutor.plan.machine.Software`).
        precision: the products' key in the device's ceilings ("fp8"), if not the plan's.

    Returns:
        The :class:`~mgtutor.plan.machine.StepTime` of the stage that finishes last.

    Raises:
        TypeError: ``hardware`` is not a :class:`~mgtutor.plan.machine.Hardware` (the old call
            ``step_time(plan, model, hardware, recompute=...)``: the plan keeps both now).
        ValueError: a plan without its model (not made by ``plan()``), or LocalSGD or DiLoCo
            (``plan.method``): their sync, after every H-th step (overlapped with the next
            inner steps under Streaming DiLoCo), is not modelled.
    """
    if not isinstance(hardware, Hardware):
        raise TypeError(
            f"step_time(plan, hardware): got {type(hardware).__name__} for hardware. The plan "
            "keeps the model it was made for and its recompute (plan.model, plan.recompute): "
            "pass the Hardware second, and no model or recompute"
        )
    model = plan.model
    if model is None:
        raise ValueError(
            "step_time needs the model the plan was made for: make the plan with plan(model, ...)"
        )
    recompute = plan.recompute
    if plan.method != "ddp":
        raise ValueError(
            f"step_time models DDP and ZeRO, which sync every step; {plan.layout} syncs every "
            f"{plan.sync_every} steps after the optimizer step (Streaming DiLoCo overlaps it "
            "with inner steps), which it does not model"
        )
    p, t, d, m = plan.pp, plan.tp, plan.dp, plan.micro_batches
    gpus, node, overlap = p * t * d, hardware.gpus_per_node, hardware.overlap
    tokens = model.micro_batch * model.seq_len * m * d
    spans = {"tp": t, "dp": t * d, "pp": gpus}
    links = {
        "tp": hardware.group_link(t, t),
        "dp": hardware.group_link(t * d, max(1, min(d, node // t))),
        "pp": hardware.group_link(gpus, 1),
    }
    sp = plan.sequence_parallel and t > 1
    # The products' precision: float32 gradients ("mixed_fp32_grads") change the bytes reduced,
    # not the 16-bit products.
    products = precision or ("mixed" if plan.precision == "mixed_fp32_grads" else plan.precision)
    lt = layer_times(
        model, hardware.device, products, t, sequence_parallel=sp,
        recompute=recompute, attention=software.attention, dropout=software.dropout,
    )  # fmt: skip
    lf, lb, loss_f, loss_b = logits_times(model, hardware.device, products, t)
    tp_f, tp_b, tp_rc = _tp_seconds(plan, links["tp"], math.ceil(model.layers / p), recompute)
    window_b = lt.wgrad_first + (lt.dgrad_first if sp else 0.0)
    window_b = overlap * window_b if software.tp_overlap in ("backward", "all") else 0.0
    window_f = overlap * lt.forward_matmul if software.tp_overlap == "all" else 0.0
    window_rc = overlap * lt.recompute_matmul if software.tp_overlap == "all" else 0.0
    exposed = {"f": max(0.0, tp_f - window_f), "b": max(0.0, tp_b - window_b)}
    exposed["rc"] = max(0.0, tp_rc - window_rc)
    tp_hidden = tp_f + tp_b + tp_rc - sum(exposed.values())
    layer_f = lt.forward + exposed["f"]
    layer_b = lt.matmul + lt.memory - lt.forward + lt.recompute_matmul + lt.recompute_memory
    layer_b += exposed["b"] + exposed["rc"]
    layers = _split(model.layers, p)
    forward = [n * layer_f + (lf + loss_f if s == p - 1 else 0.0) for s, n in enumerate(layers)]
    backward = [n * layer_b + (lb + loss_b if s == p - 1 else 0.0) for s, n in enumerate(layers)]

    # Data parallelism: stalls inside each micro-batch (ZeRO-2/3 without a pipeline), and what
    # follows the last backward (the gradient reduction's exposed part, the parameter gather).
    dp = [c for c in plan.collectives if c.group == "dp"]
    seconds = {c.name: links["dp"].collective(c.sent_bytes, c.calls, c.name, c.size) for c in dp}
    buffers = {c.name: c.buffer_bytes for c in dp}
    fsdp_in_pipeline = p > 1 and plan.zero >= 2
    stall_f, stall_b = [0.0] * p, [0.0] * p
    tail_fixed, dp_hidden = 0.0, 0.0
    reduce = seconds.get("all_reduce", seconds.get("reduce_scatter", 0.0))
    reduce_name = "all_reduce" if "all_reduce" in seconds else "reduce_scatter"
    if plan.zero == 3 and not fsdp_in_pipeline and dp:
        late = (layers[0] - 1) / max(layers[0], 1)  # all but the first layer's gather can hide
        gather, scatter = seconds["all_gather"] / (2 * m), seconds["reduce_scatter"] / m
        stall_f = [gather * (1 - late) + max(0.0, (gather - overlap * forward[0]) * late)]
        hideable = gather + scatter - overlap * backward[0]
        stall_b = [scatter * (1 - late) + max(0.0, hideable * late)]
        dp_hidden = m * (2 * gather + scatter - stall_f[0] - stall_b[0])
        reduce = 0.0
    elif plan.zero == 2 and p == 1 and dp:
        per = reduce / m
        last = per * min(1.0, software.bucket_bytes / max(buffers[reduce_name], 1))
        stall_b = [max(per - overlap * backward[0], last) if software.dp_overlap else per]
        dp_hidden = m * (per - stall_b[0])
        reduce = 0.0
    if plan.zero in (1, 2) or fsdp_in_pipeline:
        gather = seconds.get("all_gather", 0.0)
        if fsdp_in_pipeline:  # once, before the first forward, behind it but the first layer's
            late = (layers[0] - 1) / max(layers[0], 1)
            start = gather * (1 - late) + max(0.0, (gather - overlap * forward[0]) * late)
            dp_hidden += gather - start
            tail_fixed += start
        else:
            tail_fixed += gather
    forward = [f + s for f, s in zip(forward, stall_f)]
    backward = [b + s for b, s in zip(backward, stall_b)]
    tails = []
    buffer = max(buffers.get(reduce_name, 1), 1)
    last = reduce * min(1.0, software.bucket_bytes / buffer)
    after_first = 1 - min(1.0, software.first_bucket_bytes / buffer)  # of the last backward
    for s in range(p):
        hide = overlap * backward[s] * after_first if software.dp_overlap else 0.0
        tails.append(tail_fixed + (max(reduce - hide, last) if reduce else 0.0))
    if reduce:
        dp_hidden += reduce - (tails[0] - tail_fixed)

    # The pipeline's sends: b·s·h (/t with scatter/gather or sequence parallelism) per GPU.
    send = 0.0
    if p > 1:
        piece = model.micro_batch * model.seq_len * model.hidden * ELEMENT_BYTES[plan.precision]
        if t > 1 and (software.scatter_gather or sp):
            send = links["pp"].send(piece / t)
            if not sp:  # the pieces are all-gathered on arrival
                send += links["tp"].collective((t - 1) / t * piece, 1, "all_gather", t)
        else:
            send = links["pp"].send(piece)
    schedule = "interleaved" if chunks > 1 else getattr(plan, "schedule", "1F1B")
    ends = simulate(forward, backward, m, send, chunks=chunks, schedule=schedule)
    still = simulate(forward, backward, m, 0.0, chunks=chunks, schedule=schedule)
    r = max(range(p), key=lambda s: ends[s] + tails[s])

    parts = {
        "matmul": m * layers[r] * (lt.matmul + lt.recompute_matmul) + m * (lf + lb) * (r == p - 1),
        "memory-bound": m * layers[r] * (lt.memory + lt.recompute_memory)
        + m * (loss_f + loss_b) * (r == p - 1),
        "tp": m * layers[r] * sum(exposed.values()),
        "pp": ends[r] - still[r],
        "bubble": max(0.0, still[r] - m * (forward[r] + backward[r])),
        "dp": m * (stall_f[r] + stall_b[r]) + tails[r],
    }
    if hardware.copy and d > 1 and plan.zero <= 1 and not software.bucket_view:
        parts["copies"] = 2 * plan.memory["gradients"] / hardware.copy  # into buckets and back
    if software.optimizer and hardware.device.memory_bandwidth:
        b_param, b_grad, b_opt = BYTES_PER_PARAMETER[plan.precision]
        shard = plan.memory["optimizer_state"] / b_opt
        moved = shard * (2 * b_opt + b_grad + 2 * b_param)
        parts["optimizer"] = moved / hardware.device.memory_bandwidth
    names = {g: "intra" if spans[g] <= node else "inter" for g in spans}
    flops = compute_flops(model, tokens, recompute) / gpus
    hidden = m * layers[r] * tp_hidden + dp_hidden
    window = overlap * backward[r] * after_first if software.dp_overlap else 0.0
    details = {"dp_reduce": reduce, "dp_window": window, "dp_last_bucket": last}
    return StepTime(parts, hidden, tokens, gpus, flops, names, stage=r, details=details)


def time_key(hardware: Hardware, **options: Any) -> Any:
    """A sort key for :func:`~mgtutor.plan.planner.layouts`: most tokens/s per GPU first, then
    less memory. ``options`` go to :func:`step_time`."""

    def key(p: Plan) -> tuple[float, int]:
        t = step_time(p, hardware, **options)
        return -t.tokens_per_gpu_per_s, p.total

    return key


def ranked(
    model: Transformer,
    gpus: int,
    hardware: Hardware,
    *,
    global_batch: int,
    recompute: Recompute = "none",
    zero: tuple[int, ...] = (0, 1, 2, 3),
    chunks: int = 1,
    software: Software = TORCH,
    **options: Any,
) -> list[tuple[Plan, StepTime]]:
    """Every layout of ``gpus`` GPUs that torch runs and that fits ``hardware.memory``, each
    training ``global_batch`` sequences a step, fastest first (most tokens/s per GPU).

    A layout runs ``global_batch / (dp x micro_batch)`` micro-batches; one whose dp does not
    divide the batch is left out. With ``chunks`` > 1 (interleaved, m a multiple of p) the
    first stage holds 1 + (p-1)/(p·m) times 1F1B's activations (Korthikanti et al. 2022,
    section 4.2.3, as issue 42 quotes it). ``options`` go to the planner.
    """
    found = []
    for tp, pp, stage in candidate_layouts(model, gpus, zero):
        dp = gpus // (tp * pp)
        m, rest = divmod(global_batch, dp * model.micro_batch)
        if rest or not m or (chunks > 1 and pp > 1 and m % pp):
            continue
        try:
            p = plan(model, gpus, hardware.memory, tp=tp, pp=pp, zero=stage, micro_batches=m,
                     recompute=recompute, **options)  # fmt: skip
        except ValueError:  # torch does not run it: plan_rules.refused_layouts says why
            continue
        v = chunks if pp > 1 else 1
        if v > 1:
            memory = dict(p.memory)
            memory["activations"] = round(memory["activations"] * (1 + (pp - 1) / (pp * m)))
            p = replace(p, memory=memory)
        if p.fits:
            t = step_time(p, hardware, chunks=v, software=software)
            found.append((p, t))
    return sorted(found, key=lambda pt: (-pt[1].tokens_per_gpu_per_s, pt[0].total))
