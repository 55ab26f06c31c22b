"""Machines and training code as the step-time model reads them: links, GPUs, what overlaps.

:class:`Link`, :class:`Hardware` (a :class:`~mgtutor.plan.compute_time.Device` and its links)
and :class:`Software` (what the training code overlaps) are the inputs of
:func:`mgtutor.plan.step_time.step_time`; :class:`StepTime` its result. Below them, the machines
of the published runs notebook 18 compares with, every figure quoted with its source:

* :data:`A100_SELENE`: a DGX A100 node of NVIDIA's Selene, where Narayanan et al. 2021 ran
  (arXiv:2104.04473, section 5: 8 A100 80GB per node, NVLink and NVSwitch, 8 HDR InfiniBand
  NICs of 200 Gb/s).
* :data:`H100_SXM_NODE`: 8 H100 SXM 80GB, NVLink 4, one 400 Gb/s NIC per GPU.
* :data:`GRAND_TETON_H100`: torchtitan's benchmark hosts (8 H100 96GB HBM2e at 500 W).

and the code of those runs: :data:`MEGATRON_2021` (Megatron-LM at the commit the SC21 scripts
name), :data:`MEGATRON` (its later backward overlap), :data:`TORCHTITAN`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mgtutor.plan.compute_time import Device

__all__ = [
    "A100_SELENE",
    "DDP_BUCKET_BYTES",
    "GRAND_TETON_H100",
    "H100_SXM_NODE",
    "MEGATRON",
    "MEGATRON_2021",
    "TORCH",
    "TORCHTITAN",
    "Hardware",
    "Link",
    "Software",
    "StepTime",
]

#: DDP's gradient bucket, torch's default ``bucket_cap_mb=25`` (torch/nn/parallel/distributed.py).
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Link:
    """One class of link: bus bandwidth in bytes/s (nccl-tests' busbw), latency per call in s.

    ``p2p_bandwidth``/``p2p_latency``: a point-to-point send's (the bus figures if None).
    ``all_reduce_bandwidth``: an all-reduce's busbw over ``all_reduce_group`` GPUs or more, where
    it differs (NVLink SHARP on H100 nodes), for messages larger than ``all_reduce_from`` bytes
    only: below it the peak is not reached and the bus figure applies.
    """

    bandwidth: float
    latency: float = 0.0
    p2p_bandwidth: float | None = None
    p2p_latency: float | None = None
    all_reduce_bandwidth: float | None = None
    all_reduce_group: int = 8
    all_reduce_from: float = 0.0

    def collective(self, sent_bytes: float, calls: float, name: str = "", size: int = 0) -> float:
        """Seconds for ``calls`` collectives sending ``sent_bytes`` in all (one GPU's share)."""
        bw = self.bandwidth
        if name == "all_reduce" and self.all_reduce_bandwidth and size >= self.all_reduce_group:
            message = sent_bytes / max(calls, 1) / (2 * (size - 1) / size)  # one call's buffer
            if message > self.all_reduce_from:
                bw = self.all_reduce_bandwidth
        return calls * self.latency + sent_bytes / bw

    def send(self, nbytes: float, calls: float = 1) -> float:
        """Seconds for ``calls`` point-to-point sends of ``nbytes`` in all."""
        latency = self.latency if self.p2p_latency is None else self.p2p_latency
        return calls * latency + nbytes / (self.p2p_bandwidth or self.bandwidth)


@dataclass(frozen=True)
class Hardware:
    """A machine as the time model needs it; each figure measured or quoted, never guessed.

    Attributes:
        name: what it is.
        device: one GPU's (or CPU rank's) compute.
        intra: the link between GPUs of one node (NVLink; loopback for CPU ranks).
        inter: one GPU's link to other nodes (its NIC).
        gpus_per_node: GPUs (ranks) per node.
        memory: bytes of memory per GPU.
        overlap: the share of an overlappable collective that can hide behind compute (1: NCCL
            on its own stream; 0: CPU ranks whose gloo collectives use the computing cores).
        copy: bytes/s of a copy on one GPU counting the bytes once (its memory bandwidth / 2);
            None: DDP's bucket copies are not modelled.
        source: where each figure comes from.
    """

    name: str
    device: Device
    intra: Link
    inter: Link
    gpus_per_node: int
    memory: int
    overlap: float = 1.0
    copy: float | None = None
    source: str = ""

    @property
    def flops(self) -> dict[str, float]:
        """FLOP/s by precision of the device's fastest matrix product (``device.ceiling``), the
        rate the model runs a large product at: compute only (smaller products run slower,
        :func:`~mgtutor.plan.compute_time.gemm_seconds`). Not an end-to-end rate: Narayanan et
        al.'s 52% of peak counts communication, the bubble and the rest of a step too."""
        return dict(self.device.ceiling)

    def group_link(self, span: int, per_node: int) -> Link:
        """The link of a group spanning ``span`` consecutive ranks with ``per_node`` members on
        each node: NVLink inside a node, else min(NVLink, per_node NICs)."""
        if span <= self.gpus_per_node:
            return self.intra
        return replace(
            self.inter, bandwidth=min(self.intra.bandwidth, per_node * self.inter.bandwidth)
        )


@dataclass(frozen=True)
class Software:
    """What the training code overlaps and how it sends, each the behaviour of named code.

    Attributes:
        tp_overlap: "backward" (Megatron-LM: a backward all-reduce behind the weight gradient),
            "all" (AsyncTP: forward collectives behind the forward products too), or "none"
            (Megatron-LM's 2021 code; torch's ``parallelize_module``).
        dp_overlap: gradient collectives during the last micro-batch's backward (torch DDP,
            FSDP2); False: after it (Megatron-LM's 2021 local DDP).
        scatter_gather: pipeline sends of b·s·h/t per GPU, all-gathered on arrival.
        attention: "unfused" (s x s scores in memory) or "flash" (FlashAttention, torch SDPA).
        dropout: the layer has dropout (GPT); Llama has none.
        bucket_view: DDP's gradients are bucket views (no copies).
        optimizer: count the optimizer step.
        bucket_bytes: the gradient bucket reduced last (DDP's bucket_cap_mb).
        first_bucket_bytes: the bucket reduced first (DDP's first bucket: 1 MiB by default,
            ``dist._DEFAULT_FIRST_BUCKET_BYTES``): no reduction starts before its gradients,
            the last layer's, are computed.
    """

    tp_overlap: str = "backward"
    dp_overlap: bool = True
    scatter_gather: bool = True
    attention: str = "unfused"
    dropout: bool = True
    bucket_view: bool = False
    optimizer: bool = True
    bucket_bytes: int = DDP_BUCKET_BYTES
    first_bucket_bytes: int = 2**20


@dataclass(frozen=True)
class StepTime:
    """One step's predicted seconds, by part, for the stage that finishes last (``stage``).

    ``parts``: "matmul", "memory-bound", "tp" (exposed), "pp" (what sends add), "bubble",
    "dp" (exposed), "copies", "optimizer". ``hidden``: what overlap hid. ``tokens``: the tokens
    one step trains on all GPUs. ``flops``: the FLOPs one GPU runs (recomputation included).
    ``details``: the data-parallel reduction's seconds ("dp_reduce"), what it may hide behind
    ("dp_window": the last micro-batch's backward after its first bucket, x overlap) and its
    last bucket's seconds ("dp_last_bucket"), for the CPU check's counterfactuals.
    """

    parts: dict[str, float]
    hidden: float
    tokens: int
    gpus: int
    flops: float = 0.0
    links: dict[str, str] = field(default_factory=dict)
    stage: int = 0
    details: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """Seconds per step: the sum of the parts."""
        return sum(self.parts.values())

    @property
    def tokens_per_gpu_per_s(self) -> float:
        """Tokens per second per GPU (torchtitan's TPS/GPU)."""
        return self.tokens / self.total / self.gpus

    def utilization(self, flops_per_token: float, peak: float) -> float:
        """``flops_per_token`` x tokens per GPU per second / ``peak``: MFU with a model's
        count, HFU with the hardware's (recomputation included)."""
        return flops_per_token * self.tokens_per_gpu_per_s / peak


#: The defaults: Megatron-LM's backward TP overlap, torch DDP's overlapped buckets (copies on).
TORCH = Software()
#: Megatron-LM at 6985e589 (the commit ``examples/sc21/README.md`` names for the paper's runs):
#: TP's all-reduces synchronous (``mpu/mappings.py``: no asynchronous backward all-reduce until
#: September 2021); the local DDP (used with pipelines, ``training.py``) all-reduces its
#: contiguous gradient buffer after the backward (``model/distributed.py``); scatter/gather on
#: (``--no-scatter-gather-tensors-in-pipeline`` turns it off); attention unfused; dropout.
MEGATRON_2021 = Software(tp_overlap="none", dp_overlap=False, bucket_view=True)
#: Megatron-LM with its backward TP overlap (CUDA_DEVICE_MAX_CONNECTIONS=1) and overlapped DDP.
MEGATRON = Software(tp_overlap="backward", dp_overlap=True, bucket_view=True)
#: torchtitan at 9dec370: FSDP2 (no DDP reducer), torch's TP (no backward overlap; AsyncTP
#: overlaps both directions: ``Software(tp_overlap="all", ...)``), SDPA's flash attention, no
#: dropout in Llama.
TORCHTITAN = Software(tp_overlap="none", attention="flash", dropout=False, bucket_view=True)

_A100_HBM, _H100_HBM = 2.039e12, 3.35e12  # bytes/s, the datasheets' (cited below)
_A100 = Device(
    "A100 SXM4 80GB",
    peak={"mixed": 312e12},
    ceiling={"mixed": 271.2e12},
    memory_bandwidth=_A100_HBM,
    sms=108,
    source="peak bf16/fp16 dense and 2,039 GB/s: NVIDIA A100 datasheet (nvidia-a100-datasheet-"
    "us-nvidia-1758950-r4); 108 SMs: Ampere whitepaper; ceiling 271.2 TFLOP/s: the largest "
    "bf16 matmul found by mamf-finder.py (stas00/ml-engineering, compute/accelerator/README.md "
    "at 744d01e, 'Maximum Achievable Matmul FLOPS', torch 2.6.0+cu126)",
)

A100_SELENE = Hardware(
    name="DGX A100 80GB (Selene): NVLink 3 + NVSwitch, 8 x 200 Gb/s HDR InfiniBand",
    device=_A100,
    intra=Link(230e9),
    inter=Link(25e9),
    gpus_per_node=8,
    memory=80 * 10**9,
    copy=_A100_HBM / 2,
    source="NVLink busbw ~230 GB/s on A100 at large sizes (12 links x 25 GB/s line rate, ~20 "
    "effective; NCCL's maintainer, NVIDIA/nccl-tests#149); one 200 Gb/s HDR NIC per GPU, 25 "
    "GB/s line rate (Narayanan et al. 2021 section 5; nccl-tests#119 measured 96 of 100 GB/s "
    "for 4 such NICs)",
)

_H100 = Device(
    "H100 SXM 80GB",
    peak={"mixed": 989e12, "fp8": 1979e12},
    ceiling={"mixed": 794.5e12, "fp8": 1402.6e12},
    memory_bandwidth=_H100_HBM,
    sms=132,
    source="peak: torchtitan get_peak_flops (989e12, from nvidia.com/en-us/data-center/h100), "
    "fp8 twice that; 132 SMs and 3.35 TB/s HBM3: NVIDIA's H100 whitepaper; ceilings 794.5 "
    "(bf16) and 1402.6 (fp8) TFLOP/s: mamf-finder.py (ml-engineering at 744d01e, torch 2.7.0)",
)

H100_SXM_NODE = Hardware(
    name="8 x H100 SXM 80GB, NVLink 4, 400 Gb/s InfiniBand per GPU",
    device=_H100,
    intra=Link(370e9, all_reduce_bandwidth=480e9, all_reduce_from=2**28),
    inter=Link(50e9),
    gpus_per_node=8,
    memory=80 * 10**9,
    copy=_H100_HBM / 2,
    source="NVLink: 450 GB/s line rate, 370 GB/s busbw with NCCL's protocol (ring, and every "
    "collective but all-reduce); all-reduce over 8 GPUs ~480 GB/s busbw with NVLink SHARP, "
    "NCCL's default, as a peak, on messages larger than 256 MiB ('256M is too small to reach "
    "peak bandwidth', NCCL's maintainer, NVIDIA/nccl-tests#212); 400 Gb/s = 50 GB/s per GPU "
    "between nodes, line rate",
)

#: torchtitan's hosts (benchmarks/llama3_h100_202412_torchtitan.md at 31a17bf): H100 96GB HBM2e,
#: 2.4 TB/s, 500 W (its footnote: the true peak lies between SXM's and NVL's, unknown); the
#: ceilings are the 700 W SXM's, so the model runs them faster than they ran.
GRAND_TETON_H100 = Hardware(
    name="Grand Teton: 8 x H100 96GB (500 W), NVLink, 400 Gb/s RDMA per GPU",
    device=replace(_H100, name="H100 96GB HBM2e (500 W)", memory_bandwidth=2.4e12),
    intra=H100_SXM_NODE.intra,
    inter=H100_SXM_NODE.inter,
    gpus_per_node=8,
    memory=96 * 10**9,
    copy=1.2e12,
    source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md (hardware section); links "
    "and ceilings as H100_SXM_NODE",
)
