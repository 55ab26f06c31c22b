"""One GPU's compute in a step: each matrix product at its sharded shape, the memory-bound
operations between them, and the FLOP counts MFU and HFU divide.

A :class:`Device` runs a matrix product (``rows x inner`` times ``inner x cols``) either at a rate
measured at that shape (CPU ranks: :mod:`mgtutor.experiments.step_calibrate` measures them) or,
for a GPU, in ``max(waves x one wave of tiles at the ceiling rate, bytes / memory bandwidth)``: the
output is cut into tiles (256 x 128 elements, the largest tile cuBLAS uses), each streaming
multiprocessor computes one tile at a time, so a product whose tiles do not fill the last wave
pays for a whole wave (NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799-001,
2023, sections 2.3 and 3.2: tile and wave quantization); a product too small to be compute-bound
runs at the memory's speed. The ceiling is the fastest large product measured on that GPU (a
published benchmark), never the datasheet peak, which no product reaches.

Between the products a layer runs memory-bound operations (norms, softmax, GeLU, dropout,
residual adds). Each reads and writes its elements; :data:`ELEMENTWISE` counts the bytes per
element forward and backward for Megatron-LM's fused kernels (scale-mask-softmax, bias-GeLU,
bias-dropout-add), and a GPU runs them at its memory bandwidth; CPU ranks at seconds per element
measured per kind.

:func:`flops_per_token` gives the FLOPs a step does per token under each published convention,
so that an MFU or HFU is stated with the convention it was computed under.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mgtutor.plan.activation_plan import ELEMENT_BYTES

if TYPE_CHECKING:
    from mgtutor.plan.activation_plan import Recompute
    from mgtutor.plan.shape import Transformer

__all__ = [
    "CONVENTIONS",
    "ELEMENTWISE",
    "Device",
    "LayerTimes",
    "compute_flops",
    "flops_per_token",
    "gemm_seconds",
    "layer_times",
    "logits_times",
    "matrix_params_per_layer",
    "product_shapes",
]

#: Bytes per element each memory-bound operation reads and writes, (forward, backward), in
#: units of one activation element (2 bytes in bf16); a dropout also writes (forward) and reads
#: (backward) a 1-byte mask. A norm reads x, writes y; its backward reads x and dy, writes dx.
ELEMENTWISE: dict[str, tuple[int, int]] = {
    "layernorm": (2, 3),
    "residual": (3, 3),
    "dropout": (2, 2),
    "softmax": (2, 3),
    "gelu": (2, 3),
}

#: FLOP conventions of :func:`flops_per_token`, with what each counts.
CONVENTIONS: dict[str, str] = {
    "model": "6N + 12·L·s·h per token: every parameter (the tied embedding as the output layer), "
    "causal attention counted in full, no recomputation (mgtutor's; PaLM's MFU with N all "
    "parameters)",
    "torchtitan": "6·(N - V·h) + 12·L·s·h: parameters less the input embedding "
    "(torchtitan's get_num_flop_per_token at 9dec370)",
    "megatron": "Narayanan et al. 2021 eq. 3, 96·B·s·L·h²(1 + s/(6h) + V/(16·L·h)) per batch: "
    "with full recomputation (their 'achieved teraFLOP/s'), for layers of 12h² parameters",
}


@dataclass(frozen=True)
class Device:
    """One GPU (or CPU rank) as its compute needs describing; each figure measured or quoted.

    Attributes:
        name: what it is.
        peak: the datasheet's dense FLOP/s by precision ("mixed" = bf16/fp16, "fp8", "fp32"):
            the denominator of MFU and HFU, never a rate the model runs at.
        ceiling: the fastest matrix product measured on the device by precision (a published
            benchmark): the rate of a large product whose tiles fill every wave.
        memory_bandwidth: bytes/s of its memory (datasheet); None: not modelled.
        sms: streaming multiprocessors (tiles computed at once); 0: no wave quantization.
        tile: the output tile one multiprocessor computes, rows x cols.
        gemm_rates: FLOP/s measured at shapes (rows, inner, cols), used where given (CPU ranks).
        elementwise: seconds per element of each kind of :data:`ELEMENTWISE`, forward and
            backward together, measured (CPU ranks); where empty, bytes / memory bandwidth.
        source: where each figure comes from.
    """

    name: str
    peak: dict[str, float] = field(default_factory=dict)
    ceiling: dict[str, float] = field(default_factory=dict)
    memory_bandwidth: float | None = None
    sms: int = 0
    tile: tuple[int, int] = (256, 128)
    gemm_rates: dict[tuple[int, int, int], float] = field(default_factory=dict)
    elementwise: dict[str, float] = field(default_factory=dict)
    source: str = ""


def _nearest(rates: dict[tuple[int, int, int], float], shape: tuple[int, int, int]) -> float:
    if shape in rates:
        return rates[shape]
    distance = {s: sum(abs(math.log(a / b)) for a, b in zip(s, shape)) for s in rates}
    return rates[min(distance, key=distance.__getitem__)]


def gemm_seconds(
    device: Device, precision: str, rows: int, inner: int, cols: int, count: float = 1
) -> float:
    """Seconds for a batch of ``count`` products of (rows x inner) @ (inner x cols) on
    ``device`` (a batched product's tiles fill the waves together).

    Raises:
        KeyError: the device has neither a measured rate nor a ceiling for ``precision``.
    """
    flops = 2.0 * rows * inner * cols * count
    if device.gemm_rates:
        return flops / _nearest(device.gemm_rates, (rows, inner, cols))
    ceiling = device.ceiling[precision]
    compute = flops / ceiling
    if device.sms:
        tm, tn = min(device.tile[0], rows), min(device.tile[1], cols)  # no tile past the matrix
        tiles = math.ceil(rows / tm) * math.ceil(cols / tn) * count
        compute = math.ceil(tiles / device.sms) * device.sms * 2.0 * tm * tn * inner / ceiling
    memory = 0.0
    if device.memory_bandwidth:
        element = ELEMENT_BYTES.get(precision, 1 if precision == "fp8" else 2)
        moved = element * (rows * inner + inner * cols + rows * cols) * count
        memory = moved / device.memory_bandwidth
    return max(compute, memory)


def _elementwise_seconds(
    device: Device, elements: dict[str, float], precision: str, forward_only: bool = False
) -> float:
    """Seconds of the memory-bound operations, forward and backward (or forward alone)."""
    if device.elementwise:  # measured per element, forward and backward together
        total = 0.0
        for kind, n in elements.items():
            forward, backward = ELEMENTWISE[kind]  # the forward's share, by bytes
            share = forward / (forward + backward) if forward_only else 1.0
            total += n * device.elementwise.get(kind, 0.0) * share
        return total
    if not device.memory_bandwidth:
        return 0.0
    e = ELEMENT_BYTES.get(precision, 2)
    total = 0.0
    for kind, n in elements.items():
        forward, backward = ELEMENTWISE[kind]
        mask = 1 if kind == "dropout" else 0
        total += n * ((forward * e + mask) + (0 if forward_only else backward * e + mask))
    return total / device.memory_bandwidth


def matrix_params_per_layer(model: Transformer) -> tuple[float, float]:
    """(attention, MLP) weight parameters of one layer: GPT's 4h² and 2h·ffn; a llama-style
    model's MLP is gated (3h·ffn), its attention the rest of its count less two norms, with the
    output layer untied (its V·h not in the layers)."""
    h, ffn = model.hidden, model.ffn or 4 * model.hidden
    if getattr(model, "style", "gpt") == "llama" and model.params is not None:
        layer = (model.params - 2 * model.embedding) / model.layers - 2 * h
        return layer - 3 * h * ffn, 3.0 * h * ffn
    return 4.0 * h * h, 2.0 * h * ffn


def product_shapes(
    model: Transformer, tp: int = 1
) -> tuple[list[tuple[int, int, int, float]], ...]:
    """One layer's forward products on one of ``tp`` GPUs, each (rows, inner, cols, count):
    the column-parallel ones (q-k-v, fc1; a gated MLP's two), the row-parallel ones (the
    projection, fc2), and the attention core's two batched products (count: b·a/t). The backward
    runs each as (rows, cols, inner) for the input gradient and (inner, rows, cols) for the
    weight gradient."""
    b, s, h, a = model.micro_batch, model.seq_len, model.hidden, model.heads
    ffn, tokens, d = model.ffn or 4 * h, b * s, h // a
    attn_params, mlp_params = matrix_params_per_layer(model)
    qkv_cols = max(int((attn_params - h * h) / h) // tp, 1)
    gated = mlp_params > 2.5 * h * ffn
    first: list[tuple[int, int, int, float]] = [
        (tokens, h, qkv_cols, 1),
        (tokens, h, ffn // tp, 2 if gated else 1),
    ]
    second: list[tuple[int, int, int, float]] = [(tokens, h // tp, h, 1), (tokens, ffn // tp, h, 1)]
    heads = b * a / tp
    return first, second, [(s, d, s, heads), (s, s, d, heads)]  # q kᵀ, then scores times v


@dataclass(frozen=True)
class LayerTimes:
    """Seconds of one layer's work for one micro-batch on one GPU, by kind.

    ``matmul``/``memory`` are forward + backward; ``recompute_*`` what recomputation adds;
    ``wgrad_first`` the weight gradients of the column-parallel linears (q-k-v and fc1), which
    Megatron-LM overlaps with the backward all-reduce of their input's gradient;
    ``dgrad_first`` their input gradients (what sequence parallelism's all-gather overlaps);
    ``forward_matmul`` the forward products (what AsyncTP overlaps the forward collectives with).
    """

    matmul: float
    memory: float
    recompute_matmul: float
    recompute_memory: float
    forward: float
    wgrad_first: float
    dgrad_first: float
    forward_matmul: float


def layer_times(
    model: Transformer,
    device: Device,
    precision: str,
    tp: int = 1,
    *,
    sequence_parallel: bool = False,
    recompute: Recompute = "none",
    attention: str = "unfused",
    dropout: bool = True,
) -> LayerTimes:
    """One transformer layer's compute for one micro-batch of ``model`` on one of ``tp`` GPUs.

    The linears are Megatron-LM's split: q-k-v and fc1 by columns (``3h/t``, ``ffn/t``), the
    output projection and fc2 by rows; attention runs ``a/t`` heads; norms, residual adds and
    the dropouts after each block stay whole on every GPU (split by ``tp`` with sequence
    parallelism). ``attention="flash"``: the s x s scores are never written to memory (no
    softmax or dropout on them) and the backward recomputes them (one product more).
    """
    b, s, h, a = model.micro_batch, model.seq_len, model.hidden, model.heads
    ffn, tokens = model.ffn or 4 * h, b * s
    first, second, core = product_shapes(model, tp)
    gated = first[1][3] == 2
    heads = b * a / tp

    def fwd(shapes: list[tuple[int, int, int, float]]) -> float:
        return sum(gemm_seconds(device, precision, r, k, c, n) for r, k, c, n in shapes)

    def dgrad(shapes: list[tuple[int, int, int, float]]) -> float:
        return sum(gemm_seconds(device, precision, r, c, k, n) for r, k, c, n in shapes)

    def wgrad(shapes: list[tuple[int, int, int, float]]) -> float:
        return sum(gemm_seconds(device, precision, k, r, c, n) for r, k, c, n in shapes)

    core_f = fwd(core)
    core_b = dgrad(core) + wgrad(core) + (fwd(core[:1]) if attention == "flash" else 0.0)
    forward_matmul = fwd(first) + fwd(second) + core_f
    matmul = forward_matmul + dgrad(first + second) + wgrad(first + second) + core_b
    whole = tokens * h / (tp if sequence_parallel else 1)
    elements = {
        "layernorm": 2.0 * whole,
        "residual": 2.0 * whole,
        "dropout": (2.0 * whole if dropout else 0.0),
        "gelu": tokens * ffn / tp * (2 if gated else 1),  # gated: the activation and the product
    }
    scores = {"softmax": heads * s * s, "dropout": heads * s * s if dropout else 0.0}
    if attention != "flash":
        elements = {k: elements.get(k, 0.0) + scores.get(k, 0.0) for k in {*elements, *scores}}
    memory = _elementwise_seconds(device, elements, precision)
    forward = forward_matmul + _elementwise_seconds(device, elements, precision, True)
    recompute_matmul = recompute_memory = 0.0
    if recompute == "full":
        recompute_matmul = forward_matmul
        recompute_memory = forward - forward_matmul
    elif recompute == "selective":
        recompute_matmul = core_f
        if attention != "flash":
            recompute_memory = _elementwise_seconds(device, scores, precision, True)
    return LayerTimes(
        matmul=matmul,
        memory=memory,
        recompute_matmul=recompute_matmul,
        recompute_memory=recompute_memory,
        forward=forward,
        wgrad_first=wgrad(first),
        dgrad_first=dgrad(first),
        forward_matmul=forward_matmul,
    )


def logits_times(
    model: Transformer, device: Device, precision: str, tp: int = 1
) -> tuple[float, float, float, float]:
    """Seconds of the output layer and its loss for one micro-batch: (forward product, backward
    products, forward loss, backward loss). The product is (b·s x h) @ (h x V/t); the loss a
    float32 softmax over V/t per token."""
    if not model.vocab:
        return 0.0, 0.0, 0.0, 0.0
    tokens, h, cols = model.micro_batch * model.seq_len, model.hidden, model.vocab // tp
    forward = gemm_seconds(device, precision, tokens, h, cols)
    backward = gemm_seconds(device, precision, tokens, cols, h) + gemm_seconds(
        device, precision, h, tokens, cols
    )
    softmax = {"softmax": float(tokens * cols)}
    loss_f = _elementwise_seconds(device, softmax, "fp32", True)
    return forward, backward, loss_f, _elementwise_seconds(device, softmax, "fp32") - loss_f


def compute_flops(model: Transformer, tokens: int, recompute: Recompute = "none") -> float:
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


def flops_per_token(model: Transformer, convention: str = "model") -> float:
    """FLOPs per token of one training step under ``convention`` (:data:`CONVENTIONS`).

    Raises:
        ValueError: an unknown convention.
    """
    attention = 12.0 * model.layers * model.seq_len * model.hidden
    if convention == "model":
        return 6.0 * model.total + attention
    if convention == "torchtitan":
        return 6.0 * (model.total - model.embedding) + attention
    if convention == "megatron":
        h, L, s, V = model.hidden, model.layers, model.seq_len, model.vocab
        return 96.0 * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    raise ValueError(f"convention must be one of {sorted(CONVENTIONS)}, got {convention!r}")
