"""Routed plans: the ``cascade`` and ``route`` steps, the executable checks and their sandbox."""
