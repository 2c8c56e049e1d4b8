"""Triton kernels for the GIST loss (installed as ``cgist.kernels``)."""
