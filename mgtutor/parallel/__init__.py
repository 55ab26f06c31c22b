"""What the notebooks build by hand, as reusable, tested parts.

* :mod:`.layout`: :func:`~.layout.build_groups`, the process group of each axis of a
  :class:`mgtutor.grid.Layout` (a dp x tp x pp grid of ranks, re-exported there) that the
  parallel pieces take (``group=``), so the axes combine.
* :mod:`.syncbn`: :class:`~.syncbn.SyncBatchNorm`, batch statistics over all ranks, also on CPU
  ranks (notebook 04).
* :mod:`.comms`: one record of communication, :func:`~.comms.record_comms`: every collective,
  send and receive a rank runs, with its group, its phase and the bytes it sends and receives
  (every notebook that counts traffic, and the checks of the planner).
* :mod:`.tensor_comms`: the autograd functions that carry tensor and sequence parallelism's
  collectives (Megatron-LM's f and g, and the sequence pair).
* :mod:`.tensor`: layers split across ranks from a one-process layer: column- and row-parallel
  linears, an MLP and attention split by heads, a block with or without sequence parallelism
  (notebook 13).
* :mod:`.tensor_random`: Megatron-LM's two dropout seeds, the default one alike on every
  tensor-parallel rank and a tracked one per rank, entered with ``fork()`` (notebook 13).
* :mod:`.gpt_layer`: a Megatron-style GPT layer whose tensors kept for backward are the ones
  Korthikanti et al. count, whole or split (tensor and sequence parallel), and what autograd
  saved, by term (notebook 17).
* :mod:`.context`: ring attention by hand (key-value blocks round a send/recv ring, partial
  results merged by their log-sum-exps, differentiable), and the contiguous and zig-zag
  splits of a sequence (notebook 14).
* :mod:`.pipeline`: a model cut into stages, a stage that sends activations forward and
  gradients back with send/recv, on the default ranks or a layout's pipeline group
  (``ranks=groups.pp_ranks``) (notebook 15).
* :mod:`.pipeline_orders`: the GPipe and 1F1B orders, their tick tables and their bubble, in
  pure Python (re-exported by :mod:`.pipeline`).
* :mod:`.expert`: a top-k router, the all-to-all that dispatches tokens to their experts' ranks
  and combines them back, and a mixture-of-experts layer whose ranks hold only their experts
  (notebook 16).
* :mod:`.lowcomm`: LocalSGD's and DiLoCo's one averaging all-reduce, and a slow link named by
  its delay per byte, also as a DDP hook (notebook 19).
* :mod:`.elastic`: replicas over a membership that changes mid-run: a TCPStore quorum, a fresh
  gloo group per epoch, the state broadcast to a replica that rejoins (notebook 19).

Where it stands: it imports nothing of mgtutor above it; what measures or runs these modules
(:mod:`mgtutor.measure.activations`, :mod:`mgtutor.experiments`) imports them, and a
caller that wants phases timed passes :func:`mgtutor.phase` in (:func:`.pipeline.run_order`).

Nothing here is imported by ``import mgtutor.parallel``: import the module you need (each
imports torch).
"""
