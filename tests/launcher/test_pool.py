"""mgtutor.Pool and %%ddp: ranks kept alive between calls, and what happens when calls fail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import mgtutor
import mgtutor.launcher.magic
from tests.helpers import worker_children


@pytest.fixture(scope="module")
def pool():
    with mgtutor.Pool(world_size=2) as p:
        yield p
    assert not worker_children()


def test_state_push_pull_subsets_and_the_run_it_returns(pool, capsys) -> None:
    import torch.distributed as dist

    def build(scale):
        global weights, calls
        import torch

        weights = torch.full((3,), float(dist.get_rank() + 1)) * scale
        calls = 1
        print("built on", dist.get_rank())

    run = pool.run(build, 2.0)
    assert isinstance(run, mgtutor.Run) and run.results == [None, None]
    assert run.backend == "gloo" and run.ranks[1].memory.peak_rss > 0
    out = capsys.readouterr().out
    assert "[rank 0] built on 0" in out and "[rank 1] built on 1" in out

    def step():
        global calls
        calls += 1  # a name the previous call left
        dist.all_reduce(weights)
        return weights.tolist(), calls

    assert pool.run(step).results == [([6.0] * 3, 2), ([6.0] * 3, 2)]

    def calls_now():  # a helper the next call uses reads the rank's names too
        return calls

    def via_helper():
        return calls_now() * 10

    assert pool.run(via_helper).results == [20, 20]
    pool.push(lr=0.5)
    pool.push(ranks=[1], lr=0.25)
    assert pool.pull("lr") == [0.5, 0.25]
    assert pool.run(lambda: dist.get_rank(), ranks=[1]).results == [1]
    with pytest.raises(mgtutor.WorkerError, match="has no name 'missing'"):
        pool.pull("missing")
    with pytest.raises(ValueError, match=r"ranks must name ranks of this pool \(0..1\)"):
        pool.run(lambda: None, ranks=[2])
    assert pool.alive


def test_a_ranks_own_names_are_never_replaced_and_push_always_wins(pool, capfd) -> None:
    # A notebook's cells run in IPython's user namespace (by-value functions, as in Jupyter).
    pytest.importorskip("IPython")
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    cell = textwrap.dedent(
        """
        rate = 0.1
        def read_rate():
            return rate
        first = pool.run(read_rate).results
        rate = 0.2  # the notebook changes it: the next call reads the new value
        second = pool.run(read_rate).results

        def build():
            global model
            model = "the ranks' model"
        pool.run(build)
        model = "the notebook's model"
        def read_model():
            return model
        models = pool.run(read_model).results

        x = 1
        pool.push(x=42)
        pushed = pool.run(lambda: x).results

        def fails():
            raise ValueError(model)
        """
    )
    names = ("rate", "read_rate", "first", "second", "build", "model", "read_model", "models")
    names += ("x", "pushed", "fails", "pool")
    shell.user_ns["pool"] = pool
    try:
        shell.run_cell(cell).raise_error()
        space = shell.user_ns
        assert space["first"] == [0.1, 0.1] and space["second"] == [0.2, 0.2]
        assert space["models"] == ["the ranks' model"] * 2
        assert space["pushed"] == [42, 42]
        out, err = capfd.readouterr()
        assert "`model` was not used on rank(s) 0, 1" in out, out
        assert "pool.push(model=model)" in out and "`x` was not used" in out, out
        assert "`rate`" not in out, out  # a name the ranks never made is the notebook's: no note
        assert "was not used" not in err, err  # a note, not an error: not in stderr's red box
        with pytest.raises(mgtutor.WorkerError, match="the ranks' model"):
            pool.run(space["fails"])
        out, err = capfd.readouterr()
        assert "[rank 1] mgtutor: the notebook's `model` was not used on this rank" in out, out
        assert "was not used" not in err, err
    finally:
        for name in names:
            shell.user_ns.pop(name, None)


def test_variables_read_when_a_group_is_made_are_reported_once_when_changed(
    pool, monkeypatch, capsys
) -> None:
    capsys.readouterr()
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    pool.run(lambda: None)
    out, err = capsys.readouterr()
    assert "NCCL_DEBUG (unset -> 'INFO')" in out and "pool.restart()" in out, out
    assert "NCCL_DEBUG" not in err, err  # a note, on stdout
    pool.run(lambda: None)
    assert "NCCL_DEBUG" not in capsys.readouterr().out  # said once per change
    monkeypatch.delenv("NCCL_DEBUG")
    pool.run(lambda: None)
    assert "NCCL_DEBUG" not in capsys.readouterr().out  # back as the ranks' group has it


def test_an_error_keeps_the_pool_when_the_others_finish(pool) -> None:
    import torch.distributed as dist

    pool.push(kept="still here")

    def fails_on_one():
        if dist.get_rank() == 1:
            raise ValueError("bad batch on rank 1")
        return "fine"

    with pytest.raises(mgtutor.WorkerError, match="rank 1 raised ValueError") as info:
        pool.run(fails_on_one)
    assert "rank 0 finished the call" in str(info.value).lower()
    assert "ranks are kept" in str(info.value)
    assert pool.alive and pool.pull("kept") == ["still here"] * 2


def test_an_error_while_the_peer_waits_in_a_collective_restarts_the_pool(pool, capsys) -> None:
    import torch.distributed as dist

    pool.push(kept=1)
    pids = [p for p in pool.run(os.getpid).results]

    def peer_waits():
        import torch

        if dist.get_rank() == 0:
            raise RuntimeError("rank 0 gives up before the all_reduce")
        dist.all_reduce(torch.ones(1))

    started = time.monotonic()
    with pytest.raises(mgtutor.WorkerError, match="rank 0 raised RuntimeError") as info:
        pool.run(peer_waits)
    assert time.monotonic() - started < 30
    text = str(info.value)
    assert "Rank 1 had not finished" in text and "all_reduce" in text
    assert "pool's ranks were stopped" in text
    assert not pool.alive and not any(psutil.pid_exists(p) for p in pids)
    # The next call starts new ranks and says so; their namespace is new.
    with pytest.raises(mgtutor.WorkerError, match="has no name 'kept'"):
        pool.pull("kept")
    assert "starting new ones" in capsys.readouterr().out
    assert pool.alive and pool.run(os.getpid).results != pids


def test_a_killed_rank_and_a_timeout_stop_the_pool_and_the_next_call_restarts(pool) -> None:
    def die():
        import torch.distributed as dist

        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)

    with pytest.raises(mgtutor.WorkerError, match="rank 1 was killed by signal SIGKILL"):
        pool.run(die)
    assert not pool.alive
    with pytest.raises(mgtutor.WorkerTimeout, match="timeout of 1 s") as info:
        pool.run(lambda: time.sleep(30), timeout=1)
    assert "time.sleep(30)" in info.value.stacks[0]
    assert not pool.alive
    assert pool.run(lambda: "back").results == ["back", "back"]


def test_interrupt_stops_fn_on_every_rank_and_keeps_the_pool(pool) -> None:
    pids = pool.run(os.getpid).results
    timer = threading.Timer(1.5, lambda: signal.raise_signal(signal.SIGINT))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt) as info:
            pool.run(time.sleep, 60)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert "fn stopped on every rank; the pool's ranks are kept" in str(info.value)
    assert pool.alive and pool.run(os.getpid).results == pids


def test_the_pool_learns_the_backend_its_ranks_chose(monkeypatch) -> None:
    # Nothing asked on the notebook's side (no backend, no MGTUTOR_BACKEND): each rank's setup()
    # chooses, and the pool reads their choice from their start-up message.
    import torch
    import torch.distributed as dist

    from mgtutor.hardware import choose_backend

    monkeypatch.delenv("MGTUTOR_BACKEND", raising=False)
    chosen = choose_backend(torch.cuda.device_count(), dist.is_nccl_available(), 2)
    with mgtutor.Pool(world_size=2) as pool:
        assert pool._backend_asked is None
        assert pool.backend == chosen and f"backend={chosen!r}" in repr(pool)
        assert [h.backend for h in pool._supervisor.handles] == [chosen, chosen]
        assert pool.run(lambda: str(dist.get_backend())).results == [chosen, chosen]


def test_ranks_that_chose_different_backends_are_refused_naming_each() -> None:
    from mgtutor.launcher._handle import RankHandle, agreed_backend

    def ranks(*said):
        return [RankHandle(r, None, None, None, backend=b) for r, b in enumerate(said)]

    assert agreed_backend(ranks("gloo", "gloo")) == "gloo"
    assert agreed_backend(ranks(None, None)) is None
    each = r"rank 0: gloo, rank 1: nccl, rank 2: gloo"
    with pytest.raises(mgtutor.WorkerError, match=each) as info:
        agreed_backend(ranks("gloo", "nccl", "gloo"))
    assert info.value.rank == 1


def test_bad_arguments_are_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        mgtutor.Pool(world_size=0)
    with pytest.raises(ValueError, match="start_method must be one of"):
        mgtutor.Pool(start_method="fork")


def test_a_sink_takes_the_ranks_output_and_stop_ranks_keeps_the_pool_open(pool, capsys) -> None:
    # Pool.output_sink (what %%ddp's tabs set) receives each relayed line instead of the cell;
    # Pool.stop_ranks (what the idle timeout calls) ends the ranks and leaves the pool usable.
    seen: list[tuple[int, str, str]] = []
    pool.output_sink = lambda rank, stream, text: seen.append((rank, stream, text))
    try:
        pids = pool.run(lambda: print("to the sink") or os.getpid()).results
    finally:
        pool.output_sink = None
    assert sorted(seen) == [(0, "stdout", "to the sink"), (1, "stdout", "to the sink")], seen
    assert "to the sink" not in capsys.readouterr().out
    pool.stop_ranks()
    assert not pool.closed and not pool.alive
    assert not [p for p in pids if psutil.pid_exists(p)]
    assert set(pool.run(os.getpid).results).isdisjoint(pids)  # new ranks started
    pool.run(lambda: print("to the cell again"))
    assert "[rank 1] to the cell again" in capsys.readouterr().out


def test_a_closed_pool_says_so_message_first() -> None:
    closed = mgtutor.Pool.__new__(mgtutor.Pool)
    closed.closed = True
    with pytest.raises(mgtutor.PoolClosed, match="this pool is closed") as info:
        closed._call(b"", [0], None)
    # In a notebook: the message, then the caller's lines; none of mgtutor's own frames.
    shown = info.value._render_traceback_()
    assert shown[0].startswith("PoolClosed: this pool is closed")
    assert not any("mgtutor" + os.sep + "launcher" in line for line in shown)


def test_the_ranks_end_when_the_notebook_process_dies(tmp_path) -> None:
    # And so do the processes fn started on them: the forkserver ends each rank's group.
    script = tmp_path / "kernel.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, subprocess, sys, time
            import mgtutor

            def start_a_child():
                return os.getpid(), subprocess.Popen(["sleep", "120"]).pid

            if __name__ == "__main__":
                pool = mgtutor.Pool(world_size=2)
                print(*[p for pair in pool.run(start_a_child).results for p in pair], flush=True)
                time.sleep(120)
            """
        )
    )
    kernel = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
        env={**os.environ, "TMPDIR": str(tmp_path)},  # what a killed kernel cannot remove
    )
    pids: list[int] = []
    try:
        pids = [int(p) for p in kernel.stdout.readline().split()]
        assert len(pids) == 4 and all(psutil.pid_exists(p) for p in pids)
    finally:
        kernel.kill()  # as a dying kernel: no cleanup code runs
        kernel.wait(10)
    try:
        gone, alive = psutil.wait_procs(_processes_of(pids), 10)
        assert not alive, f"still running after the notebook died: {alive}"
    finally:
        for p in _processes_of(pids):
            p.kill()


_STUCK_KERNEL = """
import ctypes, os, subprocess, sys
import mgtutor


def stuck():
    child = subprocess.Popen(["sleep", "120"])  # a process fn started, in the rank's group
    print("entering native code", child.pid, flush=True)
    ctypes.PyDLL(None).sleep(3600)  # PyDLL keeps the GIL: no thread of the rank can run


if __name__ == "__main__":
    from multiprocessing import forkserver

    pool = mgtutor.Pool(world_size=2, start_method=sys.argv[1])
    server = getattr(forkserver._forkserver, "_forkserver_pid", None) or 0
    print(*pool.run(os.getpid).results, server, flush=True)
    pool.run(stuck)
"""


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_stuck_with_the_gil_held_die_with_the_notebook(tmp_path, method) -> None:
    # The rank's listener thread cannot run here (the GIL is held in native code): only the
    # kernel can end the rank, through PR_SET_PDEATHSIG. With the forkserver, the server must
    # die too: it is the ranks' parent, and a stuck rank holds its "alive" pipe open; and it
    # ends each rank's process group, so what fn started ends too.
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's; elsewhere a rank ends itself from a thread")
    script = tmp_path / "kernel.py"
    script.write_text(_STUCK_KERNEL)
    kernel = subprocess.Popen(
        [sys.executable, str(script), method],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
        env={**os.environ, "TMPDIR": str(tmp_path)},  # what a killed kernel cannot remove
    )
    pids: list[int] = []
    started: list[int] = []
    try:
        *ranks, server = (int(p) for p in kernel.stdout.readline().split())
        pids = ranks + ([server] if server else [])
        assert len(ranks) == 2 and (server or method == "spawn"), (ranks, server)
        entered = [kernel.stdout.readline() for _ in ranks]
        assert all("entering native code" in line for line in entered), entered
        started = [int(line.split()[-1]) for line in entered]
        time.sleep(1.0)  # from print to the native sleep is a few bytecodes
        assert all(psutil.pid_exists(p) for p in pids)
    finally:
        kernel.kill()  # as a dying kernel: no cleanup code runs
        kernel.wait(10)
    # A spawned rank's parent is the notebook itself: nothing is left to end the rank's group
    # when the rank cannot, so only the ranks are checked there.
    checked = pids + (started if method == "forkserver" else [])
    try:
        gone, alive = psutil.wait_procs(_processes_of(checked), 15)
        names = {**dict.fromkeys(ranks, "rank"), server: "server"}
        left = [f"{p.pid} ({names.get(p.pid, 'started by fn')})" for p in alive]
        assert not left, f"still running after the notebook died: {', '.join(left)}"
    finally:
        for p in _processes_of(pids + started):
            p.kill()  # a failure must not leave them running


def _processes_of(pids: list[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            pass
    return found


def test_a_process_whose_parent_died_before_it_asked_to_die_with_it_ends_at_once() -> None:
    # The race die_with_parent handles: a parent that dies before the child's prctl leaves the
    # child with another parent, which never signals. Here the "parent" is a pid that is not
    # this child's parent, which is what the child sees in that case.
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    probe = (
        "import os\n"
        "from mgtutor.rank.loop import die_with_parent\n"
        "die_with_parent(os.getppid() + 1)\n"
        "print('still running', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "still running" not in done.stdout, done
    tied = (
        "import os\nfrom mgtutor.rank.loop import die_with_parent\n"
        "print(die_with_parent(os.getppid()))"
    )
    done = subprocess.run([sys.executable, "-c", tied], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True", done


def test_ddp_cell_magic_keeps_each_ranks_namespace(capsys) -> None:
    pytest.importorskip("IPython")
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "mgtutor")
    try:
        shell.run_line_magic("ddp_start", "-n 2")
        shell.run_cell_magic(
            "ddp", "", "import torch.distributed as dist\nr = dist.get_rank()\nprint('hi', r)"
        )
        shell.run_cell_magic("ddp", "--ranks 1", "r * 10")
        out = capsys.readouterr().out
        assert "[rank 0] hi 0" in out and "[rank 1] hi 1" in out
        assert "[rank 1] Out: 10" in out and "[rank 0] Out" not in out
        assert shell.user_ns["_ddp"].results == ["10"]
        assert "r" not in shell.user_ns  # the cell ran on the ranks, not in the notebook
        with pytest.raises(ValueError, match="--ranks takes rank numbers"):
            shell.run_cell_magic("ddp", "--ranks one", "pass")
        with pytest.raises(mgtutor.WorkerError, match="NameError"):
            shell.run_cell_magic("ddp", "", "undefined_name")
        # The pool's rule: names the cell reads come from the notebook unless the rank has its own.
        shell.run_cell("scale = 3\ndef double(v):\n    return 2 * v * scale").raise_error()
        capsys.readouterr()
        shell.run_cell_magic("ddp", "", "double(r)")
        assert shell.user_ns["_ddp"].results == ["0", "6"]
        shell.user_ns["scale"] = 5
        shell.run_cell_magic("ddp", "", "r * scale")
        assert shell.user_ns["_ddp"].results == ["0", "5"]
        shell.run_cell_magic("ddp", "", "scale = 7\nr * scale")  # the ranks' own from here
        shell.run_cell_magic("ddp", "", "r * scale")
        assert shell.user_ns["_ddp"].results == ["0", "7"]
        out = capsys.readouterr().out
        assert "the notebook's `scale` was not used" in out and "%ddp_push scale" in out, out
        shell.run_line_magic("ddp_push", "scale")
        shell.run_cell_magic("ddp", "", "r * scale")
        assert shell.user_ns["_ddp"].results == ["0", "5"]
        assert "`scale`" not in capsys.readouterr().out  # equal values: nothing to say
        # The notebook's values are pickled once: the check that they can travel is the pickling.
        shell.run_cell(
            "pickled = []\n"
            "class Counted:\n"
            "    def __reduce__(self):\n"
            "        pickled.append(1)\n"
            "        return (int, (4,))\n"
            "counted = Counted()"
        ).raise_error()
        shell.run_cell_magic("ddp", "", "r + counted")
        assert shell.user_ns["_ddp"].results == ["4", "5"]
        assert len(shell.user_ns["pickled"]) == 1
        with pytest.raises(ValueError, match="the notebook has no nowhere"):
            shell.run_line_magic("ddp_push", "nowhere")
        pids = mgtutor.launcher.magic.current_pool().run(os.getpid).results
    finally:
        shell.run_line_magic("ddp_stop", "")
        for name in ("scale", "double", "pickled", "Counted", "counted"):
            shell.user_ns.pop(name, None)
    assert mgtutor.launcher.magic.current_pool() is None
    assert not any(psutil.pid_exists(p) for p in pids)


@pytest.mark.gpu
def test_a_pool_starts_after_cuda_was_used_in_the_notebook() -> None:
    import torch

    if torch.cuda.device_count() < 1:
        pytest.skip("needs a CUDA GPU")
    torch.zeros(1, device="cuda")  # CUDA initialized in this process
    with mgtutor.Pool(world_size=2, backend="gloo") as pool:
        assert pool.run(lambda: torch.cuda.is_available()).results == [True, True]


def test_a_script_that_never_closes_its_pool_still_exits(tmp_path) -> None:
    # multiprocessing joins non-daemon children at exit; mgtutor closes open pools before that.
    # Nothing outlives the script: not its ranks, not the forkserver that forked them (a launch
    # is a pool that runs one call, so this covers launch's server too).
    script = tmp_path / "forgets.py"
    script.write_text(
        "import os\nimport psutil\nimport mgtutor\n"
        "if __name__ == '__main__':\n"
        "    pool = mgtutor.Pool(world_size=2)\n"
        "    print(*pool.run(os.getpid).results, flush=True)\n"
        "    print(*[p.pid for p in psutil.Process().children()\n"
        "            if 'forkserver import main' in ' '.join(p.cmdline())], flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=os.getcwd()
    )
    assert done.returncode == 0, done.stderr
    ranks, servers = ([int(p) for p in line.split()] for line in done.stdout.splitlines())
    assert len(ranks) == 2 and not any(psutil.pid_exists(p) for p in ranks)
    assert len(servers) == 1, done.stdout
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and psutil.pid_exists(servers[0]):
        time.sleep(0.1)
    assert not psutil.pid_exists(servers[0]), "the forkserver outlived the process that made it"


def test_the_forkserver_starts_at_import_in_a_kernel_only() -> None:
    # In a Jupyter kernel, importing mgtutor starts the ranks' server at once, in the background
    # (its imports overlap the notebook's first cells); in a script, importing starts nothing.
    probe = (
        "import sys, types\n"
        "if sys.argv[1] == 'kernel':\n"
        "    sys.modules['ipykernel'] = types.ModuleType('ipykernel')\n"
        "import mgtutor\n"
        "from multiprocessing import forkserver\n"
        "server = forkserver._forkserver._forkserver_pid\n"
        "print(server, flush=True)\n"
        "if server:\n"
        "    import os, signal\n"
        "    os.kill(server, signal.SIGKILL)  # a probe: do not leave it importing torch\n"
    )
    seen = {}
    for where in ("kernel", "script"):
        done = subprocess.run(
            [sys.executable, "-c", probe, where], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        seen[where] = done.stdout.strip()
    assert seen["kernel"].isdigit() and seen["script"] == "None", seen
