"""The launcher, the notebook's side: starting ranks from a cell, calling them, cleaning up.

Public: :func:`~mgtutor.launcher.launch.launch` (run a function once on every rank),
:class:`~mgtutor.launcher.pool.Pool` (ranks kept alive between cells) and
:mod:`~mgtutor.launcher.magic` (the ``%%ddp`` cell magic); all three are also reachable from
``mgtutor``, as is :class:`~mgtutor.launcher.run.Run` (what a launch or a pool's call
returns); :mod:`.progress_bars` draws the per-rank bars that the ranks' ``mgtutor.progress``
reports. What runs inside a rank is :mod:`mgtutor.rank`. The underscored modules are the
machinery, in the order a call goes through them:

* :mod:`._arguments`: every argument of a pool and of launch, checked once.
* :mod:`._processes`: starting rank processes (forkserver or spawn) and the forkserver.
* :mod:`._send`: a function and its arguments made sendable (by value, with the notebook's names).
* :mod:`._payload`: the pickled function reused while nothing it carries can have changed.
* :mod:`._handle`: the notebook's view of one rank process.
* :mod:`._watch`: listening to every rank at once: answers, output, progress, exits.
* :mod:`._relay`: each rank's output, relayed to the cell line by line.
* :mod:`._supervise`: deciding when a call has ended, failed, hung or was interrupted, and what
  to stop.
* :mod:`._report`: the error a learner reads: what happened, the hints, the ranks' stacks.
* :mod:`._cleanup`: stopping every process of a launch, whatever happened.
* :mod:`.lifetime`: the idle timeout that frees idle ranks and the server; ``shutdown()``.

Where it stands: above the rank's side (:mod:`mgtutor.rank`), what a rank records
(:mod:`mgtutor.measure`), the hang doctor (:mod:`mgtutor.doctor`) and :mod:`mgtutor.worker`;
below :mod:`mgtutor.exercises` and the package's face, which launch through it.
"""


def start_server_early() -> None:
    """Start the ranks' forkserver now, in the background, where ranks start from one.

    Where ranks are spawned (macOS) there is no server to start. The package's face calls it in
    a Jupyter kernel (see :func:`._processes.start_server_early`).
    """
    from mgtutor.launcher import _arguments, _processes

    if _arguments.default_start_method() == "forkserver":
        _processes.start_server_early()
