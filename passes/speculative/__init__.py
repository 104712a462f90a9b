"""Speculative decoding: a drafter proposes tokens, the target verifies them in one call (lossless).

* ``speculative`` — :class:`SpeculativePass` (external / prompt-lookup / split drafter; measures costs);
* ``split_drafter`` — :class:`SplitDrafterPass` (a drafter from the target's first k layers);
* ``emit`` — the generate / speculative plan emitters.
"""

from dyncompile.passes.speculative import emit  # noqa: F401  (registers the generate/speculative emitters)
from dyncompile.passes.speculative.speculative import SpeculativePass
from dyncompile.passes.speculative.split_drafter import SplitDrafterPass

__all__ = ["SpeculativePass", "SplitDrafterPass"]
