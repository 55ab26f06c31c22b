"""The plain-PyTorch worker that ``launch_latency.py`` compares ``mgtutor.launch`` against.

``torch.multiprocessing.spawn`` pickles its function *by name*, so the function must live in an
importable module (not in a notebook cell, not in the benchmark script's ``__main__``). This is
that module. The worker does what the mgtutor case does and nothing more: join a gloo process
group, pass one barrier, leave the group.

It is kept tiny on purpose: every spawned worker imports this file, and anything slow here
would be charged to plain spawn and flatter mgtutor.
"""

from __future__ import annotations

import os


def join_and_barrier(rank: int, world_size: int, port: int) -> None:
    """Run one rank: set torchrun's variables by hand, init gloo, one barrier, destroy.

    Args:
        rank: this worker's rank; ``torch.multiprocessing.spawn`` passes it first.
        world_size: number of ranks.
        port: a free port on 127.0.0.1 for the rendezvous store (rank 0 hosts it).
    """
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)

    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    dist.barrier()
    dist.destroy_process_group()
