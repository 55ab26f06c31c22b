"""What the notebooks build by hand, as reusable, tested parts.

* :mod:`.syncbn`: :class:`~.syncbn.SyncBatchNorm`, batch statistics over all ranks, also on CPU
  ranks (notebook 04).

Nothing here is imported by ``import mgtutor.parallel``: import the module you need (each
imports torch).
"""
