"""Measurements: what a rank measures about itself, and how it is shown.

* :mod:`.timing`: :func:`~.timing.phase`, :func:`~.timing.step`, :class:`~.timing.StepTimer`.
* :mod:`.memory`: what the per-rank memory figures count.
* :mod:`.breakdown`: each rank's memory by category (parameters, gradients, optimizer state,
  DDP buckets, activations, the rest of a GPU's peak), measured inside the rank, as the
  :class:`~mgtutor.plan.memplan.MemoryBreakdown` that :mod:`mgtutor.plan.memplan` estimates.
* :mod:`.activations`: the bytes a forward and backward create and keep alive, or that
  autograd saves; what one GPT layer keeps for backward.
* :mod:`.step_calibrate`, :mod:`.step_check` and :mod:`.step_builds`: this machine's CPU ranks
  measured as a :class:`~mgtutor.plan.machine.Hardware` (each product at its shape, each
  memory-bound operation per element, gloo's links, a copy), then
  :mod:`mgtutor.plan.step_time`'s predictions checked against steps they run, each term deleted
  in turn; :mod:`.emulated`, a GPU rank emulated on a CPU rank (device time and links slept at
  declared rates) for the terms that overlap.
* :mod:`.traffic`: every collective a step sends, counted inside the ranks, and what torch
  runs for ZeRO 0-3 set beside the planner's (the ZeRO paper's) pattern.
* :mod:`.stats`: repeated measurements read with their spread.
* :mod:`.plots`: memory, timelines, step times and scaling, per rank; :mod:`.figure` makes
  the figure a notebook shows once.

Where it stands: below the launcher (whose :class:`mgtutor.Run` carries these records), above
:mod:`mgtutor.parallel` (the modules traffic counts) and :mod:`mgtutor.plan` (the predictions
set beside the measurements).

Nothing here is imported by ``import mgtutor.measure``: import the module you need.
"""
