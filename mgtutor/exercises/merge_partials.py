"""Notebook 14's exercise: merge two partial attention results with their log-sum-exps."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mgtutor.exercises import solutions
from mgtutor.exercises.check_result import CheckResult
from mgtutor.exercises.checking import Exercise, check
from mgtutor.exercises.rank_side import (
    Finding,
    call_learner,
    everyone_ok,
    make_finding,
)

__all__ = ["CASES", "EXERCISE", "check_merge_partials", "run"]

CASES = (  # label, keys in block a, keys in block b, score scale, which rows see nothing
    ("keys 0-5 and 6-11, scores near 1", 6, 6, 1.0, ""),
    ("3 keys and 9 keys, scores near 1", 3, 9, 1.0, ""),
    ("6 and 6 keys, scores near 1,000 (exp() overflows float64 above 709)", 6, 6, 400.0, ""),
    ("block b fully masked: out_b 0, lse_b -inf on every row", 6, 6, 1.0, "b"),
    (
        "rows 0-1 see no key in either block (both lse -inf), as before a ring's first step",
        6,
        6,
        1.0,
        "ab",
    ),
    ("your merge inside ring_attention on 2 ranks, causal, zig-zag split", 0, 0, 1.0, "ring"),
)
_HEADS, _ROWS, _DIM = 2, 4, 8


def check_merge_partials(
    merge_partials: Callable[..., Any], *, timeout: float = 20.0
) -> CheckResult:
    """Check the log-sum-exp merge of two partial attention results, as ring attention needs.

    The exercise: write ``merge_partials(out_a, lse_a, out_b, lse_b) -> (out, lse)``.
    ``out_a`` ``(..., L, D)`` is the attention of L queries over block a of the keys alone, and
    ``lse_a`` ``(..., L)`` the log of each row's softmax normalizer over that block; the same for
    block b. Return the attention over both blocks and its log-sum-exp, with no overflow for
    large scores, and with rows that no key reached (``lse`` ``-inf`` in both) left at 0 and
    ``-inf``.

    The checker compares with attention over both blocks on five cases (blocks of equal and
    unequal size, scores near 1,000, a fully masked block, rows that see nothing), then runs
    :func:`mgtutor.parallel.context.ring_attention` with your merge on 2 ranks, causal, against
    full attention.

    Args:
        merge_partials: your function.
        timeout: seconds the ranks may take before they are stopped and a hang is reported.

    Returns:
        A :class:`CheckResult`.

    Raises:
        TypeError: ``merge_partials`` is not a function.
    """
    return check(EXERCISE, (merge_partials,), timeout)


def _partials(number: int, n_a: int, n_b: int, scale: float, masked: str) -> dict[str, Any]:
    """Two blocks' attention results for the same queries, and the attention over both."""
    from mgtutor.parallel.context import attention_with_lse

    gen = torch.Generator().manual_seed(number)
    q = torch.randn(_HEADS, _ROWS, _DIM, generator=gen, dtype=torch.float64) * scale
    k, v = (torch.randn(_HEADS, n_a + n_b, _DIM, generator=gen, dtype=torch.float64) for _ in "kv")
    q_pos = torch.arange(_ROWS) + n_a + n_b  # after every key: all seen, unless moved below
    k_pos = torch.arange(n_a + n_b)
    if masked == "b":
        k_pos = torch.cat([k_pos[:n_a], k_pos[n_a:] + 10_000])  # block b after every query
    if masked == "ab":
        q_pos = torch.cat([torch.tensor([-2, -1]), q_pos[2:]])  # rows 0 and 1 before every key
    a, b = slice(0, n_a), slice(n_a, None)
    out_a, lse_a = attention_with_lse(q, k[:, a], v[:, a], q_pos, k_pos[a])
    out_b, lse_b = attention_with_lse(q, k[:, b], v[:, b], q_pos, k_pos[b])
    out, lse = attention_with_lse(q, k, v, q_pos, k_pos)
    return {"args": (out_a, lse_a, out_b, lse_b), "out": out, "lse": lse}


def run(payload: bytes, index: int, folder: str | None) -> list[Finding]:
    (fn,) = cloudpickle.loads(payload)
    findings = []
    for number, (case, n_a, n_b, scale, masked) in enumerate(CASES):
        if masked == "ring":
            findings.append(_ring_case(index, case, fn))
        else:
            case_data = _partials(number, n_a, n_b, scale, masked)
            inputs = [t.clone() for t in case_data["args"]]
            returned = call_learner(index, case, fn, *inputs)
            findings.append(_diagnose_merge(case, returned, case_data))
        if not everyone_ok(findings[-1]):
            break
    return findings


def _ring_case(index: int, case: str, fn: Any) -> Finding:
    from mgtutor.parallel.context import ring_attention, split_zigzag

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(99)
    q, k, v = (torch.randn(1, _HEADS, 16, _DIM, generator=gen, dtype=torch.float64) for _ in "qkv")
    layout = split_zigzag(16, world)
    mine = layout[rank]
    ring = functools.partial(ring_attention, layout=layout, causal=True, merge=fn)
    out = call_learner(index, case, ring, q[..., mine, :], k[..., mine, :], v[..., mine, :])
    truth = F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., mine, :]
    if torch.allclose(out, truth, rtol=1e-9, atol=1e-12):
        return make_finding(case)
    return make_finding(
        case,
        f"rank {rank}'s output differs from full attention by up to "
        f"{(out - truth).abs().max().item():.3g}",
        "the ring merges its running (out, lse) with each new block's: your lse must be the "
        "log-sum-exp of everything merged so far, since the next merge weighs by it",
    )


def _diagnose_merge(case: str, returned: Any, data: dict[str, Any]) -> Finding:
    out_a, lse_a, out_b, lse_b = data["args"]
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
        shown = (
            f"one tensor of shape {tuple(returned.shape)}"
            if isinstance(returned, torch.Tensor)
            else f"{type(returned).__name__} {returned!r:.60}"
        )
        return make_finding(
            case,
            f"returned {shown}",
            "return a pair (out, lse): the merged output and its log-sum-exp, which the next "
            "merge needs",
        )
    out, lse = returned
    for what, got, want in (("out", out, data["out"]), ("lse", lse, data["lse"])):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            got_as = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return make_finding(
                case,
                f"{what} is {got_as}, not a tensor of shape {tuple(want.shape)}",
                "out has the shape of out_a, lse the shape of lse_a (one number per query row)",
            )
    if torch.isnan(out).any() or torch.isnan(lse).any():
        both = torch.isneginf(lse_a) & torch.isneginf(lse_b)
        if both.any():
            return make_finding(
                case,
                "NaN in the result, on the rows where lse_a and lse_b are both -inf",
                "-inf - (-inf) is NaN: where the merged lse is -inf (no key seen yet), the "
                "weights must be 0 and out 0; torch.logaddexp(-inf, -inf) is -inf",
            )
        return make_finding(
            case,
            "NaN in the result: exp() of an lse above 709 is inf in float64, and inf / inf is NaN",
            "never exponentiate an lse itself: lse = torch.logaddexp(lse_a, lse_b), and weigh "
            "each out by exp(lse_part - lse), at most 1",
        )
    if torch.isinf(out).any() or (torch.isinf(lse) & ~torch.isinf(data["lse"])).any():
        return make_finding(
            case,
            "inf in the result: exp() of the lse overflowed",
            "never exponentiate an lse itself: lse = max + log(exp(lse_a - max) + exp(lse_b - "
            "max)) (torch.logaddexp), and weigh each out by exp(lse_part - lse), at most 1",
        )
    out_ok = torch.allclose(out, data["out"], rtol=1e-9, atol=1e-12)
    lse_ok = torch.allclose(lse, data["lse"], rtol=1e-9, atol=1e-12)
    if out_ok and lse_ok:
        return make_finding(case)
    with torch.no_grad():
        maximum = torch.maximum(lse_a, lse_b)
        wrong_out = {
            "the average of the two outputs": (
                (out_a + out_b) / 2,
                "a block's share is its weight exp(lse_part - lse), not one half: a block "
                "whose keys score higher counts more",
            ),
            "the sum of the two outputs, not rescaled": (
                out_a + out_b,
                "each out is normalized over its own block only: weigh each by "
                "exp(lse_part - lse) so the weights add up to 1",
            ),
        }
        wrong_lse = {
            "the larger lse, max(lse_a, lse_b)": (
                maximum,
                "the merged normalizer is exp(lse_a) + exp(lse_b): lse = log(exp(lse_a) + "
                "exp(lse_b)), larger than either (torch.logaddexp), not their maximum",
            ),
            "lse_a + lse_b": (
                lse_a + lse_b,
                "the normalizers add (exp(lse_a) + exp(lse_b)), they do not multiply",
            ),
        }
    detail = f"out {'right' if out_ok else 'wrong'}, lse {'right' if lse_ok else 'wrong'}"
    if not out_ok:
        for name, (values, hint) in wrong_out.items():
            if torch.allclose(out, values, rtol=1e-9, atol=1e-12):
                return make_finding(case, f"{detail}: out is {name}", hint)
    if not lse_ok:
        for name, (values, hint) in wrong_lse.items():
            if torch.allclose(lse, values, rtol=1e-9, atol=1e-12):
                return make_finding(case, f"{detail}: lse is {name}", hint)
    return make_finding(
        case,
        detail,
        "lse = logaddexp(lse_a, lse_b); out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * "
        "out_b, each weight broadcast over the last dimension (unsqueeze(-1))",
    )


EXERCISE = Exercise(
    key="merge_partials",
    name="merge_partials",
    functions=("merge_partials",),
    world_size=2,
    cases=tuple(case for case, *_ in CASES),
    run=run,
    reference=(solutions.merge_partials,),
    hang_hint="the function does not return: it needs no collective and no loop, a few tensor "
    "operations on its four arguments",
)
