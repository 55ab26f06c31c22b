"""The workbook's DDP training function as a script, for torchrun, srun and several machines.

`train` is the training function of the earlier notebooks: mgtutor.setup() reads whatever
environment the launcher provides (torchrun's RANK/LOCAL_RANK/WORLD_SIZE, or SLURM's
SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS) and picks NCCL only when every rank has a GPU of its own
on its machine (two torchrun "nodes" on one machine included), else gloo on the CPU, unless
--backend names one; each worker prints which. Run it with, for example:

    torchrun --standalone --nproc-per-node=2 notebooks/scripts/train_ddp.py --epochs 3

With --snapshot, rank 0 saves a snapshot after every epoch (model, optimizer, LR scheduler,
GradScaler, every rank's random number generator states, the sampler's seed and epoch, the loss
curve so far) and every rank resumes from it when it exists, so `torchrun --max-restarts=N` can
restart a failed job where it stopped and continue the same loss curve: bit for bit with two CPU
workers (notebook 09 checks it). Its limits: the first step after a resume all-reduces in DDP's
one initial bucket, so with more ranks the weights can differ in their last bits; on GPUs, bit
for bit also needs deterministic kernels (torch.use_deterministic_algorithms(True)); and every
rank reads the snapshot, so on several machines it must be on storage every node reads.

`main` is decorated with torch's `@record`, so an exception in a worker is written to the error
file torchrun names (TORCHELASTIC_ERROR_FILE) and torchrun's failure summary shows its message
and traceback.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import mgtutor
from mgtutor.data import default_dataset
from mgtutor.models import small_cnn

try:
    import numpy as np
except ImportError:  # numpy is optional for torch; nothing here needs it
    np = None

# What torchrun tells each worker (torch/distributed/elastic/agent/server/local_elastic_agent.py).
CONTRACT = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    if np is not None:
        np.random.seed(seed)
    torch.manual_seed(seed)  # the CPU generator and every CUDA device's


def rng_states(device: torch.device) -> dict:
    """This process's random generator states, in types torch.load(weights_only=True) reads."""
    states = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        states["numpy"] = (kind, keys.tolist(), pos, has_gauss, cached)
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"].cpu())  # map_location may have moved it to the GPU
    if np is not None and "numpy" in states:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)


def train(
    epochs: int,
    batch_size: int,
    snapshot: str | None = None,
    crash_once: str | None = None,
    fail_on_rank: int | None = None,
    record_epochs: str | None = None,
    backend: str | None = None,
) -> dict:
    device = mgtutor.setup(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    contract = {name: int(os.environ[name]) for name in CONTRACT if name in os.environ}
    seen = " ".join(f"{name}={value}" for name, value in contract.items())
    # One write: torchrun runs workers unbuffered (python -u), where print's text and its newline
    # are two writes, and another worker's line could land between them.
    sys.stdout.write(f"{seen} | {dist.get_backend()} on {device}\n")
    sys.stdout.flush()
    if fail_on_rank == rank:
        raise ValueError(f"rank {rank} cannot read its shard (raised on purpose by --fail-on-rank)")
    data = default_dataset("train", n=1024)
    # The data order depends only on the sampler's seed and epoch: the same on every rank and
    # after a restart, whatever the global random state.
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    torch.manual_seed(0)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = DDP(small_cnn().to(device))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * len(loader))
    # Mixed precision (float16) where it helps, on CUDA; elsewhere the scaler is disabled and
    # its state_dict() is empty, but it is saved and loaded all the same.
    amp = device.type == "cuda"
    scaler = torch.amp.GradScaler(device.type, enabled=amp)
    # Each rank its own random stream (the noise below differs between ranks): seed + rank.
    seed_everything(1 + rank)
    losses: list[float] = []  # mean over ranks, per step
    first_epoch = 0
    if snapshot and Path(snapshot).exists():
        state = mgtutor.load_checkpoint(snapshot, map_location=device)
        if len(state["rng"]) != world_size:
            raise RuntimeError(
                f"the snapshot holds the random states of {len(state['rng'])} ranks, "
                f"this job has {world_size}"
            )
        if state["sampler"]["seed"] != sampler.seed:
            raise RuntimeError("the sampler's seed changed: the data order would not continue")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        set_rng_states(state["rng"][rank], device)
        losses = state["losses"]
        first_epoch = state["sampler"]["epoch"] + 1
        if rank == 0:
            print(f"resuming from the snapshot of epoch {state['sampler']['epoch']}", flush=True)
    for epoch in range(first_epoch, epochs):
        sampler.set_epoch(epoch)
        step_losses = []
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            x = x + 0.1 * torch.randn(x.shape, device=device)  # a random augmentation: noise
            with torch.autocast(device.type, dtype=torch.float16, enabled=amp):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step_losses.append(loss.detach().float())
        if record_epochs:
            # What this rank saw in this epoch, before anything below can fail: its own losses
            # and the weights after the epoch, per restart attempt.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            Path(f"{record_epochs}.attempt{attempt}.epoch{epoch}.rank{rank}.json").write_text(
                json.dumps(
                    {
                        "losses": [loss.item() for loss in step_losses],
                        "weights": torch.cat([p.detach().flatten() for p in model.parameters()])
                        .cpu()
                        .tolist(),
                    }
                )
            )
        if crash_once and rank == 1 and epoch == 1 and not Path(crash_once).exists():
            Path(crash_once).touch()
            print("rank 1 dies now, as if the out-of-memory killer had struck", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        curve = torch.stack(step_losses)
        dist.all_reduce(curve)  # one all-reduce per epoch for the whole curve
        losses += (curve / world_size).tolist()
        if snapshot:
            # Every rank's generators differ (seed + rank), so rank 0 gathers them all.
            gathered = [None] * world_size if rank == 0 else None
            dist.gather_object(rng_states(device), gathered, dst=0)
        if rank == 0:
            print(f"epoch {epoch}: mean loss of the last step {losses[-1]:.4f}", flush=True)
            if snapshot:
                mgtutor.save_checkpoint(
                    {
                        "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict(),
                        "rng": gathered,
                        "sampler": {"seed": sampler.seed, "epoch": epoch},
                        "losses": losses,
                    },
                    snapshot,
                )
        dist.barrier()  # nobody starts the next epoch before the snapshot is complete
    weights = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    return {
        **{name.lower(): value for name, value in contract.items()},
        "master_addr": os.environ.get("MASTER_ADDR"),
        "backend": dist.get_backend(),
        "device": str(device),
        "weights": weights.tolist(),
        "losses": losses,
    }


@record
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--snapshot", help="save a snapshot here every epoch; resume from it")
    parser.add_argument(
        "--crash-once",
        metavar="MARKER",
        help="kill rank 1 with SIGKILL after epoch 1, once (MARKER remembers)",
    )
    parser.add_argument(
        "--fail-on-rank", type=int, metavar="R", help="raise an exception on rank R at the start"
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        help="by default NCCL where every rank has a GPU of its own on its machine, else gloo",
    )
    parser.add_argument("--result", help="write each rank's result to RESULT.rank<N>.json")
    parser.add_argument(
        "--record-epochs",
        metavar="PREFIX",
        help="after each epoch, write each rank's losses and weights to "
        "PREFIX.attempt<A>.epoch<E>.rank<N>.json (A: torchrun's restart count)",
    )
    args = parser.parse_args()
    result = train(
        args.epochs,
        args.batch_size,
        args.snapshot,
        args.crash_once,
        args.fail_on_rank,
        args.record_epochs,
        args.backend,
    )
    if args.result:
        Path(f"{args.result}.rank{result['rank']}.json").write_text(json.dumps(result))
    gc.collect()  # free train's DDP model (a reference cycle) before its group: see plain_ddp.py
    mgtutor.teardown()


if __name__ == "__main__":
    main()
