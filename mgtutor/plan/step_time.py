"""A clock for the planner: the predicted time of one training step of a layout, term by term.

:func:`step_time` takes a :class:`~mgtutor.plan.planner.Plan` (what one GPU holds and
sends), the model's shape and a :class:`Hardware` (what a GPU computes per second, what each
link carries), and returns a :class:`StepTime`: compute, each group's exposed communication and
the pipeline's bubble, in seconds. :func:`ranked` sorts every layout the planner keeps by that
time. Every assumption is a parameter below, with its source:

* Compute: 6 FLOPs per parameter per token for the matrix products (forward 2, backward 4),
  plus attention's two s x s products, 12·s·h per token per layer; full recomputation runs the
  forward again (8 per parameter), selective recomputation the attention products' forward
  (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", arXiv:2104.04473, section 5.1 and appendix). It runs at the hardware's achieved
  FLOP/s, split evenly over the tensor- and pipeline-parallel ranks.
* A collective: calls x latency + the bytes one GPU sends / the link's bus bandwidth (the
  planner's bytes already carry a ring's 2(n-1)/n or (n-1)/n; nccl-tests' busbw is defined the
  same way, so bandwidths quoted from nccl-tests plug in unchanged). Tensor parallelism crosses
  the fast link while its group fits in a node; data parallelism the slow one once tp x dp
  exceeds a node; pipeline sends cross nodes once the layout spans nodes (ranks numbered tp
  fastest, then dp, then pp, as Megatron-LM and torchtitan place them).
* The pipeline: each micro-batch's compute, TP collectives and stage-to-stage sends are
  stretched by the bubble (p-1)/(v·m + p-1) of the step (v model chunks per GPU: 1 for GPipe
  and 1F1B; Narayanan et al. section 2.2).
* DDP's bucket copies: unless the gradients stay views into the buckets
  (``gradient_as_bucket_view=True``, torch's default False, with ``zero_grad(set_to_none=False)``
  so that the views survive the step), the reducer copies each gradient into its bucket before
  the all-reduce and the bucket back into the gradient after it (torch 2.11-2.15,
  include/torch/csrc/distributed/c10d/reducer.hpp: ``mark_variable_ready_dense``,
  ``copy_bucket_to_grad``): twice the gradient bytes at the hardware's ``copy`` rate, on the
  critical path. Counted where the hardware has a copy rate.
* Overlap: data parallelism's gradient collectives hide behind backward except the last bucket
  (DDP: Li et al., "PyTorch Distributed", VLDB 2020, section 3.2.3); ZeRO-3's all-gathers are
  prefetched behind compute except the first unit's; ZeRO-1/2's parameter all-gather after the
  optimizer step hides nowhere; every tensor-parallel collective is charged as exposed. The
  forward ones are: they sit between the matrix products that need them. The backward ones
  need not be (Megatron-LM all-reduces the input's gradient while it computes the weight's,
  notebook 13): this model leaves that overlap out, so it overstates TP's time. Pipeline
  sends are on the critical path. How much of a collective can hide is the hardware's
  ``overlap`` (1 on GPUs, where NCCL runs on its own CUDA stream; 0 on CPU ranks, whose gloo
  collectives use the cores that compute).

Left out: kernel launch and Python overhead, memory-bound operations (norms, softmax, the
optimizer step), load imbalance between stages (the embedding, the loss), the slowest rank's
noise, and congestion between groups that share a link. :mod:`mgtutor.measure.step_check`
checks the model against CPU ranks it runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mgtutor.plan.planner import Plan, Transformer, layouts

__all__ = [
    "DDP_BUCKET_BYTES",
    "GRAND_TETON_H100",
    "H100_SXM_NODE",
    "Hardware",
    "Link",
    "StepTime",
    "compute_flops",
    "ranked",
    "step_time",
    "time_key",
]

#: The size of DDP's gradient buckets, torch's default ``bucket_cap_mb=25``
#: (torch/nn/parallel/distributed.py); the last bucket reduced is at most this.
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Link:
    """One class of link: bus bandwidth in bytes/s (nccl-tests' busbw), latency per call in s.

    ``p2p_bandwidth`` is a point-to-point send's bytes/s (the bandwidth if None).
    """

    bandwidth: float
    latency: float = 0.0
    p2p_bandwidth: float | None = None
    p2p_latency: float | None = None

    def collective(self, sent_bytes: float, calls: int) -> float:
        """Seconds for ``calls`` collectives sending ``sent_bytes`` in all (one GPU's share)."""
        return calls * self.latency + sent_bytes / self.bandwidth

    def send(self, nbytes: float, calls: int) -> float:
        """Seconds for ``calls`` point-to-point sends of ``nbytes`` in all."""
        bw = self.p2p_bandwidth or self.bandwidth
        latency = self.latency if self.p2p_latency is None else self.p2p_latency
        return calls * latency + nbytes / bw


@dataclass(frozen=True)
class Hardware:
    """A machine as the time model needs it; each figure measured or quoted, never guessed.

    Attributes:
        name: what it is.
        flops: achieved FLOP/s per GPU (or per rank) by precision ("mixed", "fp32", ...).
        intra: the link between GPUs of one node (NVLink; loopback for CPU ranks).
        inter: the link between nodes (InfiniBand).
        gpus_per_node: GPUs (ranks) per node.
        memory: bytes of memory per GPU.
        overlap: the share of an overlappable collective that can hide behind compute.
        source: where each figure comes from.
        copy: bytes/s of a memory-to-memory copy on one GPU (rank), both reading and writing;
            None: not modelled (no figure quoted). DDP copies every gradient into its bucket
            before the all-reduce and back after it (see :func:`step_time`).
    """

    name: str
    flops: dict[str, float]
    intra: Link
    inter: Link
    gpus_per_node: int
    memory: int
    overlap: float = 1.0
    source: str = ""
    copy: float | None = None


#: NVIDIA H100 SXM: 989 TFLOP/s dense bf16 peak (torchtitan's ``get_peak_flops``, from
#: nvidia.com/en-us/data-center/h100), at the 52% of peak Megatron-LM reached per GPU
#: (Narayanan et al., arXiv:2104.04473, abstract; on A100s: an assumption for H100). NVLink: 450
#: GB/s line rate, about 370 GB/s ring busbw after NCCL's protocol overhead (NCCL's maintainer,
#: NVIDIA/nccl-tests#212). Between nodes 400 Gb/s = 50 GB/s per GPU, line rate (an upper
#: bound). No latency is quoted: 0. 80 GB per GPU (device name "NVIDIA H100 80GB HBM3" in the
#: nccl-tests issues).
H100_SXM_NODE = Hardware(
    name="8 x H100 SXM 80GB, NVLink, 400 Gb/s InfiniBand per GPU",
    flops={"mixed": 0.52 * 989e12, "mixed_fp32_grads": 0.52 * 989e12},
    intra=Link(370e9),
    inter=Link(50e9),
    gpus_per_node=8,
    memory=80 * 10**9,
    source="989e12 x 0.52 (torchtitan get_peak_flops; Narayanan et al. 2021); NVLink ring "
    "busbw 370 GB/s (nccl-tests#212); InfiniBand 400 Gb/s per GPU, line rate",
)

#: torchtitan's benchmark machine (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md,
#: commit 31a17bf): Grand Teton hosts of 8 H100s fully connected with NVLink, 96 GB HBM2e,
#: 400 Gb/s RDMA per GPU, 500 W power limit. Same links and rate assumption as H100_SXM_NODE.
GRAND_TETON_H100 = Hardware(
    name="Grand Teton: 8 x H100 96GB (500 W), NVLink, 400 Gb/s RDMA per GPU",
    flops=dict(H100_SXM_NODE.flops),
    intra=Link(370e9),
    inter=Link(50e9),
    gpus_per_node=8,
    memory=96 * 10**9,
    source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md (hardware section); rate "
    "and links as H100_SXM_NODE",
)


@dataclass(frozen=True)
class StepTime:
    """One step's predicted seconds, by part, for the busiest GPU.

    ``parts``: "compute", "tp", "pp" (sends), "bubble", "dp" (the exposed part of data
    parallelism's collectives), and "copies" (DDP's bucket copies) where the hardware has a
    copy rate. ``hidden`` is what overlap hid. ``tokens`` is the tokens one
    step trains over all GPUs.
    """

    parts: dict[str, float]
    hidden: float
    tokens: int
    gpus: int
    flops: float = 0.0
    links: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """Seconds per step: the sum of the parts."""
        return sum(self.parts.values())

    @property
    def tokens_per_gpu_per_s(self) -> float:
        """Tokens per second per GPU (torchtitan's TPS/GPU)."""
        return self.tokens / self.total / self.gpus


def compute_flops(model: Transformer, tokens: int, recompute: str = "none") -> float:
    """FLOPs of forward and backward over ``tokens`` for the whole model (all GPUs together).

    6·N·tokens for the matrix products plus 12·L·s·h·tokens for attention's two s x s products;
    full recomputation runs the layers' forward again (2·(N - V·h) + 4·L·s·h per token; the
    output layer is not recomputed), selective the attention products' forward (4·L·s·h per
    token). With full recomputation and layers of 12h² parameters this is Narayanan et al.'s
    (2021, appendix) 96·B·s·L·h²(1 + s/(6h) + V/(16·L·h)) for B·s tokens.
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    attention = 4 * model.layers * model.seq_len * model.hidden  # forward, per token
    per_token = 6 * model.total + 3 * attention
    if recompute == "full":
        per_token += 2 * (model.total - model.embedding) + attention
    elif recompute == "selective":
        per_token += attention
    return float(per_token) * tokens


def _link(hw: Hardware, group_span: int) -> Link:
    return hw.intra if group_span <= hw.gpus_per_node else hw.inter


def step_time(
    plan: Plan,
    model: Transformer,
    hardware: Hardware,
    *,
    recompute: str = "none",
    chunks: int = 1,
    bucket_bytes: int = DDP_BUCKET_BYTES,
    bucket_view: bool = False,
) -> StepTime:
    """The predicted time of one optimizer step of ``plan`` on ``hardware``, split into parts.

    Args:
        plan: a layout from :func:`~mgtutor.plan.planner.plan`.
        model: the shape the plan was made for.
        hardware: the machine.
        recompute: as given to :func:`~mgtutor.plan.planner.plan` ("none", "selective",
            "full"); it adds compute here.
        chunks: model chunks per GPU of an interleaved pipeline schedule (v); 1 for GPipe/1F1B.
        bucket_bytes: DDP's bucket size; the last bucket's all-reduce cannot hide.
        bucket_view: True where DDP's gradients stay views into its buckets
            (``gradient_as_bucket_view=True`` and ``zero_grad(set_to_none=False)``): nothing is
            copied.

    Returns:
        The :class:`StepTime`.

    Raises:
        KeyError: the hardware has no FLOP/s for the plan's precision.

    Example:
        >>> p = plan(Transformer(32, 4096, 32, 4096), 8, 80 * 10**9, zero=1)
        >>> step_time(p, Transformer(32, 4096, 32, 4096), H100_SXM_NODE).tokens_per_gpu_per_s
    """
    gpus = plan.dp * plan.tp * plan.pp
    tokens = model.micro_batch * model.seq_len * plan.micro_batches * plan.dp
    flops = compute_flops(model, tokens, recompute) / gpus
    compute = flops / hardware.flops[plan.precision]
    links = {
        "tp": _link(hardware, plan.tp),
        "dp": _link(hardware, plan.tp * plan.dp),
        "pp": _link(hardware, gpus),
    }
    tp = pp = 0.0
    dp_overlappable = dp_exposed = last = 0.0
    for c in plan.collectives:
        if c.group == "tp":
            tp += links["tp"].collective(c.sent_bytes, c.calls)
        elif c.group == "pp":
            # Each micro-batch's activation goes forward and its gradient comes back across a
            # stage boundary, once per model chunk; both transfers are on the critical path.
            transfers = 2 * plan.micro_batches * chunks
            pp += links["pp"].send(transfers * c.buffer_bytes, transfers)
        elif plan.zero in (1, 2) and c.name == "all_gather":
            dp_exposed += links["dp"].collective(c.sent_bytes, c.calls)
        else:
            seconds = links["dp"].collective(c.sent_bytes, c.calls)
            dp_overlappable += seconds
            if plan.zero == 3:  # the first unit's gather and the last one's scatter wait
                last += seconds / (c.calls * max(1, math.ceil(model.layers / plan.pp)))
            else:  # DDP's (and ZeRO-1/2's) last bucket is reduced after backward ends
                last = max(last, seconds * min(1.0, bucket_bytes / max(c.buffer_bytes, 1)))
    bubble = (plan.pp - 1) / (chunks * plan.micro_batches + plan.pp - 1)
    busy = compute + tp + pp
    bubble_s = busy * bubble / (1 - bubble)
    # What DP traffic can hide behind: backward (2/3 of a step's compute) for gradients, the
    # whole forward and backward for ZeRO-3's prefetched gathers; scaled by the hardware.
    window = hardware.overlap * compute * (1.0 if plan.zero == 3 else 2 / 3)
    exposed = max(dp_overlappable - window, min(last, dp_overlappable)) if dp_overlappable else 0.0
    parts = {
        "compute": compute,
        "tp": tp,
        "pp": pp,
        "bubble": bubble_s,
        "dp": exposed + dp_exposed,
    }
    if hardware.copy and plan.dp > 1 and plan.zero == 0 and not bucket_view:
        parts["copies"] = 2 * plan.memory["gradients"] / hardware.copy  # into buckets and back
    names = {g: ("intra" if link is hardware.intra else "inter") for g, link in links.items()}
    return StepTime(parts, dp_overlappable - exposed, tokens, gpus, flops, names)


def time_key(model: Transformer, hardware: Hardware, recompute: str = "none") -> Any:
    """A sort key for :func:`~mgtutor.plan.planner.layouts`: fastest first (most tokens/s
    per GPU), then less memory: ``layouts(model, gpus, memory, key=time_key(model, hw))``."""

    def key(p: Plan) -> tuple[float, int]:
        t = step_time(p, model, hardware, recompute=recompute)
        return -t.tokens_per_gpu_per_s, p.total

    return key


def ranked(
    model: Transformer,
    gpus: int,
    hardware: Hardware,
    *,
    recompute: str = "none",
    **options: Any,
) -> list[tuple[Plan, StepTime]]:
    """Every layout :func:`~mgtutor.plan.planner.layouts` keeps (it runs and fits
    ``hardware.memory``), fastest first by predicted step time (most tokens/s per GPU).

    Args:
        model, gpus: as :func:`~mgtutor.plan.planner.layouts`.
        hardware: the machine; its memory per GPU decides what fits.
        recompute: passed to the planner and to :func:`step_time`.
        options: passed to :func:`~mgtutor.plan.planner.layouts` (zero, micro_batches, ...).

    Returns:
        (plan, step time) pairs, highest tokens per second per GPU first.
    """

    key = time_key(model, hardware, recompute)
    plans = layouts(model, gpus, hardware.memory, recompute=recompute, key=key, **options)
    return [(p, step_time(p, model, hardware, recompute=recompute)) for p in plans]
