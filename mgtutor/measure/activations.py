"""Bytes of the tensors a forward and backward create and keep alive, measured on any device.

A CPU rank has no allocator statistics, and its resident memory is mostly the interpreter and
torch's libraries, so :class:`LiveTensors` counts the storages torch's operators create.
:class:`SavedActivations` counts less and costs less: what autograd saves for backward in one
module's forward (:func:`mgtutor.track` uses it). :func:`kept_for_backward` measures one
:class:`~mgtutor.parallel.gpt_layer.GPTLayer`.

torch is imported when this module is, so ``import mgtutor`` loads it lazily.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections import Counter
from typing import Any

import torch
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mgtutor.parallel.gpt_layer import GPTLayer, kept_by_term

__all__ = ["LiveTensors", "SavedActivations", "kept_for_backward"]


_SETTLE_READS = 50  # at most 50 ms more, in the unlikely case the count keeps falling


class LiveTensors(TorchDispatchMode):
    """Track the bytes of the tensors created inside the block that are still alive.

    A ``TorchDispatchMode``: every operator inside the block goes through it, autograd's
    backward and a checkpoint's recomputation too. It counts each storage an operator creates
    (outputs, gradients), once, at its size when counted. Not counted: views and in-place
    results (an input's storage), tensors made before the block (the parameters, the batch),
    memory an operator allocates and frees inside itself (a kernel's workspace), the
    allocator's cache. Python's cyclic garbage collector is paused inside the block, so that
    the count does not depend on when it runs. One Python call per operator: it suits small
    demonstrations, not production profiling.

    Attributes:
        peak: the largest :meth:`live_bytes` seen after an operator since the block began or
            since the last :meth:`reset_peak`.
        op_counts: how many times each operator ran inside the block (``"aten.addmm.default"``
            and so on), recomputations included.

    Example:
        >>> with LiveTensors() as live:
        ...     loss = model(x).pow(2).mean()
        ...     kept = live.live_bytes()  # activations kept for backward
        ...     live.reset_peak()
        ...     loss.backward()
        >>> live.peak  # the most that was alive at once during backward
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, StorageWeakRef] = {}
        self.peak = 0
        self.op_counts: Counter[str] = Counter()

    def __enter__(self) -> LiveTensors:
        # Reference cycles are freed whenever the collector happens to run, which would make
        # the count depend on timing: pause it, and collect only where live_bytes is asked.
        self._collector_was_enabled = gc.isenabled()
        gc.disable()
        return super().__enter__()

    def __exit__(self, *exc_info: object) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            if self._collector_was_enabled:
                gc.enable()

    def live_bytes(self) -> int:
        """Bytes of the storages created inside the block that are alive now.

        Cyclic garbage is collected first. gloo marks a collective done before its worker
        thread drops the tensors it holds (which may need the GIL), so the count is read again,
        the GIL released in between, until two readings agree.
        """
        gc.collect()
        now = self._alive()
        for _ in range(_SETTLE_READS):
            time.sleep(0.001)
            again = self._alive()
            if again == now:
                break
            now = again
        return now

    def _alive(self) -> int:
        for key in [k for k, ref in self._storages.items() if ref.expired()]:
            del self._storages[key]
        # Read each size now: FSDP2 frees and refills its unsharded parameters by resizing their
        # storages (to 0 bytes and back), which no operator reports.
        return sum(torch.UntypedStorage._new_with_weak_ptr(key).nbytes() for key in self._storages)

    def reset_peak(self) -> int:
        """Start a new peak from what is alive now; returns that."""
        self.peak = self.live_bytes()
        return self.peak

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        self.op_counts[str(func)] += 1
        inputs = {_data_ptr(t) for t in tree_leaves((args, kwargs))}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            pointer = _data_ptr(tensor)
            # A view or an in-place result shares an input's storage; an empty storage
            # (address 0) may still be resized later, as FSDP2 does, so it is kept.
            if pointer is None or (pointer and pointer in inputs):
                continue
            storage = tensor.untyped_storage()
            ref = StorageWeakRef(storage)
            self._storages.setdefault(ref.cdata, ref)
        self.peak = max(self.peak, self._alive())
        return out


class SavedActivations:
    """The peak bytes autograd saved for backward inside a module's forward: its activations.

    Each tensor saved in the forward is noted by weak reference, so nothing lives longer than
    autograd keeps it; at the end of each forward the bytes still alive (each storage once; an
    earlier forward's too while its backward has not run) update :attr:`peak`.

    Not counted: the module's parameters and buffers, tensors saved outside its forward (the
    loss function's), saved tensors an inner ``saved_tensors_hooks`` handles (activation
    checkpointing), and operators' workspaces. The batch counts when a layer saves it, and so
    do autocast's low-precision copies of the weights.

    Args:
        module: the model whose forward to watch (a ``DistributedDataParallel`` wrapper works).

    Example:
        >>> watch = SavedActivations(model)
        >>> model(x).sum().backward()
        >>> watch.peak  # bytes saved for backward at the end of forward
        >>> watch.remove()
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.peak = 0
        self._saved: list[weakref.ref] = []
        self._excluded: set[int] = set()
        self._contexts: list[torch.autograd.graph.saved_tensors_hooks] = []
        self._handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def live_bytes(self) -> int:
        """Bytes of the storages autograd still holds for backward now, each counted once."""
        self._saved = [ref for ref in self._saved if ref() is not None]
        sizes = {}
        for ref in self._saved:
            storage = _storage(ref())
            if storage is not None:
                sizes[storage.data_ptr()] = storage.nbytes()
        return sum(sizes.values())

    def reset_peak(self) -> None:
        """Start the peak again from zero (mgtutor does it when each call's fn starts)."""
        self.peak = 0

    def remove(self) -> None:
        """Take the hooks off the module."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, module: torch.nn.Module, args: object) -> None:
        if not self._contexts:  # the outermost forward: what the module holds is not saved
            state = list(module.parameters()) + list(module.buffers())
            self._excluded = {s.data_ptr() for s in map(_storage, state) if s is not None}
        context = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        context.__enter__()
        self._contexts.append(context)

    def _exit(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self._contexts:
            self._contexts.pop().__exit__(None, None, None)
        if not self._contexts:
            self.peak = max(self.peak, self.live_bytes())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        root = tensor._base if tensor._base is not None else tensor
        # A detached alias: the same storage, without a reference back to the graph that holds
        # it. Autograd keeps the alias until backward is done with it: a weak reference to the
        # alias (not to the storage, which the caller may hold too) says while it does.
        alias = tensor.detach()
        if isinstance(root, torch.nn.Parameter) or tensor.layout != torch.strided:
            return alias
        storage = _storage(tensor)
        if storage is not None and storage.data_ptr() not in self._excluded:
            self._saved.append(weakref.ref(alias))
        return alias


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _storage(tensor: torch.Tensor | None) -> torch.UntypedStorage | None:
    """The storage of a tensor's data on this rank (a DTensor's local shard's), or None."""
    if tensor is None:
        return None
    local = getattr(tensor, "_local_tensor", None)
    try:
        storage = (local if local is not None else tensor).untyped_storage()
        storage.data_ptr()
    except RuntimeError:  # a wrapper subclass with no storage of its own
        return None
    return storage


def _data_ptr(tensor: object) -> int | None:
    """The address of a tensor's storage; None for a non-tensor or a tensor without one."""
    if not isinstance(tensor, torch.Tensor):
        return None
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor with no storage of its own (a wrapper subclass)
        return None


def kept_for_backward(
    layer: GPTLayer, x: torch.Tensor, recompute: str = "none"
) -> tuple[int, dict[str, int]]:
    """Bytes one forward of ``layer`` keeps for backward, measured, then its backward run.

    Measured in :class:`LiveTensors` on a copy of ``x`` (in a step the input is made by the
    previous layer), with the output's sum as the loss, whose own bytes are left out.

    Args:
        layer: a :class:`~mgtutor.parallel.gpt_layer.GPTLayer` or
            :class:`~mgtutor.parallel.gpt_layer.ParallelGPTLayer` in training mode.
        x: the input, (batch, sequence, hidden), or this rank's share of the sequence.
        recompute: "none"; "selective" (the attention core checkpointed); "full" (the whole
            layer checkpointed, ``torch.utils.checkpoint``, non-reentrant).

    Returns:
        The bytes kept, and (without recomputation) the bytes by the paper's terms
        (:func:`~mgtutor.parallel.gpt_layer.kept_by_term`); ``{}`` otherwise, since reading a
        checkpointed graph's saved tensors would recompute them.
    """
    layer.checkpoint_core = recompute == "selective"
    try:
        with LiveTensors() as live:
            copy_of_x = x.clone()
            if recompute == "full":
                y = torch.utils.checkpoint.checkpoint(layer, copy_of_x, use_reentrant=False)
            else:
                y = layer(copy_of_x)
            loss = y.sum()
            del y, copy_of_x
            kept = live.live_bytes() - loss.untyped_storage().nbytes()
            terms = kept_by_term(layer, loss) if recompute == "none" else {}
            loss.backward()
    finally:
        layer.checkpoint_core = False
    return kept, terms
