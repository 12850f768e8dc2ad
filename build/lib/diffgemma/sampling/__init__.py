"""Sampling: the block-diffusion sampler, held-out evaluation, denoising traces."""
