"""What the notebooks build by hand: the pieces of each kind of model parallelism.

One module per parallelism, each importing torch (this package's ``__init__`` does not, and
``mgtutor/__init__.py`` does not import it): ``from mgtutor.parallel import tensor``.

* :mod:`mgtutor.parallel.tensor_comms`: the autograd functions that carry tensor- and
  sequence-parallel collectives (Megatron-LM's f and g, and their sequence-parallel pair), and
  a counter of the collectives they run, with their bytes.
* :mod:`mgtutor.parallel.tensor`: column- and row-parallel linear layers, attention split by
  heads, and a transformer block split by hand for tensor or sequence parallelism (notebook 13).
"""
