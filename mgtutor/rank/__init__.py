"""The rank's side: what runs inside a rank process that the notebook started.

* :mod:`.loop`: a rank's life: start up, join the group if asked, run each call that arrives,
  answer it, and leave (:func:`~.loop.rank_main`).
* :mod:`.channel`: the rank's side channel for progress and records.
* :mod:`.namespace`: which names a call sees in a rank: the rank's own, else the notebook's.
* :mod:`.result`: what a rank says when fn's result cannot be pickled back.
* :mod:`.children`: the processes fn left running, listed after each call.
* :mod:`.progress`: :func:`mgtutor.progress`, a rank's count of its work.

What fn itself calls inside a rank (:func:`mgtutor.setup`, :func:`~mgtutor.worker.current_device`)
is :mod:`mgtutor.worker`, kept at the package's root below :mod:`mgtutor.measure`, whose timer
asks it for the rank's device.

The messages a rank reads and writes, and how values are pickled on the way, are
:mod:`mgtutor.wire`: the notebook's side speaks it too.

Where it stands: below the notebook's side (:mod:`mgtutor.launcher`, which starts the ranks
and reads their messages), above what a rank records (:mod:`mgtutor.measure`), the hang
doctor's responder (:mod:`mgtutor.doctor`), :mod:`mgtutor.worker` and :mod:`mgtutor.wire`.
"""
