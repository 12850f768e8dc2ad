"""Sampling: the block-diffusion sampler, denoising traces."""
