"""Decision rules of the runtime: numpy-only leaves that the passes may import too.

The exit rule and learned exit policy of early exit, the speculative cost model, token sampling, the
diffusion schedulers and the chi-square helpers of the drift guard.
"""
