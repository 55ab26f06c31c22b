"""Bytes of activations one transformer layer keeps for backward, term by term (Korthikanti et al.).

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198, section 4.1, count what a GPT layer keeps for backward, in bytes for 16-bit
activations and 1-byte dropout masks:

* attention, 11sbh + 5as²b: the q-k-v projection's input 2sbh; q and k for qkᵀ 4sbh; the
  softmax's output 2as²b; its dropout mask as²b; for the product with v the dropped-out scores
  2as²b and v 2sbh; the output projection's input 2sbh; the dropout mask after it sbh;
* MLP, 19sbh: the first linear's input 2sbh; the GeLU's input 8sbh; the second linear's input
  (the GeLU's output) 8sbh; the dropout mask sbh;
* the two layer norms' inputs, 4sbh.

That is sbh(34 + 5as/h) (table 2). With tensor parallelism of size t the layer norms' and
dropouts' inputs and each region's first input stay whole on every rank, 10sbh, and the rest
is split, sbh(10 + 24/t + 5as/(ht)); sequence parallelism splits the whole-kept part along the
sequence as well, sbh/t (34 + 5as/h). :func:`activation_terms` writes the count down term by
term with the bytes of an element (``precision``) and of a dropout-mask element
(``mask_bytes``) as parameters, so that a layer whose dtypes differ from the paper's can be
stated exactly; :func:`activation_bytes_per_layer` is their sum.

What the paper leaves out, and torch keeps: each LayerNorm's mean and reciprocal standard
deviation, one value per token each (``norm_stat_bytes``; 0 by default, as in the paper).
``tests/plan/test_activation_plan.py`` checks every term against what autograd saves in
:class:`mgtutor.parallel.gpt_layer.GPTLayer`, in one process and per rank on 2 CPU ranks.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = [
    "ACTIVATIONS_SOURCE",
    "ELEMENT_BYTES",
    "PAPER_TERMS",
    "Recompute",
    "activation_bytes_per_layer",
    "activation_terms",
]

#: Bytes of one activation element by the planner's precision (16-bit under "mixed").
ELEMENT_BYTES: dict[str, int] = {"mixed": 2, "fp32": 4, "mixed_fp32_grads": 2}
_RECOMPUTE = ("none", "selective", "full")
#: What the backward recomputes: nothing, the attention core (Korthikanti et al.), every layer.
Recompute = Literal["none", "selective", "full"]

ACTIVATIONS_SOURCE = (
    "Korthikanti et al. 2022, arXiv:2205.05198, table 2: sbh(34 + 5as/h) per layer; "
    "sbh(10 + 24/t + 5as/(ht)) with tensor parallelism; sbh/t (34 + 5as/h) with sequence "
    "parallelism too"
)

#: Each term as the paper writes it (section 4.1, 16-bit activations, 1-byte masks, ffn = 4h).
PAPER_TERMS: dict[str, str] = {
    "layer norm inputs": "4sbh",
    "qkv input": "2sbh",
    "q and k": "4sbh",
    "softmax output": "2as²b",
    "softmax dropout mask": "as²b",
    "scores after dropout": "2as²b",
    "v": "2sbh",
    "projection input": "2sbh",
    "fc1 input": "2sbh",
    "gelu input": "8sbh",
    "fc2 input": "8sbh",
    "residual dropout masks": "2sbh",
}
_SCORES = ("softmax output", "softmax dropout mask", "scores after dropout")


def activation_terms(
    model: Any,
    tp: int = 1,
    sequence_parallel: bool = False,
    precision: str = "mixed",
    recompute: Recompute = "none",
    *,
    mask_bytes: int = 1,
    norm_stat_bytes: int = 0,
    keep_gathered: bool = False,
) -> dict[str, int]:
    """Bytes one layer keeps for backward per micro-batch, by term, on one rank.

    Args:
        model: the shape (:class:`mgtutor.plan.shape.Transformer`: ``seq_len`` s,
            ``micro_batch`` b, ``hidden`` h, ``heads`` a, ``ffn``, 4h by default).
        tp: tensor-parallel size t.
        sequence_parallel: Megatron's sequence parallelism with ``tp``.
        precision: "mixed" (2-byte activations) or "fp32" (4-byte).
        recompute: "none"; "selective" (the attention core is recomputed: its three s x s
            terms go); "full" (only the layer's input is kept, whole or, with sequence
            parallelism, this rank's share).
        mask_bytes: bytes of a dropout-mask element: 1 for a ``bool`` mask (the paper's;
            ``torch.native_dropout``), the activation's bytes for a mask of its dtype
            (``torch.nn.functional.dropout`` on CPU).
        norm_stat_bytes: bytes of a LayerNorm's saved mean and reciprocal standard deviation
            elements; 0 leaves them out, as the paper does.
        keep_gathered: under sequence parallelism, the q-k-v and fc1 inputs are kept whole
            (all-gathered) rather than as this rank's shard (``ParallelGPTLayer``'s option).

    Returns:
        Term name to bytes; :data:`PAPER_TERMS` holds the paper's figure for each, plus
        "layer norm statistics" when ``norm_stat_bytes`` is given, or only "layer input" under
        full recomputation.
    """
    if recompute not in _RECOMPUTE:
        raise ValueError(f"recompute must be one of {_RECOMPUTE}, got {recompute!r}")
    if precision not in ELEMENT_BYTES:
        raise ValueError(f"precision must be one of {sorted(ELEMENT_BYTES)}, got {precision!r}")
    e, m = ELEMENT_BYTES[precision], mask_bytes
    s, b, h, a = model.seq_len, model.micro_batch, model.hidden, model.heads
    sbh, sbf, scores = s * b * h, s * b * (model.ffn or 4 * h), a * s * s * b
    whole = tp if sequence_parallel else 1  # what plain tensor parallelism keeps whole
    entry = 1 if keep_gathered else whole  # each region's first input
    if recompute == "full":
        return {"layer input": e * sbh // whole}
    terms = {  # bytes on one process, and what divides them on a rank
        "layer norm inputs": (2 * e * sbh, whole),
        "qkv input": (e * sbh, entry),
        "q and k": (2 * e * sbh, tp),
        "softmax output": (e * scores, tp),
        "softmax dropout mask": (m * scores, tp),
        "scores after dropout": (e * scores, tp),
        "v": (e * sbh, tp),
        "projection input": (e * sbh, tp),
        "fc1 input": (e * sbh, entry),
        "gelu input": (e * sbf, tp),
        "fc2 input": (e * sbf, tp),
        "residual dropout masks": (2 * m * sbh, whole),
    }
    if norm_stat_bytes:
        terms["layer norm statistics"] = (2 * 2 * s * b * norm_stat_bytes, whole)
    if recompute == "selective":
        terms = {name: term for name, term in terms.items() if name not in _SCORES}
    return {name: nbytes // divisor for name, (nbytes, divisor) in terms.items()}


def activation_bytes_per_layer(
    model: Any,
    tp: int = 1,
    sequence_parallel: bool = False,
    precision: str = "mixed",
    recompute: Recompute = "none",
    *,
    mask_bytes: int = 1,
    norm_stat_bytes: int = 0,
    keep_gathered: bool = False,
) -> int:
    """Bytes of activations one layer keeps for backward, per micro-batch (Korthikanti et al.).

    The sum of :func:`activation_terms` (same arguments). With the defaults, table 2 of
    arXiv:2205.05198: sbh(34 + 5as/h) without parallelism, sbh(10 + 24/t + 5as/(ht)) with
    tensor parallelism of size t, sbh/t (34 + 5as/h) with sequence parallelism as well;
    ``recompute="selective"`` drops 5as/h (flash attention keeps no scores either), ``"full"``
    keeps 2sbh (2sbh/t with sequence parallelism). "fp32" doubles every activation but not the
    1-byte masks: 66sbh + 9as²b.
    """
    return sum(
        activation_terms(
            model,
            tp,
            sequence_parallel,
            precision,
            recompute,
            mask_bytes=mask_bytes,
            norm_stat_bytes=norm_stat_bytes,
            keep_gathered=keep_gathered,
        ).values()
    )
