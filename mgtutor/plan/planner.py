"""Plan a transformer's training layout: memory per GPU and communication per step, from formulas.

:func:`plan` takes a model's shape (:class:`Transformer`), the GPUs (how many, how much memory
each) and a layout (data parallel ``dp`` with a ZeRO stage, tensor parallel ``tp``, pipeline
parallel ``pp``), and returns a :class:`Plan`: the bytes one GPU holds by category, the bytes
each collective moves per optimizer step, and whether it fits. :func:`layouts` tries every
layout for a number of GPUs and keeps those that fit.

Everything here is arithmetic, and the tests check each category against what CPU ranks hold
and run: the float32 model states against :func:`mgtutor.plan.memplan.estimate`, the
activations against autograd in :class:`mgtutor.parallel.gpt_layer.GPTLayer`, every collective
against the calls counted in ranks (:func:`mgtutor.experiments.traffic.torch_collectives`).

Sources of the formulas:

* Model states: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", arXiv:1910.02054, section 3.1 and 5: mixed-precision Adam keeps 2 + 2 + K
  bytes per parameter (16-bit parameters and gradients; K = 12: float32 master copy, momentum
  and variance); ZeRO-1 shards the K bytes over the N data-parallel ranks (4 + 12/N), ZeRO-2
  the gradients too (2 + 14/N), ZeRO-3 everything (16/N). Communication, section 7: data
  parallelism and ZeRO-1/2 move 2x the parameters per step, ZeRO-3 3x. Notebook 17 checks the
  paper's Table 1 (v3, p. 11) entry by entry and sets other published per-GPU figures beside these.
* Activations: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", arXiv:2205.05198, section 4 and table 2 (16-bit activations, per layer).
* Tensor parallelism: Shoeybi et al., "Megatron-LM", arXiv:1909.08053, section 3: two
  all-reduces of the layer's activation forward and two backward per layer (notebook 13).
  Sequence parallelism, recomputation, FSDP under a pipeline, what torch refuses, the bubble
  and the ranking rule: :mod:`~mgtutor.plan.plan_rules`.
* LocalSGD and DiLoCo (``method``): torchft 0.2.0's ``torchft/local_sgd.py``
  (:mod:`~mgtutor.plan.local_sync`).
* Float32 gradients with 16-bit parameters ("mixed_fp32_grads"): Megatron-LM's
  ``docs/source/api-guide/dist_optimizer.md`` (commit 50b073c), "float16 param, fp32 grads |
  18 | 6 + 12/d" bytes per parameter: gradients are accumulated and reduced in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mgtutor.grid import Layout
from mgtutor.plan.activation_plan import (
    ACTIVATIONS_SOURCE,
    ELEMENT_BYTES,
    activation_bytes_per_layer,
)
from mgtutor.plan.local_sync import NAMES, SYNCED_BYTES, method_refusal, sync_memory
from mgtutor.plan.plan_rules import (
    MAX_BUBBLE,
    bubble,
    candidate_layouts,
    fsdp_in_pipeline,
    grid_of,
    in_flight,
    rank_key,
    refusal,
    tp_collectives_per_layer,
)
from mgtutor.plan.shape import Transformer
from mgtutor.ring import bytes_sent_on_ring

if TYPE_CHECKING:
    from mgtutor.plan.activation_plan import Recompute

__all__ = ["BYTES_PER_PARAMETER", "Collective", "Plan", "layouts", "plan"]

#: Bytes per parameter: (parameter, gradient, optimizer state) for Adam in each precision.
#: "mixed": 16-bit parameters and gradients, float32 master weights, momentum and variance
#: (ZeRO's 2 + 2 + K, K = 12). "fp32": float32 everywhere, Adam's two moments (4 + 4 + 8).
#: "mixed_fp32_grads": 16-bit parameters, float32 gradients for accumulation and reduction
#: (Megatron-LM's bf16 default, 18 bytes: its dist_optimizer.md); twice the gradient traffic.
BYTES_PER_PARAMETER: dict[str, tuple[int, int, int]] = {
    "mixed": (2, 2, 12),
    "fp32": (4, 4, 8),
    "mixed_fp32_grads": (2, 4, 12),
}


@dataclass(frozen=True)
class Collective:
    """One kind of collective a GPU runs in a step.

    ``buffer_bytes`` is the whole buffer of one call (an all-reduce's tensor, an all-gather's
    output, a reduce-scatter's input), the convention of notebook 12 and of
    :mod:`mgtutor.parallel.tensor_comms`; ``sent_bytes`` is what one GPU sends over all
    ``calls`` on a ring of ``size`` GPUs: 2(N-1)/N of the buffer for an all-reduce, (N-1)/N for
    an all-gather or a reduce-scatter, the buffer itself for a point-to-point send; for a call
    once every ``every`` steps (LocalSGD, DiLoCo), 1/``every`` of it: per step on average.
    """

    name: str  # "all_reduce", "all_gather", "reduce_scatter" or "send"
    group: str  # "dp", "tp" or "pp"
    size: int
    buffer_bytes: int
    calls: int
    sent_bytes: int
    every: int = 1


@dataclass(frozen=True)
class Plan:
    """What one GPU holds and sends in a step of a layout (the busiest GPU: the first stage).

    ``memory`` maps each category to bytes: parameters, gradients, optimizer_state,
    communication (DDP's buckets, when counted), transient (what FSDP holds unsharded: ZeRO-3's
    all-gathered unit and its gradients; under a pipeline, the whole stage's parameters and
    gradients), activations and logits (the output layer's float32 logits).
    """

    dp: int
    tp: int
    pp: int
    zero: int
    precision: str
    memory: dict[str, int]
    collectives: tuple[Collective, ...]
    gpu_memory: int
    micro_batches: int = 1
    activations_source: str = ACTIVATIONS_SOURCE
    schedule: str = "1F1B"
    method: str = "ddp"
    sync_every: int = 1
    # What the plan was made for, kept so that step_time(plan, hardware) reads it from the plan
    # rather than being told it again (dataclasses.replace can still change one: don't).
    model: Transformer | None = None
    recompute: Recompute = "none"
    sequence_parallel: bool = False

    @property
    def bubble(self) -> float:
        """The fraction of the step a stage idles, (p-1)/(m+p-1) (1F1B and GPipe)."""
        return bubble(self.pp, self.micro_batches)

    @property
    def total(self) -> int:
        """Bytes per GPU, all categories."""
        return sum(self.memory.values())

    @property
    def model_states(self) -> int:
        """Parameters, gradients and optimizer state: what the ZeRO paper's figures count."""
        return sum(self.memory[k] for k in ("parameters", "gradients", "optimizer_state"))

    @property
    def fits(self) -> bool:
        """Whether :attr:`total` is at most the GPU's memory."""
        return self.total <= self.gpu_memory

    @property
    def sent_bytes(self) -> int:
        """Bytes one GPU sends per step, all collectives (averaged over ``sync_every`` steps)."""
        return sum(c.sent_bytes for c in self.collectives)

    @property
    def layout(self) -> str:
        """The layout in words, ``"dp=4 (ZeRO-3) x tp=2 x pp=1"``, ``"dp=8 (DiLoCo, H=8) ..."``."""
        stage = f" (ZeRO-{self.zero})" if self.zero else ""
        if self.method != "ddp":
            stage = f" ({NAMES[self.method]}, H={self.sync_every})"
        return f"dp={self.dp}{stage} x tp={self.tp} x pp={self.pp}"

    @property
    def grid(self) -> Layout:
        """The :class:`~mgtutor.grid.Layout` planned, the object the ranks run on."""
        return Layout(dp=self.dp, tp=self.tp, pp=self.pp)


def _ring(name: str, size: int, buffer: int, calls: int, group: str, every: int = 1) -> Collective:
    sent = bytes_sent_on_ring(name, size, buffer, calls=calls, every=every)
    return Collective(name, group, size, buffer, calls, sent, every)


def plan(
    model: Transformer,
    gpus: int,
    gpu_memory: int,
    *,
    dp: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    layout: Layout | None = None,
    zero: int = 0,
    precision: str = "mixed",
    micro_batches: int = 1,
    sequence_parallel: bool = False,
    keep_gathered: bool = False,
    recompute: Recompute = "none",
    ddp_buckets: bool = False,
    schedule: str = "1F1B",
    method: str = "ddp",
    sync_every: int = 1,
) -> Plan:
    """Memory per GPU by category and communication per step, for one layout.

    The first pipeline stage is planned (it holds the embedding and, under 1F1B, the most
    micro-batches in flight). Per GPU, with M its parameters after pipeline and tensor
    splits (``ceil(L/pp)`` layers, the embedding, the layers' split part divided by ``tp``),
    B the bytes per parameter of :data:`BYTES_PER_PARAMETER` and N = ``dp``:

    * parameters M·B_p, divided by N under ZeRO-3; gradients M·B_g, divided by N from ZeRO-2;
      optimizer state M·B_o, divided by N from ZeRO-1 (ceil(M/N) elements: rank 0's share,
      as torch's ``chunk`` gives it).
    * communication: DDP's buckets, a second copy of the gradients (``ddp_buckets=True``;
      torch's default, ``gradient_as_bucket_view=False``), for ZeRO 0 and 1 only.
    * transient (ZeRO-3): the largest unit (one layer, or the embedding) all-gathered, padded
      to N shards, plus its unsharded gradients: 2 x ceil(unit/N)·N·B_p (FSDP2 per layer).
      Under a pipeline FSDP (ZeRO-2/3) holds the whole stage unsharded through the step: its
      gradients, M·B_g, and with ZeRO-3 its parameters, ceil(M/N)·N·B_p.
    * activations: :func:`activation_bytes_per_layer` x ceil(L/pp) layers x the micro-batches
      in flight, :func:`~mgtutor.plan.plan_rules.in_flight` (1F1B: min(micro_batches, pp),
      Korthikanti et al. section 4.2.3; GPipe: micro_batches).
    * logits (pp = 1 only: with a pipeline the last stage holds them, not the planned first):
      the output layer's b·s·V/t logits in float32, as the loss upcasts them (4 bytes each).

    Collectives per step (LocalSGD, DiLoCo: the parameters in float32 all-reduced every H =
    ``sync_every`` steps, 1/H per step; buffers: :func:`~mgtutor.plan.local_sync.sync_memory`):
    data parallelism all-reduces the gradients (ZeRO 0); ZeRO-1/2 reduce-scatter them (ZeRO-2
    per micro-batch: it keeps no whole gradients) and all-gather the updated parameters (the
    ZeRO paper's 2x the parameters); ZeRO-3 all-gathers the parameters in forward and again in
    backward and reduce-scatters the gradients, per micro-batch (3x); under a pipeline, FSDP
    gathers once and reduce-scatters once per step (2x). Tensor parallelism: the b·s·h
    activation, per layer per micro-batch,
    :func:`~mgtutor.plan.plan_rules.tp_collectives_per_layer` times (4 all-reduces; with
    sequence parallelism 6 all-gathers and 4 reduce-scatters, 4 and 4 with ``keep_gathered``; 2
    more of each forward collective under full recomputation). Pipeline: the activation (b·s·h/t
    with sequence parallelism) sent forward and its gradient sent back at each stage boundary,
    per micro-batch (a middle stage sends both; with pp=2, one each).

    Args:
        model: the model's shape.
        gpus: number of GPUs; must equal dp x tp x pp.
        gpu_memory: bytes of memory per GPU.
        dp: data-parallel size; ``gpus // (tp * pp)`` by default.
        tp: tensor-parallel size (1 by default).
        pp: pipeline-parallel size (1 by default).
        layout: the three sizes as one :class:`~mgtutor.grid.Layout`, instead of dp, tp, pp.
        zero: ZeRO stage over the data-parallel group, 0 (plain DDP) to 3 (FSDP).
        precision: "mixed" or "fp32" (keys of :data:`BYTES_PER_PARAMETER`).
        micro_batches: micro-batches per optimizer step (gradient accumulation or pipeline).
        sequence_parallel: Megatron's sequence parallelism with ``tp``.
        keep_gathered: with sequence parallelism, keep the all-gathered q-k-v and fc1 inputs
            whole for backward (more memory, 2 all-gathers fewer) instead of the shard.
        recompute: "none", "selective" or "full" activation recomputation.
        ddp_buckets: count DDP's bucket copy of the gradients (ZeRO 0 and 1).
        schedule: the pipeline schedule, "1F1B" or "GPipe" (:data:`SCHEDULES`).
        method: "ddp" (every step, any ``zero``), "localsgd" or "diloco" (every ``sync_every``
            steps, ``zero=0``): :data:`~mgtutor.plan.local_sync.METHODS`.
        sync_every: H, the steps between LocalSGD's or DiLoCo's syncs (1 for "ddp").

    Returns:
        The :class:`Plan` of the busiest GPU.

    Raises:
        ValueError: if the layout does not multiply to ``gpus``, a size is below 1 (or
            ``layout`` comes with dp, tp or pp: :func:`~mgtutor.plan.plan_rules.grid_of`), the
            heads do not split over ``tp``, ``pp`` exceeds the layers, ``zero``, ``precision``
            or ``schedule`` is unknown, or torch does not run the pipeline
            (:func:`~mgtutor.plan.plan_rules.refusal` says why), or ``method`` is refused
            (:func:`~mgtutor.plan.local_sync.method_refusal`: unknown, ZeRO, ``sync_every``).
    """
    grid = grid_of(gpus, dp, tp, pp, layout)
    dp, tp, pp = grid.dp, grid.tp, grid.pp
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be 1 or more, got {micro_batches}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be a ZeRO stage, 0 to 3, got {zero!r}")
    if precision not in BYTES_PER_PARAMETER:
        raise ValueError(
            f"precision must be one of {sorted(BYTES_PER_PARAMETER)}, got {precision!r}"
        )
    if model.heads % tp:
        raise ValueError(f"{model.heads} heads cannot be split over tp={tp}: tp must divide them")
    if pp > model.layers:
        raise ValueError(f"pp={pp} stages for {model.layers} layers: at most one stage a layer")
    reason = refusal(pp=pp, micro_batches=micro_batches, schedule=schedule)
    reason = reason or method_refusal(method=method, zero=zero, sync_every=sync_every)
    if reason:
        raise ValueError(reason)
    b_param, b_grad, b_opt = BYTES_PER_PARAMETER[precision]
    layers = math.ceil(model.layers / pp)
    replicated = model.replicated_per_layer
    layer_shard = (model.per_layer - replicated) // tp + replicated
    held = layers * layer_shard + model.embedding // tp
    shard = math.ceil(held / dp)
    memory = {
        "parameters": (shard if zero >= 3 else held) * b_param,
        "gradients": (shard if zero >= 2 else held) * b_grad,
        "optimizer_state": (shard if zero >= 1 else held) * b_opt,
        "communication": held * b_grad if ddp_buckets and zero <= 1 else 0,
        "transient": 0,
        "activations": activation_bytes_per_layer(
            model, tp, sequence_parallel, precision, recompute, keep_gathered=keep_gathered
        )
        * layers
        * in_flight(pp, micro_batches, schedule),
        "logits": 4 * model.micro_batch * model.seq_len * model.vocab // tp if pp == 1 else 0,
    }
    for category, nbytes in sync_memory(method, held).items():
        memory[category] += nbytes
    in_pipeline = fsdp_in_pipeline(dp=dp, pp=pp, zero=zero)
    if in_pipeline:
        memory["transient"] = held * b_grad + (shard * dp * b_param if zero >= 3 else 0)
    elif zero >= 3:
        unit = max(layer_shard, model.embedding // tp)
        memory["transient"] = 2 * math.ceil(unit / dp) * dp * b_param
    collectives = []
    if dp > 1:
        grads, params = held * b_grad, held * b_param
        if method != "ddp":
            synced = held * SYNCED_BYTES
            collectives.append(_ring("all_reduce", dp, synced, 1, "dp", every=sync_every))
        elif zero == 0:
            collectives.append(_ring("all_reduce", dp, grads, 1, "dp"))
        elif zero == 1 or in_pipeline:
            collectives.append(_ring("reduce_scatter", dp, grads, 1, "dp"))
            collectives.append(_ring("all_gather", dp, params, 1, "dp"))
        elif zero == 2:
            collectives.append(_ring("reduce_scatter", dp, grads, micro_batches, "dp"))
            collectives.append(_ring("all_gather", dp, params, 1, "dp"))
        else:
            collectives.append(_ring("all_gather", dp, params, 2 * micro_batches, "dp"))
            collectives.append(_ring("reduce_scatter", dp, grads, micro_batches, "dp"))
    activation = model.micro_batch * model.seq_len * model.hidden * ELEMENT_BYTES[precision]
    if tp > 1:
        per_layer = tp_collectives_per_layer(sequence_parallel, keep_gathered, recompute)
        for name, calls in per_layer.items():
            collectives.append(_ring(name, tp, activation, calls * layers * micro_batches, "tp"))
    if pp > 1:
        sends = (2 if pp > 2 else 1) * micro_batches
        piece = activation // tp if sequence_parallel else activation
        collectives.append(Collective("send", "pp", pp, piece, sends, sends * piece))
    return Plan(
        dp,
        tp,
        pp,
        zero,
        precision,
        memory,
        tuple(collectives),
        gpu_memory,
        micro_batches,
        schedule=schedule,
        method=method,
        sync_every=sync_every,
        model=model,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
    )


def layouts(
    model: Transformer,
    gpus: int,
    gpu_memory: int,
    *,
    zero: tuple[int, ...] = (0, 1, 2, 3),
    max_bubble: float = MAX_BUBBLE,
    key: Callable[[Plan], Any] | None = None,
    **options: Any,
) -> list[Plan]:
    """Every layout of ``gpus`` GPUs (dp x tp x pp, each ZeRO stage) that torch runs and that
    fits, best first.

    A ZeRO stage above 0 is tried only with dp > 1, tp only where it divides the heads, pp
    only up to the layers; what torch refuses is left out (:func:`refused_layouts` lists it,
    with the reason). The order is :data:`RANKING_RULE`: bytes alone would put a pipeline
    that idles half of each step first, since a pipeline sends least (LocalSGD and DiLoCo, a
    ``method`` in ``options``, only with ZeRO-0). Bytes and the bubble are not time: tensor
    parallelism's traffic needs a fast link (NVLink within a node), and data parallelism's
    overlaps with backward; ``key`` takes another rule (a time model).

    Args:
        model, gpus, gpu_memory: as :func:`plan`.
        zero: the ZeRO stages to try.
        max_bubble: the bubble above which a layout ranks after all others.
        key: the sort key; by default :func:`~mgtutor.plan.plan_rules.rank_key`.
        options: passed to :func:`plan` (precision, micro_batches, sequence_parallel, ...).

    Returns:
        The :class:`Plan` of every layout that fits; empty when none does.
    """
    found = []
    micro_batches = options.get("micro_batches", 1)
    schedule = options.get("schedule", "1F1B")
    if options.get("method", "ddp") != "ddp":
        zero = tuple(stage for stage in zero if stage == 0)
    for tp, pp, stage in candidate_layouts(model, gpus, zero):
        if refusal(pp=pp, micro_batches=micro_batches, schedule=schedule):
            continue  # listed by refused_layouts
        p = plan(model, gpus, gpu_memory, tp=tp, pp=pp, zero=stage, **options)
        if p.fits:
            found.append(p)
    return sorted(found, key=key or (lambda p: rank_key(p, max_bubble)))
