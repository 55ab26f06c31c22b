"""The whole DDP training program, with nothing but torch: copy it, change the model and the data.

Run it either way (the same seeds give the same losses, to rounding: with more than one worker
torchrun sets OMP_NUM_THREADS=1, mp.spawn leaves torch's default thread count):

    torchrun --standalone --local-addr=127.0.0.1 --nproc-per-node=2 plain_ddp.py  # torchrun
    python plain_ddp.py --spawn 2                                                  # mp.spawn

(--local-addr=127.0.0.1: without it the workers' MASTER_ADDR is this machine's name, which
reaches it only where the name resolves.)

Each worker: join the process group, pick its device, wrap the model in DDP, read its shard
of the data through a DistributedSampler, train, leave the process group.
"""

import argparse
import gc
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS, BATCH_PER_RANK, LR = 2, 16, 0.1


def small_cnn():
    # The workbook's small CNN (mgtutor.models.small_cnn), written out: this file needs only torch.
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


def synthetic_data(n=256, seed=0):
    # Every rank builds the same dataset from the same seed; the sampler gives each its shard.
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 16, 16, generator=generator)
    labels = torch.randint(0, 10, (n,), generator=generator)
    return TensorDataset(images, labels)


def main(local_rank, world_size):
    # torchrun sets RANK; mp.spawn sets nothing, and on one machine rank == local_rank.
    rank = int(os.environ.get("RANK", local_rank))
    if rank == 0:
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "MASTER_ADDR")
        seen = {name: os.environ.get(name) for name in names}
        print(f"rank 0 environment: {seen}", flush=True)

    # NCCL needs a GPU of its own for each worker on this machine (LOCAL_WORLD_SIZE, torchrun).
    # One torchrun per machine: two on one machine would give two workers the same LOCAL_RANK.
    local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    use_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_workers
    if use_gpus:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before anything touches CUDA: one GPU per process
        dist.init_process_group(
            "nccl",
            rank=rank,
            world_size=world_size,
            device_id=device,
            timeout=timedelta(minutes=10),
        )
    else:
        device = torch.device("cpu")
        pin_gloo_to_loopback(world_size)
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=10)
        )

    if rank == 0:
        interface = "" if use_gpus else f", gloo on {os.environ.get('GLOO_SOCKET_IFNAME')}"
        print(f"backend {dist.get_backend()}, rank 0 on {device}{interface}", flush=True)

    torch.manual_seed(0)  # DDP copies rank 0's weights to every rank anyway
    model = DDP(small_cnn().to(device), device_ids=[local_rank] if use_gpus else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    data = synthetic_data()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH_PER_RANK, sampler=sampler)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        loss_sum, count = 0.0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients over the ranks here
            optimizer.step()
            loss_sum, count = loss_sum + loss.item() * len(x), count + len(x)
        totals = torch.tensor([loss_sum, count], dtype=torch.float64, device=device)
        dist.all_reduce(totals)  # every rank calls the collective; only rank 0 prints
        if rank == 0:
            print(f"epoch {epoch}: mean training loss {totals[0] / totals[1]:.6f}", flush=True)

    # Free DDP (its reducer holds the process group), collected now rather than whenever the
    # garbage collector runs, then destroy the group, on every rank, before the process exits.
    # Left to the interpreter's exit, torch 2.14.1's gloo group aborted workers here ("terminate
    # called without an active exception", cf. pytorch#190489).
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


def pin_gloo_to_loopback(world_size):
    # Unless told (GLOO_SOCKET_IFNAME), gloo binds to the address this machine's hostname
    # resolves to, and to loopback only when it resolves to none (createDefaultDevice in torch's
    # ProcessGroupGloo.hpp): a network address, which a firewall or a down link can keep the
    # other ranks from reaching. With every rank on this machine, loopback is enough: "lo" on
    # Linux, "lo0" on macOS. Across machines, set GLOO_SOCKET_IFNAME to the network's interface.
    # Whether every rank is here is told by the worker counts, not by MASTER_ADDR: torchrun
    # --standalone sets MASTER_ADDR to --local-addr, else this machine's name (socket.getfqdn() in
    # _NodeDescGenerator.generate, torch 2.14.1's
    # distributed/elastic/rendezvous/dynamic_rendezvous.py).
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    if int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) != world_size:
        return  # some ranks run on other machines
    names = [name for _, name in socket.if_nameindex()]
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    if loopback is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--spawn",
        type=int,
        metavar="NPROC",
        help="start NPROC workers with torch.multiprocessing.spawn",
    )
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:  # started by torchrun, which set the whole environment
        main(int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    elif args.spawn:
        os.environ["MASTER_ADDR"] = "127.0.0.1"  # mp.spawn sets none of it: the workers
        os.environ["MASTER_PORT"] = str(free_port())  # inherit these two from here
        mp.spawn(main, args=(args.spawn,), nprocs=args.spawn)  # calls main(i, *args)
    else:
        parser.error("run it with torchrun, or with --spawn NPROC")
