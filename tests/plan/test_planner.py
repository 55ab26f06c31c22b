"""planner: the ZeRO paper's per-parameter figures, memplan's bytes and the ranks' collectives."""

from __future__ import annotations

import inspect

import pytest

import mgtutor
from mgtutor.plan import planner
from mgtutor.plan.activation_plan import activation_bytes_per_layer, activation_terms
from mgtutor.plan.plan_rules import MAX_BUBBLE, refused_layouts
from mgtutor.plan.planner import layouts, plan
from mgtutor.plan.shape import Transformer

GB = 10**9


def count(params: int, **shape) -> Transformer:
    """A model given by its parameter count: one layer holds them all (no embedding)."""
    return Transformer(layers=1, hidden=1, heads=1, seq_len=1, params=params, **shape)


@pytest.mark.parametrize("n", [2, 8, 64])
def test_zero_papers_bytes_per_parameter_exactly(n):
    # Rajbhandari et al. 2019 (arXiv:1910.02054), section 5: 2 + 2 + K bytes per parameter,
    # K = 12 for mixed-precision Adam; ZeRO-1 4 + 12/N, ZeRO-2 2 + 14/N, ZeRO-3 16/N.
    p = 7_500_000_000 if n == 64 else 2**20
    per_stage = {0: 16 * p, 1: 4 * p + 12 * p // n, 2: 2 * p + 14 * p // n, 3: 16 * p // n}
    for zero, want in per_stage.items():
        got = plan(count(p), n, 80 * GB, zero=zero)
        assert got.model_states == want, (zero, got.memory)
        assert got.memory["communication"] == 0  # no DDP buckets unless asked for
    assert plan(count(p), n, GB, zero=2).memory["gradients"] == 2 * p // n


def test_zero_paper_example_in_bytes():
    # The same formulas at the paper's example (7.5B parameters, N = 64): 120, 31.4, 16.6 and
    # 1.875 GB of model states per GPU (computed; the published ones are in ZERO_FIGURE_1).
    states = [plan(count(7_500_000_000), 64, 80 * GB, zero=z).model_states for z in range(4)]
    assert states == [120_000_000_000, 31_406_250_000, 16_640_625_000, 1_875_000_000]


# Published figures, kept apart from what the planner computes: each with where it was read.
# ZeRO (arXiv:1910.02054v3), section 5.1, p. 10, read in the paper's PDF (stored copy: repository
# para1lel/asabook, docs/.vuepress/public/paper/zero.pdf, commit eb62569): "a 7.5 B parameter
# model requires 31.4GB of memory using Pos with 64-way DP (Nd = 64), while requiring 120 GB with
# standard DP"; sections 5.2 and 5.3 give 16.6 GB and 1.9 GB. Notebook 17 checks its Table 1.
ZERO_FIGURE_1 = {
    "source": "arXiv:1910.02054v3, section 5 (PDF in para1lel/asabook at eb62569)",
    "params": 7_500_000_000,
    "gpus": 64,
    "gb_per_gpu": {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9},
}
# The Ultra-Scale Playbook's memory plot for an 8B Llama at micro-batch 1 (its plot data,
# series "Activations", read through the search tool): 4.25, 17 and 68 at sequence lengths
# 1024, 4096 and 16384, in GiB (2**30 bytes). The shape (32 layers, hidden 4096, 32 heads) is
# Llama 3.1 8B's, assumed here; the playbook's series drops the 5as/h attention-score term.
PLAYBOOK_ACTIVATIONS = {
    "source": "https://huggingface.co/spaces/nanotron/ultrascale-playbook/blob/"
    "9f7c465fdb144ed72ddc0706c06dd88cde086862/src/fragments/cp_8Bmemoryusage.html",
    "gib": {1024: 4.25, 4096: 17.0, 16384: 68.0},
}


def test_planner_beside_the_zero_papers_figure_1():
    figure = ZERO_FIGURE_1
    for zero, published in figure["gb_per_gpu"].items():
        computed = plan(count(figure["params"]), figure["gpus"], 80 * GB, zero=zero).model_states
        assert round(computed / GB, 1) == published, (zero, computed)


def test_planner_beside_the_ultrascale_playbooks_activations():
    for seq_len, published in PLAYBOOK_ACTIVATIONS["gib"].items():
        llama = Transformer(layers=32, hidden=4096, heads=32, seq_len=seq_len, micro_batch=1)
        computed = plan(llama, 1, 80 * GB, recompute="selective").memory["activations"]
        assert computed == published * 2**30, seq_len


def test_ddp_zero1_and_fsdp_equal_memplan_in_float32():
    # memplan.estimate equals what breakdown measures inside 2 CPU ranks (test_memplan), so the
    # planner's float32 categories equal the ranks' bytes. An odd count shows rank 0's share.
    torch = pytest.importorskip("torch")
    from mgtutor.plan import memplan

    p = 1_000_001
    cases = [
        ("ddp", 0, True, {}),
        ("ddp", 0, False, {"gradient_as_bucket_view": True}),
        ("zero1", 1, True, {}),
        ("fsdp", 3, False, {}),
    ]
    for strategy, zero, buckets, options in cases:
        expected = memplan.estimate(
            p, dtype=torch.float32, world_size=2, strategy=strategy, **options
        )
        got = plan(count(p), 2, GB, zero=zero, precision="fp32", ddp_buckets=buckets).memory
        for name in ("parameters", "gradients", "optimizer_state", "communication", "transient"):
            assert got[name] == (getattr(expected[0], name) or 0), (strategy, name)


def test_tensor_parallel_block_equals_memplan_in_float32():
    from mgtutor.parallel.tensor import Block
    from mgtutor.plan import memplan

    block = Block(dim=8, n_heads=2, hidden=16)
    styles = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise"}
    styles |= {"attn.o": "rowwise", "mlp.up": "colwise", "mlp.down": "rowwise"}
    expected = memplan.estimate(block, world_size=2, strategy="tp", tp_plan=styles)[0]
    shape = Transformer(layers=1, hidden=8, heads=2, seq_len=4, ffn=16)
    assert shape.total == sum(p.numel() for p in block.parameters())
    got = plan(shape, 2, GB, tp=2, precision="fp32").memory
    assert got["parameters"] == expected.parameters
    assert got["gradients"] == expected.gradients
    # The planner leaves out Adam's float32 `step` scalar, 4 bytes per parameter tensor.
    steps = 4 * len(list(block.parameters()))
    assert got["optimizer_state"] == expected.optimizer_state - steps


def _collectives_in_ranks() -> dict:
    """In each rank: notebook 13's ParallelBlock, counted; DDP's all-reduced bucket bytes."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mgtutor.parallel.comms import record_comms
    from mgtutor.parallel.tensor import Block, ParallelBlock

    mgtutor.setup()
    torch.manual_seed(0)
    block = ParallelBlock(Block(dim=8, n_heads=2, hidden=16))
    with record_comms() as calls:
        block(torch.randn(3, 4, 8)).sum().backward()
    sizes = []

    def hook(state, bucket):
        sizes.append(bucket.buffer().nbytes)
        return allreduce_hook(state, bucket)

    ddp = DDP(Block(dim=8, n_heads=2, hidden=16))
    ddp.register_comm_hook(None, hook)
    ddp(torch.randn(3, 4, 8)).sum().backward()
    return {"tp": [(c.op, c.phase, c.buffer) for c in calls], "ddp": sum(sizes)}


@pytest.fixture(scope="module")
def in_ranks() -> list[dict]:
    return mgtutor.launch(_collectives_in_ranks, world_size=2, backend="gloo").results


def test_collectives_equal_what_ranks_run(in_ranks):
    shape = Transformer(layers=1, hidden=8, heads=2, seq_len=4, micro_batch=3, ffn=16)
    (tp,) = plan(shape, 2, GB, tp=2, precision="fp32").collectives
    assert (tp.name, tp.calls, tp.buffer_bytes) == ("all_reduce", 4, 3 * 4 * 8 * 4)
    for rank in in_ranks:
        assert [(name, nbytes) for name, _, nbytes in rank["tp"]] == [
            (tp.name, tp.buffer_bytes)
        ] * tp.calls
        assert sorted(phase for _, phase, _ in rank["tp"]) == ["backward"] * 2 + ["forward"] * 2
    (dp,) = plan(shape, 2, GB, precision="fp32").collectives
    assert dp.name == "all_reduce" and dp.buffer_bytes == in_ranks[0]["ddp"] == shape.total * 4


def test_communication_volumes():
    p, n = 2**20, 8
    sent = [plan(count(p), n, GB, zero=z).sent_bytes for z in range(4)]
    # A ring all-reduce sends 2(N-1)/N of the buffer; ZeRO-1/2 move the same, ZeRO-3 1.5x
    # (the ZeRO paper's 2 and 3 times the parameters, section 7).
    assert sent[0] == 2 * (n - 1) * p * 2 // n
    assert sent[1] == sent[2] == sent[0] and sent[3] * 2 == sent[0] * 3
    shape = Transformer(layers=4, hidden=64, heads=4, seq_len=32, micro_batch=2)
    activation = 2 * 32 * 64 * 2
    tp = plan(shape, 4, GB, tp=4, micro_batches=3).collectives
    assert [(c.name, c.calls, c.buffer_bytes) for c in tp] == [("all_reduce", 48, activation)]
    sp = plan(shape, 4, GB, tp=4, micro_batches=3, sequence_parallel=True).collectives
    assert [(c.name, c.calls) for c in sp] == [("all_gather", 72), ("reduce_scatter", 48)]
    # Shard-only SP gathers each region's input again in backward: 6 x (t-1)/t + 4 x (t-1)/t
    # of the buffer against TP's 4 x 2(t-1)/t, 1.25 times the bytes (4 and 4 would be equal).
    assert 4 * sum(c.sent_bytes for c in sp) == 5 * tp[0].sent_bytes
    pp = {n: plan(shape, n, GB, pp=n, micro_batches=8).collectives[-1] for n in (2, 4)}
    assert (pp[2].calls, pp[4].calls, pp[4].sent_bytes) == (8, 16, 16 * activation)
    # With SP a stage's output is its share of the sequence: b·s·h/t per send.
    both = plan(shape, 4, GB, tp=2, pp=2, micro_batches=2, sequence_parallel=True)
    assert both.collectives[-1].buffer_bytes == activation // 2


def test_megatrons_float32_gradients_and_the_logits():
    # Megatron-LM's dist_optimizer.md: "float16 param, fp32 grads | 18 | 6 + 12/d" bytes per
    # parameter; the gradients' traffic doubles with them.
    p, n = 2**20, 8
    states = {z: plan(count(p), n, GB, zero=z, precision="mixed_fp32_grads") for z in (0, 1)}
    assert states[0].model_states == 18 * p and states[1].model_states == 6 * p + 12 * p // n
    grads = plan(count(p), n, GB, precision="mixed_fp32_grads").sent_bytes
    assert grads == 2 * plan(count(p), n, GB).sent_bytes
    # The loss upcasts the output layer's logits: b·s·V float32 values (b·s·V/t per TP rank).
    shape = Transformer(layers=2, hidden=8, heads=2, seq_len=16, micro_batch=2, vocab=100)
    assert plan(shape, 2, GB, tp=2).memory["logits"] == 4 * 2 * 16 * 100 // 2


def _tp_collectives_in_ranks() -> dict:
    """ParallelGPTLayer on each rank: every c10d call, by layout and recomputation; its bytes
    kept with the gathered inputs; and whether Schedule1F1B and ScheduleGPipe take fewer
    micro-batches than stages."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from mgtutor.experiments import traffic
    from mgtutor.measure.activations import kept_for_backward
    from mgtutor.parallel.comms import record_comms
    from mgtutor.parallel.gpt_layer import GPTLayer, ParallelGPTLayer

    mgtutor.setup()
    rank = dist.get_rank()
    torch.manual_seed(0)
    layer, x = GPTLayer(16, 4, p=0.1), torch.randn(3, 4, 16)
    variants = {
        "tp": (ParallelGPTLayer(layer), x),
        "sp": (ParallelGPTLayer(layer, sequence_parallel=True), x.chunk(2, 1)[rank]),
        "sp_kept": (
            ParallelGPTLayer(layer, sequence_parallel=True, keep_gathered=True),
            x.chunk(2, 1)[rank],
        ),
    }
    out: dict = {}
    for name, (module, inputs) in variants.items():
        for recompute in ("none", "full"):
            with record_comms() as calls:
                if recompute == "full":
                    y = torch.utils.checkpoint.checkpoint(module, inputs, use_reentrant=False)
                else:
                    y = module(inputs)
                y.sum().backward()
            out[name, recompute] = traffic.tally(calls, "tp")
    out["kept"] = {name: kept_for_backward(m, i)[1] for name, (m, i) in variants.items()}
    if inspect.signature(PipelineStage).parameters["input_args"].default is inspect.Parameter.empty:
        out["1f1b"] = None  # torch 2.4: a stage needs example inputs; the refusal is read on 2.5+
        return out
    stage = PipelineStage(torch.nn.Linear(8, 8), rank, 2, torch.device("cpu"))
    for name, schedule in (("1f1b", Schedule1F1B), ("gpipe", ScheduleGPipe)):
        refused = {}
        for micro_batches in (1, 2):
            try:
                schedule(stage, n_microbatches=micro_batches)
                refused[micro_batches] = None
            except ValueError:
                refused[micro_batches] = "ValueError"
        out[name] = refused
    return out


@pytest.fixture(scope="module")
def tp_in_ranks() -> list[dict]:
    return mgtutor.launch(_tp_collectives_in_ranks, world_size=2, backend="gloo").results


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("variant", ["tp", "sp", "sp_kept"])
def test_tp_and_sp_collectives_equal_what_ranks_run(tp_in_ranks, variant, recompute):
    # One layer, one micro-batch: the planner's per-layer calls and buffers against every c10d
    # call the two ranks made (shard-only SP: 6 all-gathers and 4 reduce-scatters).
    shape = Transformer(layers=1, hidden=16, heads=4, seq_len=4, micro_batch=3)
    options = {"sequence_parallel": variant != "tp", "keep_gathered": variant == "sp_kept"}
    planned = plan(shape, 2, GB, tp=2, precision="fp32", recompute=recompute, **options)
    want = tuple(sorted(planned.collectives, key=lambda c: (c.group, c.name)))
    for rank in tp_in_ranks:
        assert rank[variant, recompute] == want


def test_kept_gathered_inputs_equal_the_activation_terms(tp_in_ranks):
    shape = Transformer(layers=1, hidden=16, heads=4, seq_len=4, micro_batch=3)
    for variant, options in {"sp": {}, "sp_kept": {"keep_gathered": True}}.items():
        planned = activation_terms(shape, 2, True, "fp32", norm_stat_bytes=4, **options)
        for rank in tp_in_ranks:
            assert rank["kept"][variant] == planned, variant
    sp, kept = (tp_in_ranks[0]["kept"][v] for v in ("sp", "sp_kept"))
    assert kept["qkv input"] == 2 * sp["qkv input"] == 3 * 4 * 16 * 4


def test_planner_refuses_only_what_torch_refuses(tp_in_ranks):
    shape = Transformer(layers=4, hidden=8, heads=2, seq_len=4)
    with pytest.raises(ValueError, match="Schedule1F1B"):
        plan(shape, 2, GB, pp=2, micro_batches=1)
    assert plan(shape, 2, GB, pp=2, micro_batches=2).bubble == 1 / 3
    assert plan(shape, 2, GB, pp=2, micro_batches=1, schedule="GPipe").bubble == 1 / 2
    with pytest.raises(ValueError, match="schedule must be one of"):
        plan(shape, 2, GB, pp=2, micro_batches=2, schedule="1f1b")
    assert dict(refused_layouts(shape, 4, micro_batches=2)).keys() == {"dp=1 x tp=1 x pp=4"}
    assert not refused_layouts(shape, 4, micro_batches=2, schedule="GPipe")
    # Schedule1F1B with 2 stages: ValueError with 1 micro-batch, none with 2; GPipe takes both.
    if any(rank["1f1b"] is None for rank in tp_in_ranks):
        pytest.skip("torch 2.4's PipelineStage needs example inputs; Schedule1F1B not run")
    for rank in tp_in_ranks:
        assert rank["1f1b"] == {1: "ValueError", 2: None}
        assert rank["gpipe"] == {1: None, 2: None}


def test_fsdp_under_a_pipeline_holds_the_whole_stage_unsharded():
    # torch's stage keeps FSDP's parameters and gradients unsharded from micro-batch to
    # micro-batch: the whole stage, on top of the shards; gathered and reduced once per step.
    shape = Transformer(layers=4, hidden=8, heads=2, seq_len=4, vocab=10)
    b_param, b_grad, _ = planner.BYTES_PER_PARAMETER["mixed"]
    alone = plan(shape, 2, GB, pp=2, micro_batches=4)  # the stage's parameters, whole
    held = alone.memory["parameters"] // b_param
    for zero in (2, 3):
        p = plan(shape, 4, GB, dp=2, pp=2, zero=zero, micro_batches=4)
        whole_params = -(-held // 2) * 2 * b_param if zero == 3 else 0
        assert p.memory["transient"] == held * b_grad + whole_params
        sent = {c.name: (c.calls, c.buffer_bytes) for c in p.collectives if c.group == "dp"}
        assert sent == {"all_gather": (1, held * b_param), "reduce_scatter": (1, held * b_grad)}
    # Without a pipeline, ZeRO-3 holds one unit unsharded and gathers per micro-batch.
    flat = plan(shape, 2, GB, zero=3, micro_batches=4)
    assert flat.memory["transient"] < held * b_grad
    assert {c.name: c.calls for c in flat.collectives} == {"all_gather": 8, "reduce_scatter": 4}


def test_activations_follow_korthikanti():
    s, b, h, a = 128, 2, 64, 4
    shape = Transformer(layers=6, hidden=h, heads=a, seq_len=s, micro_batch=b)
    one = activation_bytes_per_layer(shape)
    assert one == s * b * h * 34 + 5 * a * s * s * b
    assert activation_bytes_per_layer(shape, tp=4) == s * b * h * (10 + 24 // 4) + (
        5 * a * s * s * b // 4
    )
    assert activation_bytes_per_layer(shape, tp=4, sequence_parallel=True) == one // 4
    assert activation_bytes_per_layer(shape, recompute="selective") == 34 * s * b * h
    assert activation_bytes_per_layer(shape, recompute="full") == 2 * s * b * h
    # 1F1B: the first of 3 stages keeps its 2 layers for 3 micro-batches in flight.
    got = plan(shape, 3, GB, pp=3, micro_batches=8).memory["activations"]
    assert got == one * 2 * 3
    # GPipe: every forward before any backward, all 8 micro-batches in flight.
    got = plan(shape, 3, GB, pp=3, micro_batches=8, schedule="GPipe").memory["activations"]
    assert got == one * 2 * 8
    assert "Korthikanti" in plan(shape, 1, GB).activations_source


def test_layouts_rank_by_the_rule_not_by_bytes():
    shape = Transformer(layers=32, hidden=4096, heads=32, seq_len=4096, vocab=32000)
    found = layouts(shape, 8, 80 * GB, recompute="selective", micro_batches=8)
    names = {p.layout for p in found}
    # By bytes alone pp=8 (bubble 7/15) would come first: it sends least of all.
    assert min(found, key=lambda p: p.sent_bytes).layout == "dp=1 x tp=1 x pp=8"
    assert found[0].bubble <= MAX_BUBBLE < found[-1].bubble
    assert not refused_layouts(shape, 8, micro_batches=8)
    assert {"dp=2 (ZeRO-3) x tp=1 x pp=4", "dp=2 x tp=1 x pp=4"} <= names  # FSDP runs with PP
    few = {p.layout for p in layouts(shape, 8, 80 * GB, recompute="selective", micro_batches=4)}
    refused = dict(refused_layouts(shape, 8, micro_batches=4))
    assert "dp=1 x tp=1 x pp=8" in refused and not few & set(refused)  # 1F1B: 4 for 8 stages
    gpipe = layouts(shape, 8, 80 * GB, recompute="selective", micro_batches=4, schedule="GPipe")
    assert "dp=1 x tp=1 x pp=8" in {p.layout for p in gpipe}
    assert not layouts(shape, 1, 80 * GB)
    assert "ZeRO-3" in plan(shape, 8, 80 * GB, zero=3).layout


def test_clear_errors():
    shape = Transformer(layers=2, hidden=8, heads=2, seq_len=4)
    with pytest.raises(ValueError, match="must equal gpus"):
        plan(shape, 8, GB, tp=2, dp=2)
    with pytest.raises(ValueError, match="heads cannot be split"):
        plan(shape, 4, GB, tp=4)
    with pytest.raises(ValueError, match="at most one stage a layer"):
        plan(shape, 4, GB, pp=4)
    with pytest.raises(ValueError, match="ZeRO stage"):
        plan(shape, 2, GB, zero=4)
    with pytest.raises(ValueError, match="precision must be one of"):
        plan(shape, 2, GB, precision="fp8")
    with pytest.raises(ValueError, match="recompute must be one of"):
        plan(shape, 2, GB, recompute="some")
    with pytest.raises(ValueError, match="style must be"):
        Transformer(layers=2, hidden=8, heads=2, seq_len=4, style="bert")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs params"):
        Transformer(layers=2, hidden=8, heads=2, seq_len=4, style="llama")


def test_tp_keeps_the_norms_and_biases_of_each_style_whole():
    # GPT's two LayerNorms (weight, bias) and two row-parallel biases; Llama's two RMSNorm
    # weights and no biases (notebook 17 counts both on ranks under parallelize_module).
    gpt = Transformer(layers=2, hidden=8, heads=2, seq_len=4)
    llama = Transformer(layers=2, hidden=8, heads=2, seq_len=4, params=2000, style="llama")
    assert (gpt.replicated_per_layer, llama.replicated_per_layer) == (48, 16)
    for model in (gpt, llama):
        layer = (
            plan(model, 2, GB, tp=2).memory["parameters"]
            - plan(model, 1, GB).memory["parameters"] // 2
        )  # what TP=2 keeps beyond half: the whole parameters' other half, 2 bytes each
        assert layer == 2 * model.layers * model.replicated_per_layer // 2
