"""The shape of a decoder-only transformer, as the planner's formulas need it.

:class:`Transformer` holds layers, hidden size, heads, sequence length, micro-batch, MLP width
and vocabulary, and counts parameters from them (GPT-2's layer) or takes the count as given; its
``style`` says which parameters tensor parallelism keeps whole. :mod:`mgtutor.plan.planner`,
:mod:`mgtutor.plan.step_time` and :mod:`mgtutor.experiments.traffic` take it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Transformer"]


@dataclass(frozen=True)
class Transformer:
    """The shape of a decoder-only transformer, as the formulas need it.

    The parameter count, unless given, is the one of :class:`mgtutor.parallel.tensor.Block`
    (GPT-2's layer): per layer q, k, v and output projections with biases (4h² + 4h), an MLP
    of width ``ffn`` with biases (2h·ffn + ffn + h) and two LayerNorms (4h); plus a tied
    embedding of ``vocab`` x h. Position embeddings and the final norm are left out.
    ``style`` says which parameters tensor parallelism keeps whole (:attr:`replicated_per_layer`).

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
        style: "gpt" (LayerNorms with biases, linear layers with biases) or "llama" (RMSNorm
            weights, no biases; needs ``params``).
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    micro_batch: int = 1
    ffn: int | None = None
    vocab: int = 0
    params: int | None = None
    style: Literal["gpt", "llama"] = "gpt"

    def __post_init__(self) -> None:
        if self.style not in ("gpt", "llama"):
            raise ValueError(f"style must be 'gpt' or 'llama', got {self.style!r}")
        if self.style == "llama" and self.params is None:
            raise ValueError("a llama-style model needs params: its count is not GPT-2's")

    @property
    def embedding(self) -> int:
        """Parameters of the (tied) token embedding: V·h."""
        return self.vocab * self.hidden

    @property
    def replicated_per_layer(self) -> int:
        """Parameters tensor parallelism keeps whole on every rank (Megatron-LM's split): GPT's
        two LayerNorms (weight and bias) and two row-parallel biases, 6h; Llama's two RMSNorm
        weights, 2h."""
        return (6 if self.style == "gpt" else 2) * self.hidden

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
