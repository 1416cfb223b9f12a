"""The benchmark harness, one module per concern: `servers` (lifecycle), `client` (timed requests),
`prompts`, `models`, `results` (tables, metadata, plots) and `runner` (command line, configurations)."""
