"""The roofline prior behind `magicdec plan` and `gamma: auto`'s first guess: hardware profiles
(`hardware`, built-in GPUs or this machine measured), pricing one forward and the best gamma
(`roofline`), a recipe turned into its inputs (`recipe_plan`), and the check against the paper
(`paper`). It loads no weights and runs no model; only `measure_hardware` times anything."""
