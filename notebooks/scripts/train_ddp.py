"""The workbook's DDP training function as a script, for torchrun, srun and several machines.

`train` is the same function the notebooks launch with mgtutor.launch: mgtutor.setup() reads
whatever environment the launcher provides (torchrun's RANK/LOCAL_RANK/WORLD_SIZE, or SLURM's
SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS). Run it with, for example:

    torchrun --standalone --nproc-per-node=2 notebooks/scripts/train_ddp.py --epochs 3

With --snapshot, rank 0 saves a snapshot after every epoch and every rank resumes from it when
it exists, so `torchrun --max-restarts=N` can restart a failed job where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import mgtutor
from mgtutor.data import default_dataset


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def train(
    epochs: int, batch_size: int, snapshot: str | None = None, crash_once: str | None = None
) -> dict:
    device = mgtutor.setup()
    rank = dist.get_rank()
    data = default_dataset("train", n=1024)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(small_cnn().to(device))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    first_epoch = 0
    if snapshot and Path(snapshot).exists():
        state = mgtutor.load_checkpoint(snapshot, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first_epoch = state["epoch"] + 1
        if rank == 0:
            print(f"resuming from the snapshot of epoch {state['epoch']}", flush=True)
    for epoch in range(first_epoch, epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if crash_once and rank == 1 and epoch == 1 and not Path(crash_once).exists():
            Path(crash_once).touch()
            print("rank 1 dies now, as if the out-of-memory killer had struck", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= dist.get_world_size()
        if rank == 0:
            print(f"epoch {epoch}: mean loss of the last step {mean_loss.item():.4f}", flush=True)
            if snapshot:
                mgtutor.save_checkpoint(
                    {
                        "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "epoch": epoch,
                    },
                    snapshot,
                )
        dist.barrier()  # nobody starts the next epoch before the snapshot is complete
    weights = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    return {
        "rank": rank,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "world_size": dist.get_world_size(),
        "group_rank": int(os.environ.get("GROUP_RANK", 0)),
        "weights": weights.tolist(),
        "loss": mean_loss.item(),
    }


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
    parser.add_argument("--result", help="write each rank's result to RESULT.rank<N>.json")
    args = parser.parse_args()
    result = train(args.epochs, args.batch_size, args.snapshot, args.crash_once)
    if args.result:
        Path(f"{args.result}.rank{result['rank']}.json").write_text(json.dumps(result))
    mgtutor.teardown()


if __name__ == "__main__":
    main()
