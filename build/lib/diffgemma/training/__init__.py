"""Training: the forward process, the losses, the optimizer, the update step, the loop, stages."""
