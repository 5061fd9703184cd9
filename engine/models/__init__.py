"""Models: where they are (`registry`: the packaged default, Hugging Face folders, GGUF files converted
once by `gguf`), what shape they have (`shapes`: layers, heads, parameter counts, random-weight
`<name>-shape` configs) and loading them with transformers (`loading`). Nothing here downloads
anything, and nothing here knows about KV caches, attention or generation (the caller names the
attention implementation to load with)."""
