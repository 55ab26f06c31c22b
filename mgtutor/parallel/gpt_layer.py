"""A Megatron-style GPT layer whose tensors kept for backward are the ones Korthikanti et al. count.

Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198, section 4.1) count what one transformer layer keeps for backward as 34sbh +
5as²b bytes (16-bit activations, 1-byte dropout masks). :class:`GPTLayer` is written so that
autograd saves exactly those tensors, and nothing the paper leaves out except each LayerNorm's
mean and reciprocal standard deviation: one fused q-k-v projection (its input kept once),
attention written out (``baddbmm``, a causal bias added in place, ``softmax``, dropout, ``bmm``)
rather than ``scaled_dot_product_attention`` (whose CPU kernel keeps no s x s scores), an MLP of
GeLU between two linears, dropout after the attention and after the MLP.

Dropout keeps a mask for backward, and how big it is depends on how dropout is called:
``torch.native_dropout`` returns its mask as ``bool`` (1 byte an element) and saves it;
``torch.nn.functional.dropout`` on CPU multiplies by a noise tensor of the input's dtype and saves
that (4 bytes an element in float32). ``mask="bool"`` uses the first, ``mask="float"`` the second.

:class:`ParallelGPTLayer` splits a layer over the ranks of the default process group as
Megatron-LM does (heads and the MLP's width split, norms and dropouts whole), or with
``sequence_parallel=True`` the norms and dropouts on each rank's share of the sequence. Under
sequence parallelism the first linear of each region all-gathers its input; Korthikanti et al.
keep only the rank's shard for backward and all-gather it again there (:func:`gather_linear`),
``keep_gathered=True`` keeps the whole gathered input instead (as
:class:`mgtutor.parallel.tensor.ParallelBlock` does).

Given ``rng`` (a :class:`mgtutor.parallel.tensor_random.RNGStatesTracker`), both layers draw
dropout's random numbers as Megatron-LM does: the attention's dropout inside ``rng.fork()``,
the residual dropouts from the default generator, and under sequence parallelism the whole layer
inside ``rng.fork()``. ``dropout_masks``, set to a list, collects every mask drawn, in order.

:func:`saved_by_autograd` lists what autograd saved, by the operator that saved it, and
:func:`kept_by_term` names it by the paper's terms;
:func:`mgtutor.measure.activations.kept_for_backward` measures the bytes a layer keeps.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from mgtutor.parallel.tensor_comms import (
    all_gather_along,
    copy_to_parallel,
    gather_from_sequence,
    reduce_from_parallel,
    reduce_scatter_along,
    reduce_scatter_to_sequence,
)
from mgtutor.parallel.tensor_random import RNGStatesTracker

__all__ = [
    "GPTLayer",
    "ParallelGPTLayer",
    "gather_linear",
    "kept_by_term",
    "saved_by_autograd",
]

SEQUENCE_DIM = 1  # inputs are (batch, sequence, hidden)


class GPTLayer(nn.Module):
    """One pre-norm GPT layer of one process: ``x + drop(attn(ln1(x)))``, then the MLP's.

    Args:
        hidden: hidden size h.
        heads: attention heads a; must divide ``hidden``.
        ffn: the MLP's inner width; 4h by default.
        p: dropout probability (attention probabilities and both residual branches).
        mask: "bool" (``torch.native_dropout``: a 1-byte mask) or "float"
            (``torch.nn.functional.dropout``: on CPU a mask of the input's dtype).
        rng: the tracked random state the attention's dropout draws from (Megatron-LM's
            ``fork()``); None draws every mask from the default generator. To recompute
            the layer, give torch's checkpoint ``context_fn=rng.checkpoint_contexts``
            (``checkpoint_core`` does): it restores the default state only.
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        ffn: int | None = None,
        p: float = 0.1,
        mask: str = "bool",
        rng: RNGStatesTracker | None = None,
    ) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} must be a multiple of heads {heads}")
        if mask not in ("bool", "float"):
            raise ValueError(f"mask must be 'bool' or 'float', got {mask!r}")
        self.heads, self.p, self.mask, self.rng = heads, p, mask, rng
        self.sequence_parallel = False
        self.dropout_masks: list[torch.Tensor] | None = None  # a list: each mask drawn, appended
        ffn = ffn or 4 * hidden
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        # Rows of qkv run head by head, (q, k, v) inside each head, as Megatron-LM lays them out:
        # a rank's contiguous share of the rows is whole heads.
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.checkpoint_core = False  # True: recompute the attention core in backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.proj(self.attend(self.qkv(self.norm1(x)))))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.norm2(x)))))

    def dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout in training mode, keeping a 1-byte or an input-dtype mask (``mask``)."""
        if not self.training or self.p == 0:
            return x
        if self.mask == "float":
            if self.dropout_masks is not None:
                raise ValueError("dropout_masks records the masks of mask='bool' only")
            return F.dropout(x, self.p, training=True)
        out, kept = torch.native_dropout(x, self.p, True)
        if self.dropout_masks is not None:
            self.dropout_masks.append(kept)
        return out

    def forked(self, region: str) -> contextlib.AbstractContextManager[Any]:
        """``rng.fork()`` where Megatron-LM forks: ``region`` "attention" (the attention's
        dropout, its heads split) without sequence parallelism, "layer" (all of it) with it."""
        if self.rng is None or (region == "layer") != self.sequence_parallel:
            return contextlib.nullcontext()
        return self.rng.fork()

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """Attention of this module's heads, from the fused projection's output ``qkv``."""
        b, s, width = qkv.shape
        heads, d = self.heads, width // (3 * self.heads)

        def take(i: int) -> torch.Tensor:  # (batch x heads, sequence, head dim): one copy
            return qkv.view(b, s, heads, 3, d)[:, :, :, i].transpose(1, 2).reshape(b * heads, s, d)

        q, k, v = take(0), take(1), take(2)
        if self.checkpoint_core:
            if self.rng is not None:  # replay the dropout masks' random state on recompute
                core = torch.utils.checkpoint.checkpoint(
                    self.core,
                    q,
                    k,
                    v,
                    use_reentrant=False,
                    context_fn=self.rng.checkpoint_contexts,
                )
            else:
                core = torch.utils.checkpoint.checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            core = self.core(q, k, v)
        return core.view(b, heads, s, d).transpose(1, 2).reshape(b, s, heads * d)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q kᵀ / √d + causal), dropout, times v: what selective recomputation redoes."""
        s, d = q.shape[1], q.shape[2]
        scores = torch.baddbmm(
            q.new_empty(q.shape[0], s, s), q, k.transpose(1, 2), beta=0.0, alpha=1 / math.sqrt(d)
        )
        scores.add_(
            torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        )  # keeps nothing
        with self.forked("attention"):
            probs = self.dropout(F.softmax(scores, dim=-1))
        return torch.bmm(probs, v)


class _GatherLinear(torch.autograd.Function):
    """All-gather the sequence, then a linear; keeps only the shard, all-gathers it again in
    backward (Korthikanti et al., section 4.2.2), where the input's gradient is reduce-scattered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> Any:
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_along(x, SEQUENCE_DIM), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, weight = ctx.saved_tensors
        whole = all_gather_along(x, SEQUENCE_DIM)
        grad_x = reduce_scatter_along(grad @ weight, SEQUENCE_DIM)
        grad_weight = grad.flatten(0, -2).T @ whole.flatten(0, -2)
        return grad_x, grad_weight, grad.flatten(0, -2).sum(0)


def gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``F.linear`` of the all-gathered sequence, keeping only this rank's shard for backward.

    Forward: all-gather ``x`` along the sequence, then ``x @ weight.T + bias``. Backward:
    all-gather ``x`` again for the weight's gradient, and reduce-scatter the input's gradient.
    """
    return _GatherLinear.apply(x, weight, bias)


class ParallelGPTLayer(GPTLayer):
    """:class:`GPTLayer` split over the default group's ranks (tensor parallel), optionally with
    sequence parallelism.

    Rank r keeps heads r of the fused q-k-v projection (its rows) and of the output projection
    (its columns), rows r of ``fc1`` and columns r of ``fc2``; the row-parallel biases, the norms
    and the dropouts stay whole. With ``sequence_parallel`` the input and output are this rank's
    share of the sequence, and the replicated parameters' gradients are partial sums.

    Args:
        layer: the one-process layer to split (the same on every rank).
        sequence_parallel: split the norms and dropouts along the sequence.
        keep_gathered: under sequence parallelism, keep the whole all-gathered input of ``qkv``
            and ``fc1`` for backward instead of the shard.
        rng: this rank's tracked random state (:func:`.tensor_random.model_parallel_seed`).
    """

    def __init__(
        self,
        layer: GPTLayer,
        sequence_parallel: bool = False,
        keep_gathered: bool = False,
        rng: RNGStatesTracker | None = None,
    ) -> None:
        nn.Module.__init__(self)
        rank, world = dist.get_rank(), dist.get_world_size()
        if layer.heads % world:
            raise ValueError(f"{layer.heads} heads cannot be split evenly over {world} ranks")
        self.heads, self.p, self.mask, self.rng = layer.heads // world, layer.p, layer.mask, rng
        self.dropout_masks = None
        self.sequence_parallel, self.keep_gathered = sequence_parallel, keep_gathered
        self.checkpoint_core = layer.checkpoint_core
        self.norm1, self.norm2 = copy.deepcopy(layer.norm1), copy.deepcopy(layer.norm2)
        self.qkv = _split(layer.qkv, 0, rank, world)
        self.proj = _split(layer.proj, 1, rank, world)
        self.fc1 = _split(layer.fc1, 0, rank, world)
        self.fc2 = _split(layer.fc2, 1, rank, world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.forked("layer"):
            x = x + self.dropout(
                self._leave(self.proj, self.attend(self._enter(self.qkv, self.norm1(x))))
            )
            hidden = F.gelu(self._enter(self.fc1, self.norm2(x)))
            return x + self.dropout(self._leave(self.fc2, hidden))

    def _enter(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return linear(copy_to_parallel(x))
        if self.keep_gathered:
            return linear(gather_from_sequence(x, SEQUENCE_DIM))
        return gather_linear(x, linear.weight, linear.bias)

    def _leave(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, linear.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(partial, SEQUENCE_DIM) + linear.bias
        return reduce_from_parallel(partial) + linear.bias


def _split(linear: nn.Linear, dim: int, rank: int, world: int) -> nn.Linear:
    """A copy of ``linear`` keeping piece ``rank`` of its weight along ``dim`` (0: rows, with the
    bias; 1: columns, the bias whole)."""
    out_features, in_features = linear.weight.shape
    part = nn.Linear(
        in_features // world if dim else in_features,
        out_features // world if not dim else out_features,
    )
    with torch.no_grad():
        part.weight.copy_(linear.weight.chunk(world, dim)[rank])
        part.bias.copy_(linear.bias if dim else linear.bias.chunk(world)[rank])
    return part


def saved_by_autograd(output: torch.Tensor) -> list[dict[str, Any]]:
    """Every tensor autograd saved to compute ``output``'s gradients, by the node that saved it.

    Walks the graph from ``output.grad_fn`` and reads each node's ``_saved_*`` attributes (and a
    custom function's ``saved_tensors``). Parameters and other leaves appear too. Do not call it
    on a graph with checkpointed parts: reading a saved tensor there recomputes it.

    Returns:
        One dict per saved tensor: ``node`` (e.g. ``"BmmBackward0"``), ``index`` (the node's
        place in the walk, the same for tensors one node saved), ``after`` (the names of the
        nodes that made its inputs), ``name`` (e.g. ``"_saved_self"``), ``shape``, ``dtype``,
        ``nbytes`` (its storage's) and ``storage`` (the storage's address: tensors that share
        one share their bytes).
    """
    found, seen, todo = [], set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        after = tuple(n.name() for n, _ in node.next_functions if n is not None)
        saved = [(n, getattr(node, n)) for n in dir(node) if n.startswith("_saved_")]
        saved += [
            (f"saved_tensors[{i}]", t) for i, t in enumerate(getattr(node, "saved_tensors", ()))
        ]
        for name, value in saved:
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                found.append(
                    {
                        "node": node.name(),
                        "index": len(seen),
                        "after": after,
                        "name": name,
                        "shape": tuple(value.shape),
                        "dtype": value.dtype,
                        "nbytes": storage.nbytes(),
                        "storage": storage.data_ptr(),
                    }
                )
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


# What each operator keeps, as Korthikanti et al. name it (activation_plan.PAPER_TERMS); the
# linears' inputs are named by the weight saved beside them.
_TERMS = {
    ("NativeLayerNormBackward0", "_saved_input"): "layer norm inputs",
    ("NativeLayerNormBackward0", "_saved_result1"): "layer norm statistics",
    ("NativeLayerNormBackward0", "_saved_result2"): "layer norm statistics",
    ("BaddbmmBackward0", "_saved_batch1"): "q and k",
    ("BaddbmmBackward0", "_saved_batch2"): "q and k",
    ("SoftmaxBackward0", "_saved_result"): "softmax output",
    ("BmmBackward0", "_saved_self"): "scores after dropout",
    ("BmmBackward0", "_saved_mat2"): "v",
    ("GeluBackward0", "_saved_self"): "gelu input",
}
_MASKS = {("NativeDropoutBackward0", "_saved_result1"), ("MulBackward0", "_saved_other")}
_LINEAR_INPUTS = {
    ("AddmmBackward0", "_saved_mat1"): "_saved_mat2",
    ("MmBackward0", "_saved_self"): "_saved_mat2",
    ("_GatherLinearBackward", "saved_tensors[0]"): "saved_tensors[1]",
}


def kept_by_term(layer: GPTLayer, output: torch.Tensor) -> dict[str, int]:
    """Bytes autograd keeps for ``output``'s backward through ``layer``, by Korthikanti's terms.

    Each storage counts once, under the first term that keeps it; the parameters do not count.
    A tensor saved by an operator this layer does not use is reported under the operator's name.

    Args:
        layer: a :class:`GPTLayer` or :class:`ParallelGPTLayer` (without checkpointing).
        output: a result of ``layer``'s forward (a loss computed from it).

    Returns:
        The names of :func:`mgtutor.plan.activation_plan.activation_terms` (with "layer norm
        statistics") to bytes.
    """
    inputs = {layer.qkv: "qkv input", layer.proj: "projection input", layer.fc1: "fc1 input"}
    inputs[layer.fc2] = "fc2 input"
    weights = {m.weight.untyped_storage().data_ptr(): term for m, term in inputs.items()}
    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved = saved_by_autograd(output)
    by_node = {(t["index"], t["name"]): t["storage"] for t in saved}
    out: dict[str, int] = {}
    counted = set(parameters)
    for t in saved:
        if t["storage"] in counted:
            continue
        key = (t["node"], t["name"])
        if key in _LINEAR_INPUTS:
            storage = by_node.get((t["index"], _LINEAR_INPUTS[key]))
            term = t["node"] if storage is None else weights.get(storage, t["node"])
        elif key in _MASKS:
            term = (
                "softmax dropout mask"
                if "SoftmaxBackward0" in t["after"]
                else "residual dropout masks"
            )
        else:
            term = _TERMS.get(key, t["node"])
        counted.add(t["storage"])
        out[term] = out.get(term, 0) + t["nbytes"]
    return out
