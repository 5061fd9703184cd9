"""A batch job end to end: recipe and input file in, output rows and a report out (`run`), what is
checked before any model loads and the output's lock (`options`, free of torch), the rows ->
requests path shared with `validate` (`requests`, `prompts`), the memory check (`memory`), the report
(`report`, `report_render`), data-parallel shards (`shards`) and the files (`io/`). It composes
`engine.core`, `engine.spec` and `engine.models`; it prints nothing (the CLI draws progress)."""
