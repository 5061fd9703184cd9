"""Job files: `input` (streamed rows), `openai_batch` (that format's requests), `output` (crash-safe,
resumable writing) and `arrow` (tables for Parquet). Rows are plain dicts here: no recipes, prompts or models."""
