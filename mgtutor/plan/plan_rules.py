"""The planner's rules about what runs: collectives per layer, pipelines torch refuses, the bubble.

:mod:`mgtutor.plan.planner` does the arithmetic of bytes; this module holds the rules that
decide which calls a layout makes and whether torch runs it at all, each checked against what
runs (``tests/plan/test_planner.py``):

* :func:`tp_collectives_per_layer`: the tensor- and sequence-parallel collectives one layer runs
  per micro-batch, counted on 2 CPU ranks with :class:`mgtutor.parallel.gpt_layer.ParallelGPTLayer`
  (and ``torch.utils.checkpoint`` around it for full recomputation).
* :func:`grid_of`: the :class:`~mgtutor.grid.Layout` a plan is for, from ``layout=`` or from
  dp, tp and pp, checked against the number of GPUs.
* :func:`refusal`: why torch does not run a pipeline, or None; :func:`in_flight`, the
  micro-batches a stage keeps activations for, by schedule (:data:`SCHEDULES`);
  :func:`fsdp_in_pipeline`, when FSDP holds a whole stage unsharded within the step.
* :func:`bubble` and :func:`bubble_scaled_bytes`, the rule :func:`~mgtutor.plan.planner.layouts`
  ranks by (:data:`RANKING_RULE`). :func:`mgtutor.plan.step_time.ranked` ranks by time instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mgtutor.grid import Layout

if TYPE_CHECKING:
    from mgtutor.plan.activation_plan import Recompute

__all__ = [
    "MAX_BUBBLE",
    "RANKING_RULE",
    "bubble",
    "SCHEDULES",
    "bubble_scaled_bytes",
    "candidate_layouts",
    "fsdp_in_pipeline",
    "grid_of",
    "in_flight",
    "rank_key",
    "refusal",
    "refused_layouts",
    "tp_collectives_per_layer",
]

#: Pipelines idling more than this fraction of a step rank after every other layout.
MAX_BUBBLE = 0.25

#: The pipeline schedules the planner plans, by the name of torch's class
#: (``torch.distributed.pipelining``).
SCHEDULES = {"1F1B": "Schedule1F1B", "GPipe": "ScheduleGPipe"}

RANKING_RULE = (
    "a layout whose pipeline bubble (p-1)/(m+p-1) exceeds max_bubble comes after every one "
    "that does not; within each group, fewer bytes sent per useful step first: bytes sent per "
    "step / (1 - bubble); then less memory per GPU"
)


def tp_collectives_per_layer(
    sequence_parallel: bool = False, keep_gathered: bool = False, recompute: Recompute = "none"
) -> dict[str, int]:
    """Calls of each collective one tensor-parallel layer runs per micro-batch, forward and back.

    Each buffer is the layer's whole b·s·h activation (an all-reduce's tensor, an all-gather's
    output, a reduce-scatter's input).

    * Plain tensor parallelism (Megatron-LM's f and g): 4 all-reduces, 2 forward, 2 backward.
    * Sequence parallelism keeping only this rank's shard of the q-k-v and fc1 inputs (as
      Korthikanti et al. do, and as the activation model assumes): forward 2 all-gathers and 2
      reduce-scatters; backward all-gathers each shard again for the weight's gradient and
      reduce-scatters the input's gradient, and all-gathers the gradient of each reduce-scatter:
      6 all-gathers, 4 reduce-scatters.
    * ``keep_gathered``: the gathered inputs are kept whole, so backward gathers nothing again:
      4 and 4 (and more activation memory: see
      :func:`~mgtutor.plan.activation_plan.activation_terms`).
    * Full recomputation re-runs the layer's forward in backward, its collectives included:
      2 all-reduces more, or 2 all-gathers and 2 reduce-scatters more. Selective recomputation
      re-runs only the attention core, which communicates nothing.
    """
    if not sequence_parallel:
        counts = {"all_reduce": 4}
    elif keep_gathered:
        counts = {"all_gather": 4, "reduce_scatter": 4}
    else:
        counts = {"all_gather": 6, "reduce_scatter": 4}
    if recompute == "full":
        counts = {name: n + 2 for name, n in counts.items()}
    return counts


def bubble(pp: int, micro_batches: int) -> float:
    """The fraction of a 1F1B or GPipe step a stage idles: (p-1)/(m+p-1) (0 without a pipeline)."""
    return (pp - 1) / (micro_batches + pp - 1)


def refusal(*, pp: int, micro_batches: int, schedule: str = "1F1B") -> str | None:
    """Why torch does not run this pipeline, or None if it does.

    ``Schedule1F1B`` raises ValueError with fewer micro-batches than stages (as does
    ``ScheduleDualPipeV``; ``ScheduleZBVZeroBubble`` checks only its two stages per rank);
    ``ScheduleGPipe`` runs any number (torch's ``pipelining/schedules.py``, read in 2.14.1).
    FSDP (ZeRO-2/3) under a pipeline runs: see :func:`~mgtutor.plan.planner.plan`.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    if schedule == "1F1B" and pp > 1 and micro_batches < pp:
        return (
            f"pp={pp} with {micro_batches} micro-batches: torch's Schedule1F1B raises ValueError "
            "when there are fewer micro-batches than stages (pipelining/schedules.py, torch "
            "2.11 to 2.15); use at least as many micro-batches as stages, or GPipe"
        )
    return None


def grid_of(
    gpus: int, dp: int | None, tp: int | None, pp: int | None, layout: Layout | None
) -> Layout:
    """The grid a plan is for: ``layout``, or the one dp, tp and pp name (dp: what is left).

    Raises:
        ValueError: ``layout`` together with dp, tp or pp; a grid of another size than
            ``gpus``; fewer than 1 GPU; a size below 1 (:class:`~mgtutor.grid.Layout`'s error).
    """
    if layout is not None:
        if (dp, tp, pp) != (None, None, None):
            raise ValueError(
                f"plan: got layout={layout} and dp={dp}, tp={tp}, pp={pp}; pass one: the "
                "Layout already names every axis"
            )
        if layout.world_size != gpus:
            raise ValueError(
                f"plan: {layout} needs dp*tp*pp = {layout.world_size} GPUs, got gpus={gpus}: "
                f"pass gpus={layout.world_size} or another layout"
            )
        return layout
    if gpus < 1:
        raise ValueError(f"plan: gpus={gpus}; pass the number of GPUs, 1 or more")
    tp, pp = 1 if tp is None else tp, 1 if pp is None else pp
    given = Layout(dp=1 if dp is None else dp, tp=tp, pp=pp)  # names a size below 1
    dp = gpus // given.world_size if dp is None else dp  # what tp and pp leave
    if dp * tp * pp != gpus:
        raise ValueError(
            f"dp x tp x pp must equal gpus ({gpus}) with every size at least 1; got dp={dp}, "
            f"tp={tp}, pp={pp}: choose sizes whose product is the number of GPUs"
        )
    return Layout(dp=dp, tp=tp, pp=pp)


def fsdp_in_pipeline(*, dp: int, pp: int, zero: int) -> bool:
    """Whether FSDP (ZeRO-2/3) runs under a pipeline, holding its stage unsharded in the step.

    torch's pipeline stage keeps an FSDP module's parameters and gradients unsharded from one
    micro-batch's backward to the next and reduce-scatters after the last
    (``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``,
    ``perform_reduce_grad`` in ``distributed/pipelining/stage.py``, read in torch 2.14.1);
    torchtitan keeps them after forward too (``reshard_after_forward`` False when pipelining:
    ``get_fsdp_reshard_after_forward_policy`` in ``torchtitan/distributed/fsdp.py``). So the
    stage is gathered once and reduce-scattered once per step, and held whole in between.
    """
    return pp > 1 and zero >= 2 and dp > 1


def in_flight(pp: int, micro_batches: int, schedule: str = "1F1B") -> int:
    """Micro-batches whose activations the first stage holds at once: 1F1B starts a backward
    after p forwards, min(m, p); GPipe runs every forward first, m; 1 without a pipeline."""
    if pp == 1:
        return 1
    return micro_batches if schedule == "GPipe" else min(micro_batches, pp)


def bubble_scaled_bytes(plan: Any) -> float:
    """Bytes a GPU sends per step divided by the share of the step it computes, 1 - bubble."""
    return plan.sent_bytes / (1 - plan.bubble)


def rank_key(plan: Any, max_bubble: float = MAX_BUBBLE) -> tuple[bool, float, int]:
    """The sort key of :data:`RANKING_RULE`: (bubble above ``max_bubble``, scaled bytes, memory)."""
    return (plan.bubble > max_bubble, bubble_scaled_bytes(plan), plan.total)


def candidate_layouts(
    model: Any, gpus: int, zero: tuple[int, ...] = (0, 1, 2, 3)
) -> Iterator[tuple[int, int, int]]:
    """Every (tp, pp, ZeRO stage) of ``gpus`` GPUs whose sizes divide the heads and layers."""
    for tp in (d for d in range(1, gpus + 1) if gpus % d == 0 and model.heads % d == 0):
        for pp in (d for d in range(1, gpus // tp + 1) if (gpus // tp) % d == 0):
            if pp > model.layers:
                continue
            for stage in zero:
                if not (stage and gpus // (tp * pp) == 1):
                    yield tp, pp, stage


def refused_layouts(
    model: Any,
    gpus: int,
    *,
    zero: tuple[int, ...] = (0, 1, 2, 3),
    micro_batches: int = 1,
    schedule: str = "1F1B",
) -> list[tuple[str, str]]:
    """What :func:`~mgtutor.plan.planner.layouts` leaves out as torch does not run it.

    Returns:
        (layout, why) for each refused layout, e.g. ("dp=1 x tp=1 x pp=8", "pp=8 with 4 ...").
    """
    out = []
    for tp, pp, stage in candidate_layouts(model, gpus, zero):
        reason = refusal(pp=pp, micro_batches=micro_batches, schedule=schedule)
        if reason:
            dp = gpus // (tp * pp)
            name = f"dp={dp}" + (f" (ZeRO-{stage})" if stage else "") + f" x tp={tp} x pp={pp}"
            out.append((name, reason))
    return out
