"""published_runs: the rows as their sources configure them, and the model's prediction of each."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from mgtutor.plan import published_runs as pub
from mgtutor.plan.compute_time import flops_per_token
from mgtutor.plan.machine import MEGATRON_2021


def test_table_1_rows_are_the_reproduction_script_s_layouts():
    for r in pub.NARAYANAN_TABLE_1:
        dp = r.gpus // (r.tp * r.pp)
        assert dp * r.tp * r.pp == r.gpus
        assert r.micro_batches * dp * r.model.micro_batch in (512, 1024, 1536, 1792, 2304, 2160,
                                                               2520, 3072)  # fmt: skip
        assert r.chunks == 1 or r.micro_batches % r.pp == 0  # Megatron-LM's interleaving rule
    chunks = {r.name: r.chunks for r in pub.NARAYANAN_TABLE_1}
    assert chunks == {"1.7B": 1, "3.6B": 1, "7.5B": 1, "18B": 1, "39B": 1, "76B": 3, "145B": 2,
                      "310B": 2, "530B": 3, "1T": 1}  # fmt: skip
    # Pipelines ran Megatron-LM's local DDP (reduced after the backward); pp=1 rows torch DDP.
    assert {r.software.dp_overlap for r in pub.NARAYANAN_TABLE_1 if r.pp > 1} == {False}
    assert {r.software.dp_overlap for r in pub.NARAYANAN_TABLE_1 if r.pp == 1} == {True}


def test_the_published_throughput_is_eq_3_at_the_stated_rate():
    # 1T: 163 TFLOP/s per GPU (rounded) over 3072 GPUs, Table 1 aggregates 502.0 PFLOP/s.
    one_t = pub.NARAYANAN_TABLE_1[-1]
    assert one_t.published * one_t.gpus / 1000 == pytest.approx(502.0, abs=1.6)
    tokens = 3072 * 2048
    step = flops_per_token(one_t.model, "megatron") * tokens / (163e12 * 3072)
    assert step == pytest.approx(102.6, abs=0.5)  # seconds per step, as published


def test_torchtitan_405b_runs_eight_micro_batches_in_both_schedules():
    one, inter = pub.TORCHTITAN_RUNS[2:]
    assert one.micro_batches == inter.micro_batches == 8 == one.pp
    assert inter.chunks == 2 and one.model.micro_batch * 8 == 32  # local batch 32
    ratio = pub.predict(inter)[0] / pub.predict(one)[0]
    assert ratio == pytest.approx(1.28, abs=0.05)
    m16 = pub.predict(inter, micro_batches=16, model=replace(inter.model, micro_batch=2))[0]
    assert m16 / pub.predict(one)[0] > 1.45  # the misread default: m = 16


def test_predictions_and_their_errors():
    median, errors = pub.median_abs_error(pub.NARAYANAN_TABLE_1)
    assert len(errors) == 10 and median == statistics.median(abs(e) for e in errors)
    value, t = pub.predict(pub.NARAYANAN_TABLE_1[0])
    assert value == pytest.approx(
        flops_per_token(pub.NARAYANAN_TABLE_1[0].model, "megatron") * t.tokens_per_gpu_per_s / 1e12
    )
    tokens, _ = pub.predict(pub.TORCHTITAN_RUNS[0])
    assert 5000 < tokens < 10000  # tokens/s per GPU, the unit torchtitan reports


def test_a_counterfactual_run_changes_the_prediction():
    r = pub.NARAYANAN_TABLE_1[5]  # 76B, interleaved with 3 chunks
    assert pub.predict(r, chunks=1)[0] < pub.predict(r)[0]
    late = pub.predict(r)[0]
    early = pub.predict(r, software=replace(MEGATRON_2021, dp_overlap=True))[0]
    assert early > late


def test_llama_is_gated_where_the_planner_allows():
    model = pub.llama(layers=2, hidden=64, heads=4, seq_len=8, ffn=128, vocab=10, params=80_000)
    assert getattr(model, "style", None) == "llama"


def test_a_refused_layout_raises_instead_of_being_planned_otherwise():
    """No fallback: a run the planner refuses (here a ZeRO stage that does not exist) raises,
    where a silent re-plan as ZeRO-1 would report another layout's time under the run's name."""
    with pytest.raises(ValueError, match="ZeRO stage"):
        pub.predict(pub.TORCHTITAN_RUNS[2], zero=4)


def test_korthikanti_rows_are_table_3_s_configurations():
    rows = pub.KORTHIKANTI_TABLE_5
    assert [r.name.split()[0] for r in rows[::2]] == ["22B", "175B", "530B", "1T"]
    for full, present in zip(rows[::2], rows[1::2]):
        assert full.tp == 8 and full.gpus == full.tp * full.pp  # no data parallelism
        global_batch = full.micro_batches * full.model.micro_batch
        assert global_batch == (4 if full.gpus == 8 else full.gpus)
        assert (full.recompute, full.sequence_parallel) == ("full", False)
        assert (present.recompute, present.sequence_parallel) == ("selective", True)
        same = replace(present, name=full.name, published=full.published, recompute="full",
                       sequence_parallel=False)  # fmt: skip
        assert same == full  # the pair differs in recomputation and SP alone
        assert full.unit == "s" and full.software.tp_overlap == "backward"
    assert {r.name.split()[0]: r.chunks for r in rows} == {"22B": 1, "175B": 3, "530B": 3, "1T": 1}
    shapes = {r.name.split()[0]: (r.model.heads, r.model.hidden, r.model.layers) for r in rows}
    assert shapes == {"22B": (64, 6144, 48), "175B": (96, 12288, 96), "530B": (128, 20480, 105),
                      "1T": (160, 25600, 128)}  # fmt: skip
    # Table 5's "Throughput Increase" column, from the two columns of seconds.
    increase = [f.published / p.published - 1 for f, p in zip(rows[::2], rows[1::2])]
    assert increase == pytest.approx([0.290, 0.318, 0.297, 0.321], abs=0.0015)


def test_table_5_s_mfu_is_the_model_convention_over_the_a100_peak():
    # Table 5's MFU from its own seconds: 6N + attention FLOPs (no recomputation) per second over
    # 312 TFLOP/s. Counting the recomputation (the "megatron" convention) misses by 14 to 19 points.
    published = (0.415, 0.514, 0.560, 0.563, 0.542)  # 22B, 175B, 530B, 1T; 530B at dp=8 (6.3)
    rows = (*pub.KORTHIKANTI_TABLE_5[1::2], pub.KORTHIKANTI_530B_DP8)
    for r, figure in zip(rows, published, strict=True):
        dp = r.gpus // (r.tp * r.pp)
        tokens = r.micro_batches * dp * r.model.micro_batch * r.model.seq_len
        mfu = flops_per_token(r.model, "model") * tokens / (r.published * r.gpus * 312e12)
        assert mfu == pytest.approx(figure, abs=0.003), r.name


def test_a_row_in_seconds_reports_its_error_as_a_throughput():
    seconds, rate = pub.KORTHIKANTI_TABLE_5[0], pub.NARAYANAN_TABLE_1[0]
    assert pub.error(seconds, seconds.published / 2) == pytest.approx(1.0)  # twice as fast
    assert pub.error(rate, rate.published * 2) == pytest.approx(1.0)
    value, t = pub.predict(seconds)
    assert value == t.total and pub.median_abs_error([seconds])[1] == [pub.error(seconds, value)]


def test_the_530b_run_with_8_way_data_parallelism():
    dp8, present = pub.KORTHIKANTI_530B_DP8, pub.KORTHIKANTI_TABLE_5[5]
    assert dp8.gpus == 8 * present.gpus and dp8.micro_batches == present.micro_batches
    assert not dp8.software.dp_overlap and dp8.published == 39.15
    published = dp8.published - present.published
    # The paper says "mixed precision", not which gradients were reduced: 16-bit or float32.
    added = [pub.predict(dp8, precision=g)[0] - pub.predict(present, precision=g)[0]
             for g in ("mixed", "mixed_fp32_grads")]  # fmt: skip
    assert 0 < added[0] < added[1] < published / 2  # short of the published either way
    # ... and a ring all-reduce of the average stage's 16-bit gradients over the replicas' NICs
    ring = 2 * 7 / 8 * 2 * dp8.model.total / (dp8.tp * dp8.pp) / dp8.hardware.inter.bandwidth
    assert 1 <= added[0] / ring < 1.1  # the first stage also holds the embedding
    assert pub.predict(present, precision="mixed_fp32_grads")[0] == pytest.approx(
        pub.predict(present)[0], rel=1e-3
    )  # float32 gradients change the bytes reduced, not the products


def test_table_2_has_every_row_of_the_typeset_table():
    rows = pub.NARAYANAN_TABLE_2
    assert len(rows) == 12 and sum(r.zero == 3 for r in rows) == 6
    for r in rows:
        dp = r.gpus // (r.tp * r.pp)
        batch = r.micro_batches * dp * r.model.micro_batch
        assert batch == (2560 if r.gpus == 640 else 1536 if r.model.layers == 96 else 2240), r.name
        assert r.tp * r.pp == (1 if r.zero == 3 else 96 if r.model.layers == 96 else 280), r.name
