"""The wire: what the notebook's side (:mod:`mgtutor.launcher`) and the rank's side
(:mod:`mgtutor.rank`) say to each other over the pipe between them.

* :mod:`.messages`: the typed messages, one frozen dataclass each, both ways.
* :mod:`.pickling`: how values cross the pipe, both ways (cloudpickle by value, code with its
  file name; fn's result with its tensors on the CPU).

Where it stands: at the bottom, beside :mod:`mgtutor.units`: it imports nothing of mgtutor, so
that both sides can speak it without importing each other.
"""
