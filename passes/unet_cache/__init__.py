"""Feature caching across denoising steps (DeepCache-style) for diffusion U-Nets.

* ``structure`` — the skip Concats of a U-Net graph, the shallow graph of a cut, MACs per part;
* ``cache_unet_pass`` — ``CacheUNetFeaturesPass`` (``--passes cache-unet``): picks (or calibrates) the cut and the
  refresh schedule and adds the deep feature as an output; the ``diffusion`` emitter writes the shallow graph.
"""

from dyncompile.passes.unet_cache.cache_unet_pass import CacheUNetFeaturesPass

__all__ = ["CacheUNetFeaturesPass"]
