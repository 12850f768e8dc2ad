"""A run on disk: its config and checks, resume, training state, checkpoints, lock, provenance, loading."""
