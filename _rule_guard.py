"""Root-op guards for onnxscript rewrite rules: the same rewrites, without matching nodes no rule can match.

onnxscript's ``RewriteRuleSet`` tries every rule at every node, and a rule's matcher does real work before it
compares the node's op with its pattern's: a multi-output pattern (the default rules' ``SlicesSplit``) indexes the
whole graph by op at *each* node it is tried on, which is quadratic in the graph's size. One ``optimize()`` of
SmolLM2-135M's exported graph (2,245 nodes, 46 default rules) spent about 3.5 s matching, and ``fuse-decoder``
runs it three times; torch's ONNX exporter runs it once on the larger graph it first produces (most of a decoder
recipe's build time). Both run it behind this guard. A guarded rule first compares the node's ``(domain, op_type)`` with the op its pattern's
first output node names — the node a match starts from — and returns "no match" at once when they differ: a
match needs them equal, so the rewrites, their order and the resulting graph are the same (tested byte for byte
on a real decoder, and on a graph where ``SlicesSplit`` fires). Rules whose first output node names no single op
(an op pattern, a domain pattern) are left unguarded.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterable, Iterator
from typing import Any

_LOCK = threading.RLock()


def _root_op(rule: Any) -> tuple[str, str] | None:
    """``(domain, op_type)`` a match of ``rule`` must start at, or None when its pattern does not fix one."""
    try:
        ident = rule._target_pattern.output_nodes[0].op_identifier()
    except (AttributeError, IndexError, TypeError):
        return None
    if not ident or not isinstance(ident[0], str) or not isinstance(ident[1], str):
        return None
    return ident[0], ident[1]


def guard_rule(rule: Any) -> Any:
    """A shallow copy of ``rule`` whose ``try_rewrite`` skips nodes of another op (``rule`` itself unchanged)."""
    root = _root_op(rule)
    if root is None:
        return rule
    guarded = copy.copy(rule)
    try_rewrite = rule.try_rewrite

    def _try_rewrite(model, graph_or_function, node, *args, **kwargs):
        if node.op_type != root[1] or node.domain != root[0]:
            return None
        return try_rewrite(model, graph_or_function, node, *args, **kwargs)

    guarded.try_rewrite = _try_rewrite
    return guarded


def guard_rules(rules: Iterable[Any]) -> tuple[Any, ...]:
    """:func:`guard_rule` on each rule, order kept."""
    return tuple(guard_rule(r) for r in rules)


@contextlib.contextmanager
def guarded_default_rules() -> Iterator[None]:
    """Within the block, onnxscript's ``optimize()`` applies its default rewrite rules guarded.

    The module attribute ``optimize()`` reads the rules from is restored on exit, also on an exception.

    The swap is process-wide, hence the lock; a caller in another thread would only see rules that rewrite exactly
    what the unguarded ones do.
    """
    from onnxscript import rewriter

    with _LOCK:
        original = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
        if original is None:  # pragma: no cover - an onnxscript without the attribute: run unguarded
            yield
            return
        rewriter._DEFAULT_REWRITE_RULES = guard_rules(original)
        try:
            yield
        finally:
            rewriter._DEFAULT_REWRITE_RULES = original
