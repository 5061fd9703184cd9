"""magicdec's command line: a thin Typer layer over `engine` (parse, call, print, exit codes)."""
