"""The `magicdec` command line: Typer commands (`main`) that parse, call one engine function, print
through one rank-aware console (`console`), and exit with the contract's codes. No logic of its own."""

import time as _time

IMPORTED_AT = _time.time()  # when this process began being magicdec (engine.job.timeline.process_started)
