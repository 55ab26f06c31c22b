"""Predictions: what a layout will cost per GPU, computed ahead from formulas, before any run.

* :mod:`.memplan`: each rank's memory by category (parameters, gradients, optimizer state, DDP
  buckets) per strategy (DDP, ZeRO-1, FSDP, TP), and :class:`~.memplan.MemoryBreakdown`, the
  record that :mod:`mgtutor.measure.breakdown` fills with what a rank measured.
* :mod:`.planner`: a transformer's memory per GPU and communication per step, from published
  formulas, for any layout of data (ZeRO 0-3), tensor and pipeline parallelism; the model's
  shape is a :class:`~.shape.Transformer`.
* :mod:`.plan_rules`: the planner's rules about what runs: TP and SP collectives per layer,
  FSDP under a pipeline, the pipelines torch refuses, the bubble and the ranking rule.
* :mod:`.local_sync`: LocalSGD and DiLoCo, replicas that sync every H steps: what they send
  and hold, after torchft's implementation, and the ZeRO stages they do not take.
* :mod:`.step_time`: the planner's clock: a layout's predicted step time by part (products and
  memory-bound operations at their sharded shapes, each collective on its link, the pipeline
  played out, what each technique overlaps, DDP's copies, the optimizer step), and the layouts
  ranked by it at a fixed global batch. Its inputs: :mod:`.compute_time` (a GPU's products by
  shape, memory-bound operations, the FLOP conventions of MFU and HFU), :mod:`.pipeline_schedule`
  (a schedule played stage by stage), :mod:`.machine` (links, GPUs, what the training code
  overlaps; the machines of published runs); :mod:`.published_runs`, those runs and the model's
  prediction of each.
* :mod:`.activation_plan`: the activations one layer keeps for backward, term by term
  (Korthikanti et al.), with the element and dropout-mask bytes as parameters.

Where it stands: a plan imports nothing of mgtutor but :mod:`mgtutor.units`, :mod:`mgtutor.ring`
and :mod:`mgtutor.grid` (the :class:`~mgtutor.grid.Layout` it takes and keeps); what measures a
run (:mod:`mgtutor.measure`, :mod:`mgtutor.experiments`) imports the plan, to set what ran beside
what was predicted.
Nothing here imports torch at import time.
"""
