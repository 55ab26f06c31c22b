"""The step of each configuration the step-time check runs, built on one rank.

:func:`build` returns a rank's step function for a :class:`~mgtutor.experiments.step_check.Config`:
real :class:`~mgtutor.parallel.gpt_layer.GPTLayer` steps (one process, DDP, TP with
:class:`~mgtutor.parallel.gpt_layer.ParallelGPTLayer`, a 2-stage ``Schedule1F1B``), or the
emulated GPU's (:mod:`mgtutor.measure.emulated`): DDP over a wire with ``no_sync`` before the last
micro-batch, TP whose backward all-reduces overlap the weight gradient, a 2-stage
``Schedule1F1B`` whose sends take a wire's seconds.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build"]


def _loss(out: Any, _: Any = None) -> Any:
    return out.pow(2).mean()


def _pipeline(modules: list, rank: int, micro_batches: int, x: Any) -> Any:
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage = PipelineStage(torch.nn.Sequential(*modules), rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=micro_batches, loss_fn=_loss)
    return (lambda: schedule.step(x)) if rank == 0 else (lambda: schedule.step(target=x))


def _real(config: Any) -> Any:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from mgtutor.parallel.gpt_layer import GPTLayer, ParallelGPTLayer

    model, m = config.model, config.micro_batches
    torch.manual_seed(0)
    layers = [GPTLayer(model.hidden, model.heads, p=0.0) for _ in range(model.layers)]
    x = torch.randn(model.micro_batch * m, model.seq_len, model.hidden)
    if config.pp > 1:
        rank, per = dist.get_rank(), model.layers // config.pp
        return _pipeline(layers[rank * per : (rank + 1) * per], rank, m, x)
    module: torch.nn.Module
    if config.tp > 1:
        module = torch.nn.Sequential(*(ParallelGPTLayer(layer) for layer in layers))
    elif config.dp > 1:
        module = DistributedDataParallel(torch.nn.Sequential(*layers))
    else:
        module = torch.nn.Sequential(*layers)

    def step() -> None:
        module.zero_grad(set_to_none=True)
        _loss(module(x)).backward()

    return step


def _emulated(config: Any, wire: Any) -> Any:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from mgtutor.measure.emulated import (
        REAL_HIDDEN,
        EmulatedLayer,
        Stamp,
        Unstamp,
        ddp_hook,
        emulated_device,
    )

    model, m = config.model, config.micro_batches
    device = emulated_device(model, config.tp, config.rate, config.slow_wgrad)
    tp = config.tp
    layers = [EmulatedLayer(model, device, tp, wire) for _ in range(model.layers)]
    x = torch.randn(m, 4, REAL_HIDDEN)
    if config.pp > 1:
        rank, per = dist.get_rank(), model.layers // config.pp
        seconds = 4 * model.micro_batch * model.seq_len * model.hidden / config.link
        mine = layers[rank * per : (rank + 1) * per]
        return _pipeline([*mine, Stamp(seconds)] if rank == 0 else [Unstamp(seconds), *mine],
                         rank, m, x)  # fmt: skip
    module: torch.nn.Module = torch.nn.Sequential(*layers)
    if config.dp > 1:
        declared = {k: v for layer in layers for k, v in layer.declared.items()}
        module = DistributedDataParallel(module, bucket_cap_mb=1.0)
        module.register_comm_hook((wire, declared), ddp_hook)

    def step() -> None:
        module.zero_grad(set_to_none=True)
        for i in range(m):
            if isinstance(module, DistributedDataParallel) and i < m - 1:  # config.dp > 1
                with module.no_sync():
                    _loss(module(x[i : i + 1])).backward()
            else:
                _loss(module(x[i : i + 1])).backward()

    return step


def build(config: Any) -> tuple[Any, Any]:
    """This rank's step function for ``config``, and its emulated wire (None for real work:
    close it when done)."""
    if not config.emulated:
        return _real(config), None
    from mgtutor.measure.emulated import Wire

    wire = Wire(config.link)
    return _emulated(config, wire), wire
