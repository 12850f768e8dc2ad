"""Files in and out: model directories, safetensors, transformers names, tokenizers, chat templates, TensorBoard."""
