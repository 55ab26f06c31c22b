"""Replicas that die and come back: data parallelism over a membership that changes mid-run.

Built by hand on torch's own primitives, the shape torchft gives it (notebook 19):

* a :class:`torch.distributed.TCPStore`, hosted by the coordinator (:func:`run_replicas`, the
  notebook's process), holds the *quorum*: an epoch number and its members. The coordinator
  watches the replica processes; when one dies it publishes the next epoch without it, and when
  it has been restarted, the next epoch with it again.
* each epoch gets a fresh ``ProcessGroupGloo`` over a ``PrefixStore`` of its own: a gloo group
  fixes its ranks and size when it is built, and after a peer has died its connections are
  broken, so a group cannot shrink or grow; the prefix keeps each epoch's rendezvous keys apart.
* each step, every member all-reduces its gradient with one more number appended: 1 if a
  replica waits to join. The sum is the same on every member, so all agree on the step after
  which the group grows. A member killed before its all-reduce (the only death exercised)
  makes the others' all-reduce fail (none of them can finish without its share); they drop
  that group at once (a survivor still waiting in it on them then fails too, rather than at
  gloo's timeout) and redo that step in the next epoch.
* a new epoch starts with a broadcast from a survivor of the whole training state (parameters,
  momentum, step, samples seen): the rejoining replica continues from the others' state.
* when the coordinator restarts a replica it names a step (``join_by``) from which the members
  wait for the join request before their all-reduce, so that the join does not depend on how
  fast a process starts (a spawned one imports torch afresh); members that agreed to a join go
  on to the next epoch even after the last step, so that the joiner still gets the state.
* at the last step the members wait, before their all-reduce, until the coordinator has acted
  on every step before it (the ``decided`` key): a restart due by then has its ``join_by`` set,
  so the join does not depend on how often the coordinator polls.

A step is committed when its all-reduce succeeded; the step and the samples seen advance only
then, and the member of rank 0 writes the step's members into the store, once per step.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mgtutor.build import rank_start_method
from mgtutor.hardware import loopback_interface

__all__ = ["ElasticRun", "batch", "make_model", "replay", "run_replicas"]

LR, MOMENTUM, FEATURES = 0.05, 0.9, 8


def make_model() -> nn.Module:
    """The replicas' model, the same initial weights in every process."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def batch(step: int, slot: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of the member in ``slot`` (its rank in the step's group) at global ``step``."""
    g = torch.Generator().manual_seed(10_000 * step + slot)
    x = torch.randn(size, FEATURES, generator=g, dtype=torch.float64)
    return x, torch.sin(x.sum(1, keepdim=True))


def _flat(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    flat = []
    for t in tensors:
        assert t is not None  # a gradient: every parameter of this small model has one
        flat.append(t.detach().reshape(-1))
    return torch.cat(flat)


def _unflat(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _sgd_step(
    params: Sequence[torch.Tensor], momenta: list[torch.Tensor], grads: torch.Tensor
) -> None:
    # SGD with momentum written out, so that its state is two tensors a broadcast can carry.
    offset = 0
    with torch.no_grad():
        for p, m in zip(params, momenta):
            g = grads[offset : offset + p.numel()].view_as(p)
            m.mul_(MOMENTUM).add_(g)
            p.sub_(LR * m)
            offset += p.numel()


def _quorum(store: dist.TCPStore, after: int, rid: int) -> dict:
    while True:
        quorum = json.loads(store.get("quorum"))
        if quorum["epoch"] > after and rid in quorum["members"]:
            return quorum
        time.sleep(0.02)


def _join_pending(store: dist.TCPStore, step: int) -> bool:
    # The coordinator writes "join_by" when it restarts a replica: from that step on, a member
    # waits for the join request before its all-reduce, so that a slow restart (spawn, a fresh
    # interpreter importing torch) delays the survivors rather than missing the run's end.
    return store.check(["join_by"]) and step >= int(store.get("join_by"))


def _await_decision(store: dist.TCPStore, step: int) -> None:
    # The coordinator writes "decided" = the committed steps it has acted on (deaths, restarts)
    # after each poll. At the last step a member waits for it to reach this step, so that a
    # restart due now is written ("join_by") before the members could finish without it.
    while int(store.get("decided")) < step:
        time.sleep(0.01)


def _replica(
    rid: int, port: int, steps: int, size: int, die_at: int | None, step_seconds: float,
    interface: str | None, straggle: tuple[int, float] | None = None,
) -> None:
    """One replica's life: join each quorum, train, and die (SIGKILL, before its all-reduce) at
    the first step at or after ``die_at`` that it takes part in, or finish."""
    torch.set_num_threads(1)
    if interface:  # gloo's sockets on loopback, as mgtutor's launcher pins them
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    store.add(f"ready/{rid}", 1)  # this life is started: the coordinator may ask to join
    model = make_model()
    params = list(model.parameters())
    momenta = [torch.zeros_like(p) for p in params]
    step, samples, epoch, grow = 0, 0, -1, False
    failed_waits: list[float] = []  # seconds spent in each all-reduce that failed
    # A member that agreed to a join goes to the next epoch even after the last step, so that
    # the joiner gets its state (a join agreed at the last step would otherwise strand it).
    while step < steps or grow:
        quorum = _quorum(store, epoch, rid)
        epoch, members = quorum["epoch"], quorum["members"]
        rank = members.index(rid)
        group = dist.ProcessGroupGloo(
            dist.PrefixStore(f"epoch{epoch}", store), rank, len(members), timedelta(seconds=20)
        )
        state = torch.cat([_flat(params), _flat(momenta), torch.tensor([step, samples])]).double()
        opts = dist.BroadcastOptions()
        opts.rootRank = members.index(quorum["source"])
        group.broadcast([state], opts).wait()  # type: ignore[attr-defined]
        with torch.no_grad():
            _unflat(state[: -2], [*params, *momenta])
        step, samples, grow = int(state[-2]), int(state[-1]), False
        while step < steps:
            x, y = batch(step, rank, size)
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
            time.sleep(step_seconds)
            if step == steps - 1:
                _await_decision(store, step)
            while _join_pending(store, step) and not store.check(["join_request"]):
                time.sleep(0.01)
            joining = float(store.check(["join_request"]))
            buffer = torch.cat([_flat([p.grad for p in params]), torch.tensor([joining]).double()])
            if straggle and epoch == 0 and step == straggle[0]:
                time.sleep(straggle[1])  # this life's first epoch only
            if die_at is not None and step >= die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            entered = time.monotonic()
            try:
                group.allreduce([buffer]).wait()  # type: ignore[attr-defined]
            except RuntimeError:
                failed_waits.append(time.monotonic() - entered)
                # A member died: drop this group now, closing its connections, so that a
                # survivor still inside the all-reduce waiting on this one fails at once rather
                # than at gloo's timeout; then wait for the coordinator's next quorum and redo
                # this step. The Work object was a temporary, so this is the last reference: a
                # Work kept alive would keep the group's connections open.
                del group
                break
            _sgd_step(params, momenta, buffer[:-1] / len(members))
            if rank == 0:
                store.add(f"commits/{step}", 1)
                store.set(f"members/{step}", json.dumps(members))
                store.set("step", str(step + 1))
            step, samples = step + 1, samples + size * len(members)
            if buffer[-1] > 0:
                store.set(f"ack/{epoch}/{rid}", "1")
                grow = True
                break
    final = {"params": _flat(params).tolist(), "step": step, "samples": samples,
             "failed_waits": failed_waits}
    store.set(f"final/{rid}", json.dumps(final))


@dataclass
class ElasticRun:
    """What :func:`run_replicas` saw.

    Attributes:
        members: each committed step's members, in step order (replica ids).
        commits: how many times each step was committed (1 each when none is double-counted).
        final: each replica's last state: ``params`` (a flat list), ``step``, ``samples``, and
            ``failed_waits``: the seconds each of its all-reduces that failed took to fail.
        lives: how many processes each replica id ran.
        deaths: (replica id, the step it died at) in order.
    """

    members: list[list[int]]
    commits: list[int]
    final: dict[int, dict]
    lives: dict[int, int]
    deaths: list[tuple[int, int]]


def run_replicas(
    replicas: int = 3,
    steps: int = 30,
    size: int = 8,
    kills: Sequence[int] = (),
    victim: int = 1,
    rejoin_after: int = 3,
    join_within: int = 4,
    step_seconds: float = 0.05,
    timeout: float = 120.0,
    start_method: str | None = None,
    poll_seconds: float = 0.02,
    straggle: Mapping[int, float] | None = None,
) -> ElasticRun:
    """Train ``replicas`` one-process replica groups for ``steps`` global steps; kill one.

    Args:
        replicas: how many replicas (processes) start.
        steps: the global steps the run must commit.
        size: each replica's batch size per step.
        kills: for each life of ``victim`` in turn, the global step at which it dies (the first
            step at or after it that this life takes part in: a restart may miss it).
        victim: the replica id that dies.
        rejoin_after: committed steps the survivors go on alone before the victim restarts.
        join_within: steps the survivors go on after the restart before they wait for the
            joiner (at the latest at the run's last step): the join does not depend on how
            fast a process starts.
        step_seconds: seconds each step sleeps, standing in for compute, so that a restart
            (a process start) costs the survivors a few steps rather than the whole run.
        timeout: seconds before the run is abandoned (every process then killed).
        start_method: how the replica processes start; None is :func:`rank_start_method`
            (forkserver on Linux, spawn on macOS).
        poll_seconds: how often the coordinator looks at the processes and the store. The
            members' waits make the run's outcome independent of it; a slower poll only
            delays the restart (tests run it slower than a step to show that).
        straggle: seconds each replica id (its first life) waits before its all-reduce at the
            first step of ``kills``: stragglers that enter the failing all-reduce before or
            after the victim's death.

    Returns:
        An :class:`ElasticRun`.

    Raises:
        ValueError: ``poll_seconds`` is not positive.
        RuntimeError: a replica died while rejoining, or the run ended without one of them
            (killed too late to restart within ``steps``; the message names the cause).

    Example:
        >>> run = run_replicas(3, steps=20, kills=[5])
        >>> run.members[5]   # [0, 2]: the survivors redid step 5 without replica 1
    """
    if not poll_seconds > 0:
        raise ValueError(f"poll_seconds must be positive seconds, got {poll_seconds!r}")
    method = start_method or rank_start_method()
    context = multiprocessing.get_context(method)
    interface = loopback_interface()
    if method == "forkserver":  # a server that imported torch once forks each life
        context.set_forkserver_preload(["torch", __name__])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    epoch, members = 0, list(range(replicas))
    store.set("quorum", json.dumps({"epoch": 0, "members": members, "source": 0}))
    store.set("step", "0")
    store.set("decided", "-1")
    lives = {rid: 0 for rid in members}
    deaths: list[tuple[int, int]] = []
    pending = list(kills)

    def start(rid: int) -> multiprocessing.process.BaseProcess:
        die_at = pending.pop(0) if rid == victim and pending else None
        late = (kills[0], straggle[rid]) if straggle and kills and rid in straggle else None
        args = (rid, store.port, steps, size, die_at, step_seconds, interface,
                late if lives[rid] == 0 else None)
        # typeshed gives get_context(str) a BaseContext, which lacks the Process of every real one.
        process = context.Process(target=_replica, args=args)  # type: ignore[attr-defined]
        process.start()
        lives[rid] += 1
        return process

    def publish(new_members: list[int], source: int) -> None:
        nonlocal epoch, members
        epoch, members = epoch + 1, sorted(new_members)
        quorum = {"epoch": epoch, "members": members, "source": source}
        store.set("quorum", json.dumps(quorum))

    processes = {rid: start(rid) for rid in members}
    restart_at: int | None = None
    joining = False
    deadline = time.monotonic() + timeout
    try:
        while any(p.exitcode is None for p in processes.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replicas did not finish {steps} steps in {timeout} s")
            committed = int(store.get("step"))
            for rid, process in processes.items():
                if rid in members and process.exitcode not in (None, 0):
                    deaths.append((rid, committed))
                    publish([m for m in members if m != rid], min(m for m in members if m != rid))
                    restart_at = committed + rejoin_after
            if restart_at is not None and steps > committed >= restart_at:  # not once all is done
                restart_at, joining = None, True
                # join_by before the start: survivors at the last step wait however slow it is
                store.set("join_by", str(min(committed + join_within, steps - 1)))
                processes[victim] = start(victim)
            store.set("decided", str(committed))  # after any join_by this poll wrote
            if joining and processes[victim].exitcode not in (None, 0):
                raise RuntimeError(
                    f"replica {victim} died while rejoining (exit code "
                    f"{processes[victim].exitcode})"
                )
            if joining and store.add(f"ready/{victim}", 0) == lives[victim]:
                store.set("join_request", "1")  # the members see it in their next all-reduce
                if store.check([f"ack/{epoch}/{m}" for m in members]):
                    store.delete_key("join_by")
                    store.delete_key("join_request")
                    publish([*members, victim], members[0])
                    joining = False
                elif all(processes[m].exitcode is not None for m in members):
                    raise RuntimeError(
                        f"replicas {members} finished all {steps} steps before replica {victim} "
                        "could rejoin: give the run more steps, or a larger step_seconds"
                    )
            time.sleep(poll_seconds)
    finally:
        for process in processes.values():
            if process.exitcode is None:
                process.kill()
            process.join()
    final = {rid: json.loads(store.get(f"final/{rid}")) for rid in range(replicas)
             if store.check([f"final/{rid}"])}
    if sorted(final) != list(range(replicas)):
        missing = sorted(set(range(replicas)) - set(final))
        if restart_at is not None and restart_at >= steps:
            cause = (f"a replica killed within rejoin_after={rejoin_after} steps of the end "
                     "cannot come back")
        else:  # the members' waits (join_by, decided) should make these unreachable
            cause = ("internal error, the members' last-step wait failed: "
                     + (f"the restart due at step {restart_at} was never acted on"
                        if restart_at is not None else
                        "the replica was restarted, but the survivors finished before it "
                        "joined"))
        raise RuntimeError(f"the run ended without replicas {missing} (deaths {deaths}): {cause}")
    return ElasticRun(
        members=[json.loads(store.get(f"members/{s}")) if store.check([f"members/{s}"]) else []
                 for s in range(steps)],
        commits=[store.add(f"commits/{s}", 0) for s in range(steps)],
        final=final,
        lives=lives,
        deaths=deaths,
    )


def replay(members: Sequence[Sequence[int]], size: int = 8) -> torch.Tensor:
    """The same training in one process: each step's gradient averaged over its members' batches.

    Args:
        members: each step's members, as :attr:`ElasticRun.members` records them.
        size: each member's batch size.

    Returns:
        The flat parameters after the last step.
    """
    model = make_model()
    params = list(model.parameters())
    momenta = [torch.zeros_like(p) for p in params]
    for step, group in enumerate(members):
        grads = []
        for slot in range(len(group)):
            x, y = batch(step, slot, size)
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
            grads.append(_flat([p.grad for p in params]))
        _sgd_step(params, momenta, torch.stack(grads).sum(0) / len(group))
    return _flat(params)
