"""What a model is without its weights, torch-free: where its files are (an HF directory, a
GGUF converted once, the built-in SmolLM2), its tokenizer, chat template and special tokens.
The engine, the API process and the router (which tokenizes as its workers do) all read it."""
