"""The bottom layer: the files this package reads and writes (drafter config.json, safetensors weights, GGUF
targets, quantization specs, draft vocabularies, training-data shards). Nothing here imports from the rest of
the package, so every other module may build on it."""
