"""Finding a model on disk and loading its weights (HF directories, the default model's GGUF file)."""
