"""`magicdec bench`: side-by-side timing that drives the very scheduler and rounds `magicdec run` uses
(`sweep`), transformers' own decode step as the baseline (`baseline`), the default prompts made from
the standard library's sources (`prompts`), and rendering (`render`). It never imports the job layer:
no input files, no output rows, no reports."""
