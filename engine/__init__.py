"""magicdec's engine: everything below the command line, importable without Typer.

Layers, each a folder, importing downward only (tests/test_layout.py holds them to it):
`config` and `errors` at the bottom; `models` (finding and loading weights); `core` (the hot path:
KV cache, attention, scheduler); `spec` (MagicDec on top of core); `job` (a batch job: files, rows,
reports); `scale` (many processes); `planning` (the cost model behind `magicdec plan`); `bench`
(timing the very loop `run` uses). It is not a server and knows nothing about terminals;
`magicdec_cli` is the only user-facing layer.
"""
