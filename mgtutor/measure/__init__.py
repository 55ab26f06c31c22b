"""Measurements: what a rank measures about itself, and how it is shown.

* :mod:`.timing`: :func:`~.timing.phase`, :func:`~.timing.step`, :class:`~.timing.StepTimer`.
* :mod:`.memory`: what the per-rank memory figures count.
* :mod:`.breakdown`: each rank's memory by category (parameters, gradients, optimizer state,
  DDP buckets, activations, the rest of a GPU's peak), measured inside the rank, as the
  :class:`~mgtutor.plan.memplan.MemoryBreakdown` that :mod:`mgtutor.plan.memplan` estimates.
* :mod:`.activations`: the bytes a forward and backward create and keep alive, or that
  autograd saves; what one GPT layer keeps for backward.
* :mod:`.cpu_timing`: a CPU rank's products at their shapes and memory-bound operations per
  element, timed; :mod:`.emulated`, a GPU rank emulated on a CPU rank (device time and links
  slept at declared rates) for the terms that overlap; :mod:`.other_work`, the cores other
  processes used meanwhile: what the step-time check of :mod:`mgtutor.experiments` runs on.
* :mod:`.written`: the bytes a rank wrote (``/proc/self/io``): what gloo sent.
* :mod:`.stats`: repeated measurements read with their spread.
* :mod:`.plots`: memory, timelines, step times and scaling, per rank; :mod:`.figure` makes
  the figure a notebook shows once.

Where it stands: below :mod:`mgtutor.experiments` (which checks the predictions with these
measurements) and the launcher (whose :class:`mgtutor.Run` carries these records), above
:mod:`mgtutor.parallel` (the modules :mod:`.activations` measures) and :mod:`mgtutor.plan` (the
predictions set beside the measurements).

Nothing here is imported by ``import mgtutor.measure``: import the module you need.
"""
