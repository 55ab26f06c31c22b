"""compute_time: products at their shapes, memory-bound operations, FLOP conventions."""

from __future__ import annotations

import pytest

from mgtutor.plan.compute_time import (
    Device,
    compute_flops,
    flops_per_token,
    gemm_seconds,
    layer_times,
    matrix_params_per_layer,
)
from mgtutor.plan.published_runs import llama
from mgtutor.plan.shape import Transformer

# Round numbers: 10 SMs, 1e12 FLOP/s at the ceiling, 1e12 bytes/s of memory.
ROUND = Device(
    "round", peak={"mixed": 2e12}, ceiling={"mixed": 1e12}, memory_bandwidth=1e12, sms=10
)


def test_a_product_pays_for_whole_waves_of_tiles():
    # 256 x 128 tiles: 2560 x 1280 is 10 x 10 = 100 tiles, 10 full waves of 10 SMs.
    full = gemm_seconds(ROUND, "mixed", 2560, 4096, 1280)
    assert full == pytest.approx(2 * 2560 * 4096 * 1280 / 1e12)
    # One row more needs an 11th row of tiles: 110 tiles, 11 waves; the FLOPs barely change.
    assert gemm_seconds(ROUND, "mixed", 2561, 4096, 1280) == pytest.approx(full * 11 / 10)
    # A batch of products fills the waves together: 4 batches of 25 tiles, 10 waves, not 12.
    assert gemm_seconds(ROUND, "mixed", 1280, 4096, 640, 4) == pytest.approx(full)
    # Deleting the wave rule (sms=0) makes the 2561-row product cost its FLOPs alone.
    flat = Device("flat", ceiling={"mixed": 1e12})
    assert gemm_seconds(flat, "mixed", 2561, 4096, 1280) < full * 1.01


def test_a_thin_product_runs_at_the_memory_speed():
    # 8 columns: 8 FLOPs per byte moved, below this device's 100 FLOPs per byte.
    fast = Device("fast", ceiling={"mixed": 100e12}, memory_bandwidth=1e12, sms=10)
    seconds = gemm_seconds(fast, "mixed", 4096, 4096, 8)
    assert seconds == pytest.approx(2 * (4096 * 4096 + 2 * 4096 * 8) / 1e12)
    assert seconds > 10 * 2 * 4096 * 4096 * 8 / 100e12


def test_measured_rates_are_used_at_their_shape_and_the_nearest_elsewhere():
    cpu = Device("cpu", gemm_rates={(64, 768, 2304): 50e9, (64, 768, 3072): 80e9})
    assert gemm_seconds(cpu, "fp32", 64, 768, 2304) == pytest.approx(2 * 64 * 768 * 2304 / 50e9)
    assert gemm_seconds(cpu, "fp32", 64, 768, 3000) == pytest.approx(2 * 64 * 768 * 3000 / 80e9)


def test_memory_bound_operations_shrink_beside_the_products_as_hidden_grows():
    # Products grow as h², norms and softmax as h: the share of memory-bound time falls.
    shares = []
    for h in (2048, 8192):
        t = layer_times(Transformer(1, h, h // 128, 2048, 1), ROUND, "mixed", 8)
        shares.append(t.memory / (t.memory + t.matmul))
    assert shares[0] > 2 * shares[1]


def test_flash_attention_writes_no_scores_and_recomputes_them():
    model = Transformer(1, 4096, 32, 8192, 1)
    unfused = layer_times(model, ROUND, "mixed")
    flash = layer_times(model, ROUND, "mixed", attention="flash")
    assert flash.memory < unfused.memory / 5  # the s x s softmax and dropout are gone
    assert flash.matmul > unfused.matmul  # one product more in the backward


def test_recomputation_reruns_the_forward_or_the_attention_core():
    model = Transformer(1, 2048, 16, 2048, 1)
    full = layer_times(model, ROUND, "mixed", recompute="full")
    selective = layer_times(model, ROUND, "mixed", recompute="selective")
    assert full.recompute_matmul == pytest.approx(full.forward_matmul)
    assert 0 < selective.recompute_matmul < full.recompute_matmul / 5


def test_tp_splits_the_products_and_gelu_but_not_the_norms():
    # No dropout, flash attention: norms and residual adds (44 bytes an element of h in bf16:
    # 2 x (2+3) x 2 and 2 x (3+3) x 2) stay whole on every GPU; GeLU's 4h (10 bytes each) splits.
    model = Transformer(1, 4096, 32, 2048, 1)
    one, eight = (
        layer_times(model, ROUND, "mixed", t, attention="flash", dropout=False) for t in (1, 8)
    )
    assert eight.matmul == pytest.approx(one.matmul / 8, rel=0.05)
    tokens = 2048
    assert one.memory == pytest.approx(tokens * (44 * 4096 + 10 * 4 * 4096) / 1e12)
    assert eight.memory == pytest.approx(tokens * (44 * 4096 + 10 * 4 * 4096 / 8) / 1e12)
    sp = layer_times(model, ROUND, "mixed", 8, sequence_parallel=True, attention="flash",
                     dropout=False)  # fmt: skip
    assert sp.memory == pytest.approx(eight.memory - tokens * 44 * 4096 * 7 / 8 / 1e12)


def test_flop_conventions():
    # Narayanan et al. 2021 eq. 3, per token, for their 1T model (Table 1's last row).
    gpt = Transformer(128, 25600, 160, 2048, 1, vocab=51200)
    L, h, s, V = 128, 25600, 2048, 51200
    assert flops_per_token(gpt, "megatron") == pytest.approx(
        96 * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    )
    # torchtitan counts Llama 3.1 8B at 57.9e9 per token (6 x non-embedding + 12·L·h·s),
    # 1.129x fewer than 6N + attention with selective recomputation (65.4e9).
    titan = llama(layers=32, hidden=4096, heads=32, seq_len=8192, ffn=14336, vocab=128256,
                  params=8_030_000_000)  # fmt: skip
    assert flops_per_token(titan, "torchtitan") / 1e9 == pytest.approx(57.9, abs=0.05)
    assert compute_flops(titan, 1, "selective") / 1e9 == pytest.approx(65.4, abs=0.05)
    with pytest.raises(ValueError, match="convention"):
        flops_per_token(gpt, "palm")


def test_a_llama_layer_is_gated_with_an_untied_output():
    titan = llama(layers=32, hidden=4096, heads=32, seq_len=8192, ffn=14336, vocab=128256,
                  params=8_030_000_000)  # fmt: skip
    attention, mlp = matrix_params_per_layer(titan)
    assert mlp == 3 * 4096 * 14336
    # q and o (2h²) and GQA's k and v (2 x h·h/4): 41.9M; the count gives it to within 0.1%.
    assert attention == pytest.approx(2 * 4096**2 + 2 * 4096 * 1024, rel=0.001)
