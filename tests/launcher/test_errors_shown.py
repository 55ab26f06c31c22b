"""What a learner sees when a launch, a pool call or a %%ddp cell fails (issue 23).

In IPython the error opens with its message, not with mgtutor's own frames; the full traceback
stays reachable. Messages name what ran (a %%ddp cell, a pool), the variable that could not be
pickled, and what to do when a rank used torch.distributed without a process group. Rank stacks
are printed in Python's order, the innermost call last.
"""

from __future__ import annotations

import pickle
import threading

import pytest

import mgtutor
import mgtutor.launcher.magic
from mgtutor.errors import WorkerTimeout
from mgtutor.launcher import _report, _send
from tests.helpers import worker_children

FULL_TRACEBACK_ENV = "MGTUTOR_FULL_TRACEBACK"  # the variable the README names
# mgtutor's files that raise a launch's error: none may be shown before the message.
_OWN_FILES = ("launch.py", "pool.py", "_supervise.py", "_send.py", "magic.py")


@pytest.fixture
def shell(monkeypatch):
    pytest.importorskip("IPython")
    from IPython.testing.globalipapp import get_ipython

    monkeypatch.delenv(FULL_TRACEBACK_ENV, raising=False)
    shell = get_ipython()
    shell.InteractiveTB.skip_hidden = True
    shell.run_cell("import mgtutor, threading")
    yield shell
    shell.InteractiveTB.skip_hidden = True
    mgtutor.launcher.magic.ddp_stop("")


def _shown(shell, capsys, cell: str) -> list[str]:
    """The lines IPython printed for the cell's error, blank ones and mgtutor's notes dropped.

    A note (``mgtutor: starting 2 ranks for %%ddp ...``) is printed as the cell starts, as
    output of its own; the error is what the cell shows after it.
    """
    capsys.readouterr()
    result = shell.run_cell(cell)
    assert result.error_in_exec is not None, "the cell was meant to fail"
    lines = capsys.readouterr().out.splitlines()
    return [line for line in lines if line.strip() and not line.startswith("mgtutor: ")]


def test_ipython_shows_the_message_first_and_the_full_traceback_on_request(
    shell, capsys, monkeypatch
) -> None:
    cell = 'def work():\n    raise ValueError("bad value")\nmgtutor.launch(work)'
    lines = _shown(shell, capsys, cell)
    assert lines[0] == "WorkerError: rank 0 raised ValueError: bad value" or lines[0] == (
        "WorkerError: rank 1 raised ValueError: bad value"
    ), lines
    text = "\n".join(lines)
    assert not any(name in text for name in _OWN_FILES), text
    assert "During handling" not in text and "direct cause" not in text, text
    assert "raise ValueError" in text  # the rank's traceback, with the cell's line
    called = lines.index("Called from:")
    assert (
        lines[called + 1].startswith("  Cell In[") and "mgtutor.launch(work)" in lines[called + 2]
    )
    assert "%xmode --show" in lines[-1] and FULL_TRACEBACK_ENV in lines[-1]
    # The full traceback: IPython's own setting, then %tb for the last error...
    shell.run_line_magic("xmode", "--show")
    capsys.readouterr()
    shell.run_line_magic("tb", "")
    full = capsys.readouterr().out
    assert "_supervise.py" in full and "launch.py" in full, full
    shell.run_line_magic("xmode", "--hide")
    # ... or the environment variable.
    monkeypatch.setenv(FULL_TRACEBACK_ENV, "1")
    full = "\n".join(_shown(shell, capsys, cell))
    assert "_supervise.py" in full and "Traceback (most recent call last)" in full, full


def test_an_unpicklable_value_is_named_and_shown_without_the_pickling_chain(shell, capsys) -> None:
    cell = "lock = threading.Lock()\ndef work():\n    with lock:\n        return 1\n"
    cell += "mgtutor.launch(work)"
    lines = _shown(shell, capsys, cell)
    assert lines[0].startswith("PicklingError: mgtutor could not send `lock` (a global of work"), (
        lines
    )
    text = "\n".join(lines)
    assert "cloudpickle.py" not in text and "direct cause" not in text, text
    assert isinstance(shell.user_ns.get("lock"), type(threading.Lock()))


def test_pickle_payload_names_the_variable_that_holds_what_cannot_be_sent() -> None:
    lock = threading.Lock()
    state = {"lock": lock}

    def helper():
        return state

    def uses_helper():
        return helper()

    def keyword(x, *, guard=lock):
        return x

    cases = [
        ((lambda: lock.locked(), (), {}), "`lock` (a closure variable of"),
        ((uses_helper, (), {}), "`state` (a closure variable of "),
        ((keyword, (1,), {}), "`guard` (a default of "),
        ((lambda value, held: None, (1, lock), {}), "argument 1 `held` (a _thread.lock)"),
        ((lambda held: None, (), {"held": lock}), "keyword argument `held` (a _thread.lock)"),
    ]
    for (fn, args, kwargs), named in cases:
        with pytest.raises(pickle.PicklingError) as info:
            _send.pickle_payload(fn, args, kwargs)
        assert named in str(info.value), (named, str(info.value))
        assert isinstance(info.value, mgtutor.errors.PicklingError)


def test_a_rank_without_a_process_group_is_told_to_call_setup() -> None:
    def work():
        import torch.distributed as dist

        return dist.get_rank()

    with pytest.raises(mgtutor.WorkerError) as info:
        mgtutor.launch(work, world_size=1)
    message = str(info.value).splitlines()[0]
    assert "Default process group has not been initialized" in message
    assert "call mgtutor.setup() (or dist.init_process_group" in message, message


def test_pool_and_ddp_errors_are_worded_for_what_ran(shell, capsys) -> None:
    def stuck():
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))

    with mgtutor.Pool(world_size=2) as pool, pytest.raises(WorkerTimeout) as info:
        pool.run(stuck, timeout=2)
    assert "No process of this pool is left running" in str(info.value), str(info.value)
    assert "this launch" not in str(info.value)
    shell.run_line_magic("load_ext", "mgtutor")
    cell = "import torch, torch.distributed as dist\nif dist.get_rank() == 0:\n"
    cell += "    dist.all_reduce(torch.ones(1))"
    lines = _shown(shell, capsys, f"%%ddp --timeout 2\n{cell}")
    text = "\n".join(lines)
    assert "The %%ddp cell ran past its timeout of 2 s" in text, text
    assert "No process of the %%ddp ranks is left running" in text, text
    assert "fn ran past" not in text and "this launch" not in text, text
    assert lines[0].startswith("WorkerTimeout: "), lines
    # The stack in Python's order: the cell's line, then the collective it waits in, and
    # none of mgtutor's frames below the cell.
    where = lines.index("Where rank 0 was stuck (most recent call last):")
    stack = lines[where + 1 :]
    assert stack[0].startswith('  File "<ddp-cell-') and "dist.all_reduce" in stack[1], stack
    assert any("in all_reduce" in line for line in stack[2:]), stack
    assert not any(name in line for line in stack for name in _OWN_FILES), stack
    shell.run_line_magic("ddp_stop", "")
    assert not worker_children()


_DUMP = b"""Current thread 0x00007f0000000001 (most recent call first):
  File "/torch/distributed/distributed_c10d.py", line 3913 in all_reduce
  File "/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/notebook/cell.py", line 4 in inner
  File "/notebook/cell.py", line 9 in work
  File "/mgtutor/_rank.py", line 314 in _measured_call
  File "/mgtutor/_rank.py", line 250 in _run_call
  File "/mgtutor/_rank.py", line 400 in rank_main
"""


def test_rank_stacks_are_in_pythons_order_innermost_last() -> None:
    stack = _report.format_stack(_DUMP, 0x7F0000000001).splitlines()
    assert [line.split(" in ")[-1] for line in stack] == ["work", "inner", "wrapper", "all_reduce"]


def test_a_rank_stopped_before_its_dump_has_an_empty_stack() -> None:
    # Interrupted during start-up, a spawned rank may not have written a line of its dump yet
    # (CI saw it: IndexError in the interrupt's report, not the report).
    assert _report.format_stack(b"", 0x7F0000000001) == ""
    assert _report.format_stack(b"\n  \n", None) == ""


def test_a_bad_argument_is_shown_message_first_and_still_a_value_or_type_error(
    shell, capsys
) -> None:
    # Nothing starts for a bad argument; the learner reads what was wrong on the first line,
    # and code that catches ValueError (or TypeError) keeps working.
    lines = _shown(shell, capsys, "mgtutor.launch(print, world_size=0)")
    assert lines[0] == (
        "ArgumentError: world_size must be at least 1 (one worker per rank), got 0"
    ), lines
    assert not any(name in line for line in lines for name in _OWN_FILES), lines
    lines = _shown(shell, capsys, "mgtutor.launch(42)")
    assert lines[0].startswith("ArgumentError: launch needs a function"), lines
    for bad in ({"world_size": 0}, {"world_size": "2"}, {"timeout": -1}):
        with pytest.raises(ValueError):
            mgtutor.launch(print, **bad)
        with pytest.raises(TypeError):
            mgtutor.launch(print, **bad)


def test_a_ddp_cell_that_raises_on_one_rank_says_the_ddp_ranks_are_kept(shell, capsys) -> None:
    # The other rank finishes the cell, so the ranks stay; the note names them as %%ddp's.
    shell.run_line_magic("load_ext", "mgtutor")
    cell = "import torch.distributed as dist\nif dist.get_rank() == 1:\n"
    cell += "    raise ValueError('only here')"
    text = "\n".join(_shown(shell, capsys, f"%%ddp\n{cell}"))
    assert "ValueError: only here" in text, text
    assert "The %%ddp ranks are kept, with what they hold." in text, text
    assert "pool's" not in text, text
