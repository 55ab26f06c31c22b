"""LocalSGD and DiLoCo in the planner: what replicas that sync every H steps send and hold.

The planner's ``method`` follows torchft 0.2.0's ``torchft/local_sgd.py``: every ``sync_every``
optimizer steps LocalSGD all-reduces the parameters to their mean; DiLoCo all-reduces the
pseudo-gradients, anchor - parameters, and steps an outer optimizer. Streaming DiLoCo syncs
fragments in turn, each once per ``sync_every`` steps: the same bytes, spread.
"""

from __future__ import annotations

__all__ = ["METHODS", "NAMES", "SYNCED_BYTES", "method_refusal", "sync_memory"]

#: How the data-parallel replicas agree, the planner's ``method``, with what each sends.
METHODS = {
    "ddp": "gradients reduced every step (DDP; ZeRO-1/2/3 and FSDP with zero > 0)",
    "localsgd": "parameters all-reduced to their mean every sync_every steps (LocalSGD)",
    "diloco": "the pseudo-gradient, anchor - parameters, all-reduced every sync_every steps, "
    "then an outer Nesterov SGD step (DiLoCo)",
}

#: Each method's name in a layout's words (:attr:`mgtutor.plan.planner.Plan.layout`).
NAMES = {"localsgd": "LocalSGD", "diloco": "DiLoCo"}

# torchft 0.2.0 sends what it syncs in the parameters' dtype (``Manager.allreduce`` does not
# quantize by default; DiLoCo's ``should_quantize`` is off by default; LocalSGD has none): float32
# under torch's mixed precision (autocast, FSDP2's ``MixedPrecisionPolicy``). With 16-bit model
# weights and float32 masters inside the optimizer (the planner's "mixed") torchft would send the
# 16-bit copy, which the optimizer overwrites from its masters at the next step, so the planner
# counts the masters' bytes: its choice, not torchft's.
#: Bytes per parameter LocalSGD and DiLoCo all-reduce, and each of DiLoCo's outer momentum and
#: sync buffers holds, in every precision: float32, the weights the optimizer updates.
SYNCED_BYTES = 4


def method_refusal(*, method: str, zero: int, sync_every: int) -> str | None:
    """Why the planner does not plan ``method`` with this ZeRO stage and ``sync_every``, or None.

    LocalSGD and DiLoCo replicas step alone between syncs, so each holds its whole optimizer
    state and gradients: ZeRO over the same data-parallel ranks would need the others every
    step. torchft composes the two as replica groups sharded inside; the planner does not.
    """
    if method not in METHODS:
        return f"method must be one of {sorted(METHODS)}, got {method!r}"
    if sync_every < 1:
        return f"sync_every must be at least 1, got {sync_every}"
    if method == "ddp" and sync_every != 1:
        return (
            f"sync_every={sync_every} with method='ddp': DDP reduces the gradients every step; "
            "use method='localsgd' or 'diloco' to sync every H steps, or micro_batches "
            "(gradient accumulation) for fewer, larger steps"
        )
    if method != "ddp" and zero:
        return (
            f"method={method!r} with zero={zero}: each {method} replica steps alone between "
            "syncs, so it cannot shard its state over the same data-parallel ranks (ZeRO); "
            "use zero=0, or shard within replica groups (torchft's layout, not planned here)"
        )
    return None


def sync_memory(method: str, held: int) -> dict[str, int]:
    """GPU bytes ``method`` adds to a replica holding ``held`` parameters, by category.

    LocalSGD: its clones (communication). DiLoCo: the pseudo-gradients and the local copy
    (communication) and the outer momentum (optimizer_state); the anchor is on the CPU. The
    planner adds these to everything else, an upper bound of the peak: without a delay they live
    after backward has freed the activations; Streaming DiLoCo with a ``fragment_sync_delay``
    keeps one fragment's pseudo-gradients through the next steps, a share of what is counted.
    """
    # Where torchft 0.2.0's ``torchft/local_sgd.py`` keeps them. LocalSGD clones every parameter
    # and all-reduces the clones to their mean (``_average``); the clones stay on the GPU until
    # it ends. DiLoCo keeps its anchor, the parameters at the last sync (``original_parameters``),
    # on ``backup_device``: the CPU by default (pinned). At the sync it holds on the GPU the
    # pseudo-gradients (``_save_grads``) and a copy of the local parameters
    # (``_save_local_parameters``); its outer optimizer, ``torch.optim.SGD`` with Nesterov
    # momentum as ``torchft/_test/diloco_trainer.py`` builds it, keeps its momentum buffer like
    # the gradient it is given: on the GPU.
    synced = held * SYNCED_BYTES
    if method == "localsgd":
        return {"communication": synced}
    if method == "diloco":
        return {"communication": 2 * synced, "optimizer_state": synced}
    return {}
