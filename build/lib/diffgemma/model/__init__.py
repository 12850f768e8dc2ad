"""The DiffusionGemma network: its config, layers, attention mask, LoRA, quantization, sharding, kernels."""
