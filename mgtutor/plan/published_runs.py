"""Published training runs, as their authors configured and measured them, and the step-time
model's prediction of each: the runs notebook 18 checks the model against, none fitted to.

* :data:`NARAYANAN_TABLE_1`: Narayanan et al. 2021 (arXiv:2104.04473) Table 1, GPT models from
  1.7B to 1T parameters on Selene's A100s. Throughput ("achieved teraFLOP/s per GPU", their
  eq. 3, full recomputation counted) from the table Megatron-LM's README printed
  (``images/cases_april2021.png``, removed in 2e90a342f5); each configuration from the script
  its authors published to reproduce the table (``examples/sc21/run_table_1.sh`` at de7dc40f88:
  tp, pp, micro-batch and global batch, layers, hidden size, heads, DDP implementation, layers
  per virtual stage; ``CONFIG.sh``: fp16, sequence 2048; vocabulary 51,200 per the README).
* :data:`NARAYANAN_TABLE_2`: the same paper's Table 2, PTD-P against ZeRO-3 (175B and 530B
  parameters), every row, read from an image of the typeset table
  (``cli99/llm-analysis``, ``figures/megatron-lm-2nd-table-2.png`` at d841e40). The table gives
  no layers per virtual stage: the 530B rows use Table 1's (run_table_1.sh), the 175B rows none.
* :data:`TORCHTITAN_RUNS`: torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md`` (at
  31a17bf; torchtitan 9dec370) Tables 1, 3 and 5, tokens/s per GPU.

* :data:`KORTHIKANTI_TABLE_5`: Korthikanti et al. 2022 (arXiv:2205.05198v1) Table 5, seconds per
  iteration of GPT models from 22B to 1T parameters on Selene's A100s (80 GB), with full
  recomputation and no sequence parallelism, and with selective recomputation and sequence
  parallelism ("present work"); each configuration from Table 3 (heads, hidden size, layers, tp,
  pp, GPUs, global batch, micro-batch; no data parallelism) and section 6 (3 interleaved stages
  for 175B and 530B, sequence 2048, vocabulary 51,200, mixed precision; Table 4's note: the
  backward's all-reduce overlaps the weight gradient's product, Megatron-LM's ``MEGATRON``).
  :data:`KORTHIKANTI_530B_DP8`: section 6.3's 530B run with 8-way data parallelism (2,240 GPUs,
  the batch x 8, gradient all-reduces not overlapped): 39.15 s. Read from a reader's annotated
  copy of the paper (``danielvegamyhre/ml-perf-reading-group``,
  ``session_9/reducing_activation_recomputation_[annotated].pdf`` at 4582b21, the arXiv text).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal

from mgtutor.plan.compute_time import flops_per_token
from mgtutor.plan.machine import (
    A100_SELENE,
    GRAND_TETON_H100,
    MEGATRON,
    MEGATRON_2021,
    TORCHTITAN,
    Hardware,
    Software,
    StepTime,
)
from mgtutor.plan.planner import plan
from mgtutor.plan.shape import Transformer
from mgtutor.plan.step_time import step_time

if TYPE_CHECKING:
    from mgtutor.plan.activation_plan import Recompute

__all__ = [
    "KORTHIKANTI_530B_DP8",
    "KORTHIKANTI_TABLE_5",
    "NARAYANAN_TABLE_1",
    "NARAYANAN_TABLE_2",
    "TORCHTITAN_RUNS",
    "Run",
    "error",
    "llama",
    "median_abs_error",
    "predict",
]


@dataclass(frozen=True)
class Run:
    """One published run: its model, layout, code and measured throughput.

    ``published`` is per GPU in ``unit``, "TFLOP/s" (Megatron-LM's eq. 3 FLOPs per second) or
    "tokens/s", or seconds per iteration, "s". ``source`` says where the row is from.
    """

    name: str
    model: Transformer
    gpus: int
    tp: int
    pp: int
    micro_batches: int
    published: float
    unit: str
    hardware: Hardware
    software: Software
    source: str
    zero: int = 0
    chunks: int = 1
    recompute: Recompute = "full"
    precision: str = "mixed"
    gemm_precision: str | None = None
    sequence_parallel: bool = False


def _gpt(layers: int, hidden: int, heads: int, micro_batch: int) -> Transformer:
    return Transformer(layers, hidden, heads, 2048, micro_batch, vocab=51200)


def _table_1(name, layers, hidden, heads, tp, pp, gpus, batch, mbs, per_virtual, ddp, tflops):
    dp = gpus // (tp * pp)
    chunks = layers // pp // per_virtual if per_virtual else 1
    torch_ddp = replace(MEGATRON_2021, dp_overlap=True, bucket_view=False)
    return Run(
        name, _gpt(layers, hidden, heads, mbs), gpus, tp, pp, batch // (dp * mbs), tflops,
        "TFLOP/s", A100_SELENE, torch_ddp if ddp == "torch" else MEGATRON_2021,
        "Narayanan et al. 2021 Table 1 (README table); run_table_1.sh", chunks=chunks,
    )  # fmt: skip


#: name, layers, hidden, heads, tp, pp, GPUs, batch, micro-batch, layers per virtual stage
#: (0: none), DDP, achieved teraFLOP/s per GPU.
NARAYANAN_TABLE_1: tuple[Run, ...] = tuple(
    _table_1(*row)
    for row in (
        ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 0, "torch", 137),
        ("3.6B", 30, 3072, 32, 2, 1, 64, 512, 16, 0, "torch", 138),
        ("7.5B", 36, 4096, 32, 4, 1, 128, 512, 16, 0, "torch", 142),
        ("18B", 40, 6144, 48, 8, 1, 256, 1024, 8, 0, "torch", 135),
        ("39B", 48, 8192, 64, 8, 2, 512, 1536, 4, 0, "local", 138),
        ("76B", 60, 10240, 80, 8, 4, 1024, 1792, 2, 5, "local", 140),
        ("145B", 80, 12288, 96, 8, 8, 1536, 2304, 2, 5, "local", 148),
        ("310B", 96, 16384, 128, 8, 16, 1920, 2160, 1, 3, "local", 155),
        ("530B", 105, 20480, 128, 8, 35, 2520, 2520, 1, 1, "local", 163),
        ("1T", 128, 25600, 160, 8, 64, 3072, 3072, 1, 0, "local", 163),
    )
)


def _table_2(scheme, billions, gpus, batch, mbs, tflops):
    layers, hidden, heads = (96, 12288, 96) if billions < 200 else (105, 20480, 128)
    tp, pp = (8, 12 if billions < 200 else 35) if scheme == "PTD-P" else (1, 1)
    chunks = 3 if scheme == "PTD-P" and billions > 200 else 1
    dp = gpus // (tp * pp)
    software = replace(MEGATRON_2021, dp_overlap=True) if scheme == "ZeRO-3" else MEGATRON_2021
    return Run(
        f"{billions}B {scheme}, {gpus} GPUs", _gpt(layers, hidden, heads, mbs), gpus, tp, pp,
        batch // (dp * mbs), tflops, "TFLOP/s", A100_SELENE, software,
        "Narayanan et al. 2021 Table 2", zero=3 if scheme == "ZeRO-3" else 0,
        chunks=chunks,
    )  # fmt: skip


#: scheme, billions of parameters, GPUs, batch, micro-batch, achieved teraFLOP/s per GPU.
NARAYANAN_TABLE_2: tuple[Run, ...] = tuple(
    _table_2(*row)
    for row in (
        ("ZeRO-3", 174.6, 384, 1536, 4, 144),
        ("ZeRO-3", 174.6, 768, 1536, 2, 88),
        ("ZeRO-3", 174.6, 1536, 1536, 1, 44),
        ("ZeRO-3", 529.6, 640, 2560, 4, 138),
        ("ZeRO-3", 529.6, 1120, 2240, 2, 98),
        ("ZeRO-3", 529.6, 2240, 2240, 1, 48),
        ("PTD-P", 174.6, 384, 1536, 1, 153),
        ("PTD-P", 174.6, 768, 1536, 1, 149),
        ("PTD-P", 174.6, 1536, 1536, 1, 141),
        ("PTD-P", 529.6, 560, 2240, 1, 171),
        ("PTD-P", 529.6, 1120, 2240, 1, 167),
        ("PTD-P", 529.6, 2240, 2240, 1, 159),
    )
)


def _table_5(name, heads, hidden, layers, tp, pp, gpus, batch, mbs, full_s, present_s):
    chunks = 3 if name in ("175B", "530B") else 1  # section 6: "three interleaving stages"
    source = "Korthikanti et al. 2022 Tables 3 and 5 (arXiv:2205.05198v1)"
    model, m = _gpt(layers, hidden, heads, mbs), batch // mbs  # no data parallelism
    full = Run(f"{name} full recompute", model, gpus, tp, pp, m, full_s, "s", A100_SELENE,
               MEGATRON, source, chunks=chunks, recompute="full")
    present = replace(full, name=f"{name} selective + SP", published=present_s,
                      recompute="selective", sequence_parallel=True)
    return full, present


#: name, heads, hidden, layers, tp, pp, GPUs, global batch, micro-batch (Table 3); seconds per
#: iteration with full recomputation, and with selective recomputation + SP (Table 5).
KORTHIKANTI_TABLE_5: tuple[Run, ...] = tuple(
    run
    for row in (
        ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1.42, 1.10),
        ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 18.13, 13.75),
        ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 49.05, 37.83),
        ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 94.42, 71.49),
    )
    for run in _table_5(*row)
)
#: Section 6.3: the 530B present-work run with 8-way data parallelism, the batch x 8, "we do not
#: use any overlapping of gradient all-reduces with back-propagation".
KORTHIKANTI_530B_DP8 = replace(
    KORTHIKANTI_TABLE_5[5], name="530B selective + SP, dp=8", gpus=2240, published=39.15,
    software=replace(MEGATRON, dp_overlap=False), source="Korthikanti et al. 2022 section 6.3",
)  # fmt: skip


@dataclass(frozen=True)
class _Llama(Transformer):
    style: Literal["gpt", "llama"] = "llama"


def llama(**shape: Any) -> Transformer:
    """A Llama-shaped :class:`~mgtutor.plan.shape.Transformer` (gated MLP, untied output,
    RMSNorm): ``style="llama"`` where the planner has it."""
    if "style" in {f.name for f in fields(Transformer)}:
        return Transformer(**shape, style="llama")
    return _Llama(**shape)


_LLAMA_8B = dict(layers=32, hidden=4096, heads=32, seq_len=8192, ffn=14336, vocab=128256)
_LLAMA_405B = dict(layers=126, hidden=16384, heads=128, seq_len=8192, ffn=53248, vocab=128256)
_TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (31a17bf)"

#: torchtitan's Llama 3.1 runs: 8B with FSDP (Tables 1 and 3, local batch 2, selective AC,
#: no compile), 405B with FSDP 8 x TP 8 x PP 8 (Table 5: local batch 32, full AC, Float8,
#: AsyncTP, compile), m = 8 micro-batches for both schedules (build_pipeline_schedule at
#: 9dec370: pipeline_parallel_microbatches unset means the pipeline degree).
TORCHTITAN_RUNS: tuple[Run, ...] = (
    Run("8B FSDP, 8 GPUs", llama(**_LLAMA_8B, micro_batch=2, params=8_030_000_000), 8, 1, 1,
        1, 5762, "tokens/s", GRAND_TETON_H100, TORCHTITAN, _TITAN + " Table 1", zero=3,
        recompute="selective"),
    Run("8B FSDP, 128 GPUs", llama(**_LLAMA_8B, micro_batch=2, params=8_030_000_000), 128, 1,
        1, 1, 5605, "tokens/s", GRAND_TETON_H100, TORCHTITAN, _TITAN + " Table 3", zero=3,
        recompute="selective"),
    Run("405B 1F1B", llama(**_LLAMA_405B, micro_batch=4, params=405_000_000_000), 512, 8, 8,
        8, 100, "tokens/s", GRAND_TETON_H100, replace(TORCHTITAN, tp_overlap="all"),
        _TITAN + " Table 5", zero=3, gemm_precision="fp8"),
    Run("405B interleaved 1F1B", llama(**_LLAMA_405B, micro_batch=4, params=405_000_000_000),
        512, 8, 8, 8, 128, "tokens/s", GRAND_TETON_H100, replace(TORCHTITAN, tp_overlap="all"),
        _TITAN + " Table 5", zero=3, chunks=2, gemm_precision="fp8"),
)  # fmt: skip


def predict(run: Run, **changes: Any) -> tuple[float, StepTime]:
    """The model's throughput of ``run`` in the run's unit, and its step time. ``changes``
    replace fields of the run first (a counterfactual: ``predict(run, micro_batches=16)``).
    A layout the planner refuses raises its ``ValueError``: every published run is planned as run.
    """
    run = replace(run, **changes)
    gpus, tp, pp = run.gpus, run.tp, run.pp
    p = plan(
        run.model,
        gpus,
        10**15,
        zero=run.zero,
        precision=run.precision,
        tp=tp,
        pp=pp,
        micro_batches=run.micro_batches,
        recompute=run.recompute,
        sequence_parallel=run.sequence_parallel,
    )
    t = step_time(
        p, run.hardware, chunks=run.chunks, software=run.software, precision=run.gemm_precision
    )
    if run.unit == "s":
        return t.total, t
    if run.unit == "tokens/s":
        return t.tokens_per_gpu_per_s, t
    return flops_per_token(run.model, "megatron") * t.tokens_per_gpu_per_s / 1e12, t


def error(run: Run, predicted: float) -> float:
    """The prediction's error as a throughput, whatever the run's unit: predicted / published -
    1 for a rate, published / predicted - 1 for seconds. Above 0: the model is faster than the
    run."""
    if run.unit == "s":
        return run.published / predicted - 1
    return predicted / run.published - 1


def median_abs_error(runs: tuple[Run, ...] | list[Run]) -> tuple[float, list[float]]:
    """The median of |:func:`error`| over ``runs``, and each run's signed error."""
    errors = [error(r, predict(r)[0]) for r in runs]
    return statistics.median(abs(e) for e in errors), errors
