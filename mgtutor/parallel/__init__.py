"""What the notebooks build by hand: the pieces of each kind of parallelism, plain and tested."""
