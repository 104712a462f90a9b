"""tools/studies/int4_row_invariance: a row's logits in an M-row call against one call per row."""

from __future__ import annotations

import numpy as np

from dyncompile.tools.studies.int4_row_invariance import markdown, row_deviation


class _CallSizeDecoder:
    """Logits of token t at position p: a fixed function of (p, t), plus ``eps * (rows in the call - 1)``."""

    def __init__(self, eps: float, vocab: int = 7) -> None:
        self.eps, self.vocab, self.pos = eps, vocab, 0

    def reset(self) -> None:
        self.pos = 0

    def forward(self, ids):
        ids = np.asarray(ids).reshape(-1)
        p = self.pos + np.arange(len(ids))
        self.pos += len(ids)
        base = np.sin(np.outer(p * 7 + ids, np.arange(1, self.vocab + 1)))
        return base + self.eps * (len(ids) - 1)


def test_row_deviation_measures_the_call_size_effect_only():
    ids = list(range(20))
    rows = row_deviation(_CallSizeDecoder(0.0), ids, prefix=10, max_rows=5)
    assert [r["rows"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["max"] == 0.0 and r["argmax_differs"] == 0 for r in rows)  # a row-invariant decoder
    rows = row_deviation(_CallSizeDecoder(1e-3), ids, prefix=10, max_rows=5)
    assert [round(r["max"], 9) for r in rows] == [0.0, 1e-3, 2e-3, 3e-3, 4e-3]
    rows = row_deviation(_CallSizeDecoder(10.0), ids, prefix=10, max_rows=3)
    assert rows[0]["argmax_differs"] == 0  # a shift of every logit by the same amount keeps the argmax
    report = {"windows": 1, "prefix": 10, "rows": [{"plan": "x", "rows": 2, "max_abs_logit_diff": 1e-3,
                                                    "mean_abs_logit_diff": 1e-3, "argmax_differs": 0, "positions": 2}]}
    assert "| x | 2 | 1.00e-03 | 1.00e-03 | 0 / 2 |" in markdown(report)


class _OneRowDecoder(_CallSizeDecoder):
    """A decoder whose one-row calls differ (``eps``) from calls of two rows or more, with a cache length."""

    @property
    def length(self) -> int:
        return self.pos

    def truncate(self, n: int) -> None:
        self.pos = n

    def forward(self, ids):
        ids = np.asarray(ids).reshape(-1)
        p = self.pos + np.arange(len(ids))
        self.pos += len(ids)
        return np.sin(np.outer(p * 7 + ids, np.arange(1, self.vocab + 1))) + (self.eps if len(ids) == 1 else 0.0)


def test_greedy_identity_two_row_calls_match_verification_calls():
    from dyncompile.tools.studies.int4_row_invariance import greedy_identity

    g = greedy_identity(_OneRowDecoder(0.0), list(range(10)), 12)
    assert g["two_row_vs_chunked_tokens_equal"] and g["two_row_vs_chunked_max_logit_diff"] == 0.0
    assert g["one_row_vs_two_row_tokens_equal"] and g["one_row_vs_two_row_first_divergence"] is None
    g = greedy_identity(_OneRowDecoder(0.25), list(range(10)), 12)
    assert g["two_row_vs_chunked_max_logit_diff"] == 0.0  # the padded greedy run is what verification computes
    assert g["one_row_vs_chunked_max_logit_diff_before_divergence"] > 0.2  # one-row calls are not
