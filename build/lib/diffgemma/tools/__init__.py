"""Tools above training: run comparison, sweeps, lowering for accelerators."""
