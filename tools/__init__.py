"""What ``dyncompile ...`` runs: the command line (``cli``: parsers and dispatch; one module per command body) and
the benchmark harness (``bench/``). One-off studies live in ``studies/``, which a checkout has and the wheel does not."""
