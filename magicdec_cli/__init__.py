"""The `magicdec` command line: Typer commands (`main`) that parse, call one engine function, print
through one rank-aware console (`console`), and exit with the contract's codes. No logic of its own."""
