"""Plan a transformer's training layout: memory per GPU and communication per step, from formulas.

:func:`plan` takes a model's shape (:class:`Transformer`), the GPUs (how many, how much memory
each) and a layout (data parallel ``dp`` with a ZeRO stage, tensor parallel ``tp``, pipeline
parallel ``pp``), and returns a :class:`Plan`: the bytes one GPU holds by category, the bytes
each collective moves per optimizer step, and whether it fits. :func:`layouts` tries every
layout for a number of GPUs and keeps those that fit.

Everything here is arithmetic; nothing is measured. Where the same question can be measured
on CPU ranks, the tests check every category: ``tests/measure/test_planner.py`` the float32
model states against :func:`mgtutor.measure.memplan.estimate` (itself equal, byte for byte, to
what :mod:`~mgtutor.measure.breakdown` measures inside ranks) and the tensor-parallel
collectives against :func:`mgtutor.parallel.tensor_comms.count_collectives`;
``tests/measure/test_activation_plan.py`` the activations, term by term, against what autograd
keeps for :class:`mgtutor.parallel.gpt_layer.GPTLayer` in one process and per rank under tensor
and sequence parallelism, with full and selective recomputation
(:mod:`~mgtutor.measure.activation_plan`, re-exported here); ``test_traffic.py`` the DDP and
pipeline collectives against every call counted in the ranks, and ZeRO-1/2/3 against what torch
runs instead (:func:`mgtutor.measure.traffic.torch_collectives`, exact).

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mgtutor.measure.activation_plan import (
    ACTIVATIONS_SOURCE,
    ELEMENT_BYTES,
    activation_bytes_per_layer,
    activation_terms,
)

__all__ = [
    "ACTIVATIONS_SOURCE",
    "BYTES_PER_PARAMETER",
    "Collective",
    "Plan",
    "Transformer",
    "activation_bytes_per_layer",
    "activation_terms",
    "layouts",
    "plan",
]

#: Bytes per parameter: (parameter, gradient, optimizer state) for Adam in each precision.
#: "mixed": 16-bit parameters and gradients, float32 master weights, momentum and variance
#: (ZeRO's 2 + 2 + K, K = 12). "fp32": float32 everywhere, Adam's two moments (4 + 4 + 8).
BYTES_PER_PARAMETER: dict[str, tuple[int, int, int]] = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}


@dataclass(frozen=True)
class Transformer:
    """The shape of a decoder-only transformer, as the formulas need it.

    The parameter count, unless given, is the one of :class:`mgtutor.parallel.tensor.Block`
    (GPT-2's layer): per layer q, k, v and output projections with biases (4h² + 4h), an MLP
    of width ``ffn`` with biases (2h·ffn + ffn + h) and two LayerNorms (4h); plus a tied
    embedding of ``vocab`` x h. Position embeddings and the final norm are left out.

    Args:
        layers: number of transformer layers (L).
        hidden: hidden size (h).
        heads: attention heads (a).
        seq_len: sequence length (s).
        micro_batch: sequences per micro-batch (b).
        ffn: the MLP's inner width; 4h by default.
        vocab: vocabulary size (V); 0 for a stack of layers without an embedding.
        params: the total parameter count, for a model whose layers differ from GPT-2's
            (gated MLPs, no biases); each layer then holds ``(params - embedding) / layers``.
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    micro_batch: int = 1
    ffn: int | None = None
    vocab: int = 0
    params: int | None = None

    @property
    def embedding(self) -> int:
        """Parameters of the (tied) token embedding: V·h."""
        return self.vocab * self.hidden

    @property
    def replicated_per_layer(self) -> int:
        """Parameters tensor parallelism keeps whole on every rank: two norms and the two
        row-parallel biases, 6h (Megatron-LM's split)."""
        return 6 * self.hidden

    @property
    def per_layer(self) -> int:
        """Parameters of one layer: 4h² + 2h·ffn + 9h + ffn, or from ``params``."""
        if self.params is not None:
            return (self.params - self.embedding) // self.layers
        h, f = self.hidden, self.ffn or 4 * self.hidden
        return 4 * h * h + 2 * h * f + 9 * h + f

    @property
    def total(self) -> int:
        """All parameters: L x per layer + embedding (``params`` when given)."""
        if self.params is not None:
            return self.params
        return self.layers * self.per_layer + self.embedding


@dataclass(frozen=True)
class Collective:
    """One kind of collective a GPU runs in a step.

    ``buffer_bytes`` is the whole buffer of one call (an all-reduce's tensor, an all-gather's
    output, a reduce-scatter's input), the convention of notebook 12 and of
    :mod:`mgtutor.parallel.tensor_comms`; ``sent_bytes`` is what one GPU sends over all
    ``calls`` on a ring of ``size`` GPUs: 2(N-1)/N of the buffer for an all-reduce, (N-1)/N for
    an all-gather or a reduce-scatter, the buffer itself for a point-to-point send.
    """

    name: str  # "all_reduce", "all_gather", "reduce_scatter" or "send"
    group: str  # "dp", "tp" or "pp"
    size: int
    buffer_bytes: int
    calls: int
    sent_bytes: int


@dataclass(frozen=True)
class Plan:
    """What one GPU holds and sends in a step of a layout (the busiest GPU: the first stage).

    ``memory`` maps each category to bytes: parameters, gradients, optimizer_state,
    communication (DDP's buckets, when counted), transient (ZeRO-3's all-gathered unit and its
    unsharded gradients) and activations.
    """

    dp: int
    tp: int
    pp: int
    zero: int
    precision: str
    memory: dict[str, int]
    collectives: tuple[Collective, ...]
    gpu_memory: int
    activations_source: str = ACTIVATIONS_SOURCE

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
        """Bytes one GPU sends per step, all collectives."""
        return sum(c.sent_bytes for c in self.collectives)

    @property
    def layout(self) -> str:
        """The layout in words, e.g. ``"dp=4 (ZeRO-3) x tp=2 x pp=1"``."""
        stage = f" (ZeRO-{self.zero})" if self.zero else ""
        return f"dp={self.dp}{stage} x tp={self.tp} x pp={self.pp}"


def _ring(name: str, size: int, buffer: int, calls: int, group: str) -> Collective:
    factor = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}[name]
    return Collective(
        name, group, size, buffer, calls, calls * factor * (size - 1) * buffer // size
    )


def plan(
    model: Transformer,
    gpus: int,
    gpu_memory: int,
    *,
    dp: int | None = None,
    tp: int = 1,
    pp: int = 1,
    zero: int = 0,
    precision: str = "mixed",
    micro_batches: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    ddp_buckets: bool = False,
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
    * activations: :func:`activation_bytes_per_layer` x ceil(L/pp) layers x min(micro_batches,
      pp) micro-batches in flight (1F1B; Korthikanti et al. section 4.2.3).

    Collectives per step: data parallelism all-reduces the gradients (ZeRO 0); ZeRO-1/2
    reduce-scatter them (ZeRO-2 per micro-batch: it keeps no whole gradients) and all-gather
    the updated parameters (the ZeRO paper's 2x the parameters); ZeRO-3 all-gathers the
    parameters in forward and again in backward and reduce-scatters the gradients, per
    micro-batch (3x). Tensor parallelism: 4 all-reduces of the b·s·h activation per layer per
    micro-batch (2 forward, 2 backward), or with sequence parallelism 4 all-gathers and 4
    reduce-scatters of it. Pipeline: the activation sent forward and its gradient sent back at
    each stage boundary, per micro-batch (a middle stage sends both; with pp=2, one each).

    Args:
        model: the model's shape.
        gpus: number of GPUs; must equal dp x tp x pp.
        gpu_memory: bytes of memory per GPU.
        dp: data-parallel size; ``gpus // (tp * pp)`` by default.
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        zero: ZeRO stage over the data-parallel group, 0 (plain DDP) to 3 (FSDP).
        precision: "mixed" or "fp32" (keys of :data:`BYTES_PER_PARAMETER`).
        micro_batches: micro-batches per optimizer step (gradient accumulation or pipeline).
        sequence_parallel: Megatron's sequence parallelism with ``tp``.
        recompute: "none", "selective" or "full" activation recomputation.
        ddp_buckets: count DDP's bucket copy of the gradients (ZeRO 0 and 1).

    Returns:
        The :class:`Plan` of the busiest GPU.

    Raises:
        ValueError: if the layout does not multiply to ``gpus``, a size is below 1, the
            heads do not split over ``tp``, ``pp`` exceeds the layers, or ``zero`` or
            ``precision`` is unknown.

    Example:
        >>> p = plan(Transformer(layers=32, hidden=4096, heads=32, seq_len=4096), 8, 80 * 10**9,
        ...          zero=3)
        >>> p.fits, p.memory["optimizer_state"]
    """
    dp = gpus // (tp * pp) if dp is None else dp
    if min(dp, tp, pp, gpus, micro_batches) < 1 or dp * tp * pp != gpus:
        raise ValueError(
            f"dp x tp x pp must equal gpus ({gpus}) with every size at least 1; got dp={dp}, "
            f"tp={tp}, pp={pp}: choose sizes whose product is the number of GPUs"
        )
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
            model, tp, sequence_parallel, precision, recompute
        )
        * layers
        * min(micro_batches, pp),
    }
    if zero >= 3:
        unit = max(layer_shard, model.embedding // tp)
        memory["transient"] = 2 * math.ceil(unit / dp) * dp * b_param
    collectives = []
    if dp > 1:
        grads, params = held * b_grad, held * b_param
        if zero == 0:
            collectives.append(_ring("all_reduce", dp, grads, 1, "dp"))
        elif zero in (1, 2):
            scatters = micro_batches if zero == 2 else 1
            collectives.append(_ring("reduce_scatter", dp, grads, scatters, "dp"))
            collectives.append(_ring("all_gather", dp, params, 1, "dp"))
        else:
            collectives.append(_ring("all_gather", dp, params, 2 * micro_batches, "dp"))
            collectives.append(_ring("reduce_scatter", dp, grads, micro_batches, "dp"))
    activation = model.micro_batch * model.seq_len * model.hidden * ELEMENT_BYTES[precision]
    if tp > 1:
        calls = 4 * layers * micro_batches
        if sequence_parallel:
            collectives.append(_ring("all_gather", tp, activation, calls, "tp"))
            collectives.append(_ring("reduce_scatter", tp, activation, calls, "tp"))
        else:
            collectives.append(_ring("all_reduce", tp, activation, calls, "tp"))
    if pp > 1:
        sends = (2 if pp > 2 else 1) * micro_batches
        collectives.append(Collective("send", "pp", pp, activation, sends, sends * activation))
    return Plan(dp, tp, pp, zero, precision, memory, tuple(collectives), gpu_memory)


def layouts(
    model: Transformer,
    gpus: int,
    gpu_memory: int,
    *,
    zero: tuple[int, ...] = (0, 1, 2, 3),
    precision: str = "mixed",
    micro_batches: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> list[Plan]:
    """Every layout of ``gpus`` GPUs (dp x tp x pp, each ZeRO stage) that fits, best first.

    A ZeRO stage above 0 is tried only with dp > 1, tp only where it divides the heads, pp
    only up to the layers. The plans that fit are sorted by the bytes a GPU sends per step,
    then by memory per GPU: the layout that communicates least comes first (this says nothing
    of bandwidth: tensor parallelism's traffic needs a fast link, NVLink within a node).

    Args:
        model, gpus, gpu_memory, precision, micro_batches, sequence_parallel, recompute: as
            :func:`plan`.
        zero: the ZeRO stages to try.

    Returns:
        The :class:`Plan` of every layout that fits; empty when none does.
    """
    found = []
    for tp in (d for d in range(1, gpus + 1) if gpus % d == 0 and model.heads % d == 0):
        for pp in (d for d in range(1, gpus // tp + 1) if (gpus // tp) % d == 0):
            if pp > model.layers:
                continue
            for stage in zero:
                if stage and gpus // (tp * pp) == 1:
                    continue
                p = plan(
                    model,
                    gpus,
                    gpu_memory,
                    tp=tp,
                    pp=pp,
                    zero=stage,
                    precision=precision,
                    micro_batches=micro_batches,
                    sequence_parallel=sequence_parallel,
                    recompute=recompute,
                )
                if p.fits:
                    found.append(p)
    return sorted(found, key=lambda p: (p.sent_bytes, p.total))
