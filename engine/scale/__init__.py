"""Running a job on many processes: where a rank sits (`topology`), starting workers on one machine
(`launch`), the process groups and collectives, DeepSpeed AutoTP inside a group (`group`), and the
job across ranks (`run`). It wraps `engine.job`; it never imports the CLI (it is handed the command
to relaunch)."""
