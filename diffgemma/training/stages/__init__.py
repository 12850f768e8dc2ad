"""Training stages: what feeds the one update step (SFT, SD·RL)."""
