"""magicdec's engine: everything below the command line, importable without Typer.

It is not a server and knows nothing about terminals; `magicdec_cli` is the only user-facing layer.
"""
