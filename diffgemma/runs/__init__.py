"""A run's directory: checkpoints and config.json, resume rules, lock, preemption, provenance, many processes."""
