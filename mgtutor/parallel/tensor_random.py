"""Dropout's random numbers under tensor and sequence parallelism: Megatron-LM's two RNG states.

Ranks of a tensor-parallel group that hold the same activation must drop the same elements, or
their copies drift apart; ranks that hold different data (their own heads, or their own tokens
under sequence parallelism) must draw independent masks. So, as in Megatron-LM
(``megatron/core/tensor_parallel/random.py``), the default generator is seeded alike on every
rank, and each rank's own state, an :class:`RNGStatesTracker`, is forked into where data differ.
:func:`model_parallel_seed` seeds both; :class:`mgtutor.parallel.gpt_layer.GPTLayer` takes a
tracker as ``rng``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mgtutor.parallel.comms import in_backward

__all__ = ["TENSOR_PARALLEL_OFFSET", "RNGStatesTracker", "model_parallel_seed"]

#: Megatron-LM's offset of the tensor-parallel seed from the default one ("2718 is just for fun").
TENSOR_PARALLEL_OFFSET = 2718


class RNGStatesTracker:
    """A random-number state of its own, swapped in for the default one inside :meth:`fork`.

    Args:
        seed: the state's seed (``seed + 2718 + tp_rank`` in Megatron-LM).
        device: whose generator to fork: "cpu" or a CUDA device.

    Example:
        >>> tracker = RNGStatesTracker(2718 + rank)
        >>> with tracker.fork():
        ...     probs = torch.nn.functional.dropout(probs, 0.1)  # this rank's own mask
    """

    def __init__(self, seed: int, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or a CUDA device, got {str(self.device)!r}")
        generator = torch.Generator(self.device)
        generator.manual_seed(seed)
        self.state = generator.get_state()
        self._replaying = 0  # > 0 inside checkpoint_contexts' recomputation

    def _get(self) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.get_rng_state()
        return torch.cuda.get_rng_state(self.device)

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, self.device)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Draw from this state inside the block; the default state is as it was after it.

        Raises:
            RuntimeError: inside autograd's backward (a checkpoint's recomputation) unless
                the checkpoint was given :meth:`checkpoint_contexts`: the recomputation would
                draw the state's next numbers, not the ones forward drew.
        """
        if not self._replaying and in_backward():  # a recomputation runs in backward
            raise RuntimeError(
                "the tracked random state was forked during backward, as a checkpoint "
                "recomputes: it would draw new dropout masks, not forward's. Pass "
                "context_fn=tracker.checkpoint_contexts to torch.utils.checkpoint.checkpoint "
                "(use_reentrant=False), which replays the tracked state as Megatron-LM's "
                "CheckpointFunction does"
            )
        default = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(default)

    def checkpoint_contexts(
        self,
    ) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
        """The two contexts ``torch.utils.checkpoint.checkpoint``'s ``context_fn`` returns.

        ``torch.utils.checkpoint`` restores only the default state for a recomputation. With
        these, the tracked state noted before the checkpointed forward is swapped in for its
        recomputation, so that every fork redraws forward's numbers, and the state found is put
        back afterwards (as Megatron-LM's ``CheckpointFunction`` does with its tracker's states).

        Example:
            >>> y = torch.utils.checkpoint.checkpoint(
            ...     layer, x, use_reentrant=False, context_fn=layer.rng.checkpoint_contexts)
        """
        noted: list[torch.Tensor] = []

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            noted.append(self.state)  # fork() replaces self.state; it never writes into it
            yield

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            found = self.state
            self.state, self._replaying = noted[0], self._replaying + 1
            try:
                yield
            finally:
                self.state, self._replaying = found, self._replaying - 1

        return forward(), recompute()


def model_parallel_seed(
    seed: int, tp_rank: int, device: str | torch.device = "cpu"
) -> RNGStatesTracker:
    """Seed the default generator with ``seed`` and return the tracker of ``seed + 2718 + tp_rank``.

    Call it on every rank of a tensor-parallel group with the same ``seed`` (Megatron-LM's
    ``model_parallel_cuda_manual_seed``): replicated regions then draw alike, forked ones not.
    """
    torch.manual_seed(seed)
    return RNGStatesTracker(seed + TENSOR_PARALLEL_OFFSET + tp_rank, device)
