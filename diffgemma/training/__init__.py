"""Training: the typed run config, the training state, the forward process, losses, optimizer, update step, loop and stages, held-out evaluation, loaded runs."""
