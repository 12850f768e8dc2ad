"""Pallas kernels for the canvas attention and the MoE expert MLP, and where they run."""
