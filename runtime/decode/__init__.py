"""Text generation.

The ``generate`` and ``speculative_generate`` steps, drafters, draft trees, EAGLE heads and the KV cache.
"""
