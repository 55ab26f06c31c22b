"""Experiments: a layout or a step run on ranks, set beside what was predicted for it.

* :mod:`.traffic`: every collective a step sends, counted inside the ranks, and what torch
  runs for ZeRO 0-3 set beside the planner's (the ZeRO paper's) pattern.
* :mod:`.step_calibrate`, :mod:`.step_check`, :mod:`.step_builds` and :mod:`.step_windows`:
  this machine's CPU ranks measured as a :class:`~mgtutor.plan.machine.Hardware`, then
  :mod:`mgtutor.plan.step_time`'s predictions checked against steps they run, each term
  deleted in turn, in windows whose crowding the ranks count.

Where it stands: above :mod:`mgtutor.measure` (what a rank records), :mod:`mgtutor.plan` (what
the planner and the step-time model predict) and :mod:`mgtutor.parallel` (what the ranks run),
because it uses all three.

Nothing here is imported by ``import mgtutor.experiments``: import the module you need.
"""
