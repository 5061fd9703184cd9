"""Recipes: `schema` (the dataclasses, their defaults and the allowed values) and `loading` (YAML,
shipped recipes, `--set`, validation). Imports nothing else of magicdec but `engine.errors`; it does not
load models or read input files."""
