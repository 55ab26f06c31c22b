"""activation_plan: Korthikanti's count, term by term, equals what autograd keeps in GPTLayer.

Measured on CPU, in one process (float32 and bfloat16, 1-byte and dtype-sized dropout masks) and
per rank on 2 ranks (tensor parallel, sequence parallel, sequence parallel keeping the gathered
input), with no, selective and full recomputation. Every comparison is equality of bytes.
"""

from __future__ import annotations

import re

import pytest

import mgtutor
from mgtutor.plan.activation_plan import (
    PAPER_TERMS,
    activation_bytes_per_layer,
    activation_terms,
)
from mgtutor.plan.shape import Transformer

torch = pytest.importorskip("torch")

S, B, H, A = 32, 2, 64, 4  # sequence, micro-batch, hidden, heads: s ≠ h, a·s ≠ h


def test_terms_are_the_papers_and_add_up_to_its_table_2():
    shape = Transformer(layers=1, hidden=H, heads=A, seq_len=S, micro_batch=B)
    terms = activation_terms(shape)
    assert list(terms) == list(PAPER_TERMS)
    sbh, scores = S * B * H, A * S * S * B
    for name, written in PAPER_TERMS.items():  # "4sbh", "as²b": a coefficient and a unit
        number, unit = re.fullmatch(r"(\d*)(sbh|as²b)", written).groups()
        assert terms[name] == int(number or 1) * (sbh if unit == "sbh" else scores), name
    assert sum(terms.values()) == 34 * sbh + 5 * scores
    assert activation_bytes_per_layer(shape, tp=2) == 10 * sbh + (24 * sbh + 5 * scores) // 2
    assert activation_bytes_per_layer(shape, precision="fp32") == 66 * sbh + 9 * scores
    stats = activation_terms(shape, tp=2, sequence_parallel=True, norm_stat_bytes=4)
    assert stats["layer norm statistics"] == 2 * 2 * S * B * 4 // 2


def _measured_case(dtype, mask):
    from mgtutor.measure.activations import kept_for_backward
    from mgtutor.parallel.gpt_layer import GPTLayer

    torch.manual_seed(0)
    layer = GPTLayer(H, A, p=0.1, mask=mask).to(dtype)
    return layer, kept_for_backward(layer, torch.randn(B, S, H, dtype=dtype))


@pytest.mark.parametrize(
    "dtype, mask, precision, mask_bytes",
    [
        (torch.float32, "bool", "fp32", 1),
        (torch.float32, "float", "fp32", 4),  # CPU's F.dropout: a float32 mask
        (torch.bfloat16, "bool", "mixed", 1),  # the paper's case
        (torch.bfloat16, "float", "mixed", 2),
    ],
)
def test_one_process_keeps_each_term_of_the_plan(dtype, mask, precision, mask_bytes):
    _, (kept, terms) = _measured_case(dtype, mask)
    shape = Transformer(layers=1, hidden=H, heads=A, seq_len=S, micro_batch=B)
    # On CPU LayerNorm's mean and 1/std have the input's dtype (also in bfloat16).
    stat = dtype.itemsize
    planned = activation_terms(
        shape, precision=precision, mask_bytes=mask_bytes, norm_stat_bytes=stat
    )
    assert terms == planned
    assert kept == sum(terms.values())  # every byte LiveTensors sees is one of the terms
    paper = activation_bytes_per_layer(shape, precision=precision, mask_bytes=mask_bytes)
    assert kept - paper == 2 * 2 * S * B * stat  # the paper leaves out the norms' statistics


def test_one_process_recomputation():
    from mgtutor.measure.activations import kept_for_backward
    from mgtutor.parallel.gpt_layer import GPTLayer

    torch.manual_seed(0)
    layer = GPTLayer(H, A, p=0.1)
    x = torch.randn(B, S, H)
    shape = Transformer(layers=1, hidden=H, heads=A, seq_len=S, micro_batch=B)
    for recompute in ("selective", "full"):
        kept, _ = kept_for_backward(layer, x, recompute)
        # Full recomputation keeps no norm statistics either: only the layer's input.
        stats = 0 if recompute == "full" else 4
        want = activation_bytes_per_layer(
            shape, precision="fp32", recompute=recompute, norm_stat_bytes=stats
        )
        assert kept == want, recompute


def _in_ranks() -> dict:
    """Per rank: what each split of one layer keeps, and its output against one process."""
    import torch.distributed as dist

    from mgtutor.measure.activations import kept_for_backward
    from mgtutor.parallel.gpt_layer import GPTLayer, ParallelGPTLayer

    mgtutor.setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layer = GPTLayer(H, A, p=0.1)
    x = torch.randn(B, S, H)
    mine = x.chunk(world, dim=1)[rank]
    splits = {
        "tp": (ParallelGPTLayer(layer), x),
        "sp": (ParallelGPTLayer(layer, sequence_parallel=True), mine),
        "sp keeping the gathered input": (ParallelGPTLayer(layer, True, keep_gathered=True), mine),
    }
    out = {}
    for name, (split, inp) in splits.items():
        for recompute in ("none", "selective", "full"):
            out[name, recompute] = kept_for_backward(split, inp, recompute)
    # The splits compute the layer: without dropout, the same output and input gradient.
    layer.p = 0.0
    whole_x = x.clone().requires_grad_()
    whole = layer(whole_x)
    whole.pow(2).sum().backward()
    errors = {}
    for name, (split, inp) in splits.items():
        split.p = 0.0
        part_x = inp.clone().requires_grad_()
        y = split(part_x)
        y.pow(2).sum().backward()
        sequence = name != "tp"
        want_y = whole.chunk(world, 1)[rank] if sequence else whole
        want_grad = whole_x.grad.chunk(world, 1)[rank] if sequence else whole_x.grad
        errors[name] = max(
            (y - want_y).abs().max().item(), (part_x.grad - want_grad).abs().max().item()
        )
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def in_ranks() -> list[dict]:
    return mgtutor.launch(_in_ranks, world_size=2, backend="gloo").results


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_each_rank_keeps_the_plan_under_tensor_and_sequence_parallelism(in_ranks, recompute):
    shape = Transformer(layers=1, hidden=H, heads=A, seq_len=S, micro_batch=B)
    stats = 0 if recompute == "full" else 4
    for rank in in_ranks:
        for name, sequence in (("tp", False), ("sp", True)):
            kept, terms = rank[name, recompute]
            planned = activation_terms(shape, 2, sequence, "fp32", recompute, norm_stat_bytes=stats)
            if recompute == "none":
                assert terms == planned, name
            assert kept == sum(planned.values()), name
        # Keeping the all-gathered input of qkv and fc1 whole costs (1 - 1/t) of both.
        kept, _ = rank["sp keeping the gathered input", recompute]
        extra = 0 if recompute == "full" else 2 * 4 * S * B * H // 2
        assert kept - rank["sp", recompute][0] == extra


def test_split_layers_compute_the_layer(in_ranks):
    for rank in in_ranks:
        assert max(rank["errors"].values()) < 1e-5, rank["errors"]


def test_scaled_dot_product_attention_on_cpu_keeps_no_scores():
    # Why GPTLayer writes attention out (and notebook 13's block, which calls SDPA, keeps no
    # s x s term): on CPU the fused kernel saves q, k, v, its output and a log-sum-exp per row.
    from mgtutor.parallel.gpt_layer import saved_by_autograd

    q, k, v = (torch.randn(B, A, S, H // A, requires_grad=True) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    shapes = [t["shape"] for t in saved_by_autograd(out.sum())]
    assert shapes and all(shape[-2:] != (S, S) for shape in shapes), shapes
    written_out = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
    assert any(t["shape"][-2:] == (S, S) for t in saved_by_autograd(written_out.sum()))


def test_clear_errors():
    from mgtutor.parallel.gpt_layer import GPTLayer

    shape = Transformer(layers=1, hidden=H, heads=A, seq_len=S)
    with pytest.raises(ValueError, match="recompute must be one of"):
        activation_terms(shape, recompute="some")
    with pytest.raises(ValueError, match="precision must be one of"):
        activation_terms(shape, precision="fp8")
    with pytest.raises(ValueError, match="multiple of heads"):
        GPTLayer(10, 4)
    with pytest.raises(ValueError, match="mask must be"):
        GPTLayer(H, A, mask="byte")
