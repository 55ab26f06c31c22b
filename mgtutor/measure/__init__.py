"""Measurements: what the ranks measure about themselves, and how it is shown.

* :mod:`.timing`: :func:`~.timing.phase`, :func:`~.timing.step`, :class:`~.timing.StepTimer`.
* :mod:`.memory`: what the per-rank memory figures count.
* :mod:`.breakdown`: each rank's memory by category (parameters, gradients, optimizer state,
  DDP buckets, activations, the rest of a GPU's peak), measured inside the rank.
* :mod:`.memplan`: the same categories computed ahead, per strategy (DDP, ZeRO-1, FSDP, TP).
* :mod:`.planner`: a transformer's memory per GPU and communication per step, from published
  formulas, for any layout of data (ZeRO 0-3), tensor and pipeline parallelism.
* :mod:`.step_time`: the planner's clock: a layout's predicted step time (compute, each
  collective on its link, the bubble, overlap) on a :class:`~.step_time.Hardware`, and the
  layouts ranked by it; :mod:`.step_calibrate` calibrates CPU ranks (achieved FLOP/s of a
  layer step, gloo's links) and :mod:`.step_check` checks the clock against them.
* :mod:`.plan_rules`: the planner's rules about what runs: TP and SP collectives per layer,
  the layouts torch refuses, the pipeline bubble and the ranking rule.
* :mod:`.activation_plan`: the activations one layer keeps for backward, term by term
  (Korthikanti et al.), with the element and dropout-mask bytes as parameters.
* :mod:`.traffic`: every collective a step sends, counted inside the ranks, and what torch
  runs for ZeRO 0-3 set beside the planner's (the ZeRO paper's) pattern.
* :mod:`.activations`: the bytes a forward and backward create and keep alive, or that
  autograd saves.
* :mod:`.stats`: repeated measurements read with their spread.
* :mod:`.progress`: per-rank progress bars.
* :mod:`.run`: :class:`~.run.Run`, what a launch or a pool call returns.
* :mod:`.plots`: memory, timelines, step times and scaling, per rank.

Nothing here is imported by ``import mgtutor.measure``: import the module you need.
"""
