"""What the notebooks build by hand."""
