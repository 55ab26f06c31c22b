"""How values cross the pipe: code keeps its file name, so a rank's traceback shows the cell."""

from __future__ import annotations

import types

from mgtutor.wire import pickling


def _plain():
    return None


class _DefinedHere:
    pass


def test_code_keeps_its_file_name_on_the_way_to_the_ranks() -> None:
    # cloudpickle 3.1.3 writes every file name as "<dynamic-code>"; a rank's traceback would
    # then show no line of the cell that raised. pickling.dumps keeps it, nested code included.
    import pickle

    source = (
        "class Model:\n"
        "    def forward(self):\n"
        "        return [x for x in range(2)]\n"
        "def work():\n"
        "    def inner():\n"
        "        return Model().forward()\n"
        "    return inner\n"
    )
    namespace = {"__name__": "__main__"}
    exec(compile(source, "/tmp/ipykernel_0/cell_7.py", "exec"), namespace)
    work, model = pickle.loads(pickling.dumps((namespace["work"], namespace["Model"])))
    inner = work()
    assert work.__code__.co_filename == "/tmp/ipykernel_0/cell_7.py"
    assert inner.__code__.co_filename == "/tmp/ipykernel_0/cell_7.py"
    assert model.forward.__code__.co_filename == "/tmp/ipykernel_0/cell_7.py"
    assert inner() == [0, 1]


def test_code_marshal_cannot_write_still_travels() -> None:
    # Only code built by hand holds such a constant; it goes as cloudpickle writes it.
    import pickle

    code = _plain.__code__.replace(co_consts=(_DefinedHere,))
    fn = types.FunctionType(code, {}, "_plain")
    fn.__module__ = "__main__"
    assert pickle.loads(pickling.dumps(fn))() is _DefinedHere  # return None became this constant
