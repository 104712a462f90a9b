"""Trained exit heads: attention pooling + a small MLP per exit, distilled from the full model (PyTorch, CPU).

The linear heads of :mod:`.newton` read fixed ``cls+mean`` features; these read the exit's hidden states
``[N, S, H]`` through a learned attention query (:func:`~dyncompile.passes.early_exit.heads.attention_pool`),
concatenate ``[cls, mean, attention]`` and apply ``Linear(3H, D) -> GELU -> Linear(D, C)``. Training is
distillation to the full model's output distribution (cross-entropy to ``alpha * p_full + (1 - alpha) *
onehot(label)``, i.e. KL to the full model plus CE on the labels when the rows have them and ``alpha < 1``;
the default ``alpha = 1`` is pure distillation, see :data:`DEFAULT_ALPHA`) with the backbone frozen: the
hidden states are computed once by the compile
(:func:`~dyncompile.passes.early_exit.fit_exit_heads.collect_exit_features` keeps them, float16) and the
heads train on that cache.

Honest probabilities for the calibration: ``folds`` cross-fitted heads and one head on every row train *in
one batched model* (the members differ only in which rows their loss sees), so K-fold costs one pass over
the cache per epoch. The out-of-fold probabilities (row ``n`` from the member that did not train on
``n``'s fold) are what thresholds are calibrated and certified on; the shipped head is the all-rows member
(a non-linear head cannot be averaged exactly like the linear fold heads). The per-dimension
standardisation of the hidden states is folded into the query and the first dense layer exactly (softmax
weights and the masked mean sum to one, and a shift of every token's score by a constant cancels), so the
lowered head is plain :class:`~dyncompile.passes.early_exit.heads.ExitHead` math.

PyTorch is an optional dependency (the ``train`` extra); nothing here runs at inference time.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from dyncompile.passes.early_exit.checks import CalibrationError
from dyncompile.passes.early_exit.fit import FitResult, _fold_ids, _soft_targets
from dyncompile.passes.early_exit.heads import ATTN_MASK_BIAS, ExitHead

logger = logging.getLogger(__name__)

__all__ = ["HiddenCache", "train_exit_heads"]

#: The recipe's defaults, chosen on movie-calib out-of-fold agreement (never on movie-test).
DEFAULT_WIDTH = 128
DEFAULT_EPOCHS = 10
DEFAULT_LR = 2e-3
DEFAULT_WEIGHT_DECAY = 1e-2
#: weight of the full model's distribution in the target (1 - alpha on the labels). 1.0: pure distillation —
#: on movie-calib (MiniLM-L6, out-of-fold, certified on movie-calib) alpha 1.0 gave agreement 81.8 / 88.9 /
#: 94.7 / 97.1 / 98.8 % at exits 1-5 and a certified expected speedup of 3.14x, alpha 0.5 82.3 / 88.6 / 92.8 /
#: 95.7 / 96.6 % and 2.59x: the exit has to agree with the full model, and the labels pull it elsewhere
#: exactly where the full model is wrong.
DEFAULT_ALPHA = 1.0
DEFAULT_DROPOUT = 0.1
#: rows per training step: the collected batches (length-ordered) are merged up to this size
DEFAULT_BATCH = 128


class HiddenCache:
    """The exit layers' hidden states of the calibration rows, batch by batch (float16), as the compile ran them.

    ``add(rows, mask, hiddens)`` is the ``on_batch`` callback of
    :func:`~dyncompile.passes.early_exit.fit_exit_heads.collect_exit_features`: ``rows`` ``[b]`` row indices,
    ``mask`` ``[b, s]`` the attention mask, ``hiddens`` one ``[b, s, H]`` array per exit.
    """

    def __init__(self) -> None:
        self.batches: list[tuple[np.ndarray, np.ndarray, list[np.ndarray]]] = []

    def add(self, rows: np.ndarray, mask: np.ndarray, hiddens: Sequence[np.ndarray]) -> None:
        """Keep one batch (the ``on_batch`` callback)."""
        self.batches.append(
            (np.asarray(rows, np.int64), (np.asarray(mask) != 0).astype(np.float32),
             [np.asarray(h, np.float16) for h in hiddens])
        )

    @property
    def n_exits(self) -> int:
        """Exits cached per batch."""
        return len(self.batches[0][2]) if self.batches else 0

    @property
    def n_rows(self) -> int:
        """Rows cached."""
        return sum(len(b[0]) for b in self.batches)

    def nbytes(self) -> int:
        """Bytes of cached hidden states."""
        return sum(h.nbytes for b in self.batches for h in b[2])

    def merged(self, e: int, rows_per_batch: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Exit ``e``'s batches merged into batches of about ``rows_per_batch`` rows (padded to the longest)."""
        out, group = [], []

        def flush():
            s = max(b[1].shape[1] for b in group)
            rows = np.concatenate([b[0] for b in group])
            mask = np.zeros((len(rows), s), np.float32)
            hid = np.zeros((len(rows), s, group[0][2][e].shape[2]), np.float16)
            i = 0
            for r, m, hs in group:
                mask[i : i + len(r), : m.shape[1]] = m
                hid[i : i + len(r), : m.shape[1]] = hs[e]
                i += len(r)
            out.append((rows, mask, hid))

        for b in self.batches:
            group.append(b)
            if sum(len(g[0]) for g in group) >= rows_per_batch:
                flush()
                group = []
        if group:
            flush()
        return out


def _token_stats(cache: HiddenCache, e: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard deviation per hidden dimension over the tokens the masks keep (exit ``e``)."""
    s1 = s2 = None
    count = 0.0
    for _, m, hs in cache.batches:
        h = hs[e].astype(np.float64)
        w = m[..., None].astype(np.float64)
        a, b = (h * w).sum((0, 1)), (h * h * w).sum((0, 1))
        s1, s2 = (a, b) if s1 is None else (s1 + a, s2 + b)
        count += float(m.sum())
    mu = s1 / max(count, 1.0)
    sd = np.sqrt(np.maximum(s2 / max(count, 1.0) - mu * mu, 0.0)) + 1e-6
    return mu.astype(np.float32), sd.astype(np.float32)


def train_exit_heads(
    cache: HiddenCache,
    teacher_probs: np.ndarray,
    labels: np.ndarray | None,
    *,
    width: int = DEFAULT_WIDTH,
    epochs: int = DEFAULT_EPOCHS,
    lr: float = DEFAULT_LR,
    weight_decay: float = DEFAULT_WEIGHT_DECAY,
    alpha: float = DEFAULT_ALPHA,
    dropout: float = DEFAULT_DROPOUT,
    batch_size: int = DEFAULT_BATCH,
    folds: int = 5,
    seed: int = 0,
    threads: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    n_calibration: int | None = None,
) -> FitResult:
    """Train one attention-pooling + MLP head per exit on the cached hidden states; see the module docstring.

    Returns a :class:`~dyncompile.passes.early_exit.fit.FitResult` (heads with ``cls+mean+attn`` pooling,
    out-of-fold probabilities ``[E, N, C]``, per-exit OOF accuracy/agreement) like the linear fits.

    ``n_calibration``: the cache's first ``n_calibration`` rows are the calibration rows (``labels``, when
    given, are theirs); the rows after them are extra training text — every member, the K cross-fitted ones
    and the shipped one, distils on them (teacher targets only), so the out-of-fold probabilities of the
    calibration rows stay out-of-fold, and ``oof_probs`` covers the calibration rows alone. ``None``: every
    cached row is a calibration row.
    """
    try:
        import torch
    except ImportError:
        raise CalibrationError(
            "heads=trained needs PyTorch: pip install 'dyncompile[train]' (or use the linear heads, heads=fitted)"
        ) from None
    t0 = time.perf_counter()
    if not cache.batches:
        raise CalibrationError("no hidden states were collected: the calibration set is empty")
    teacher = np.asarray(teacher_probs, np.float64)
    n_all, c = teacher.shape
    if cache.n_rows != n_all:
        raise CalibrationError(f"the hidden-state cache has {cache.n_rows} rows, the teacher {n_all}")
    n = n_all if n_calibration is None else int(n_calibration)
    if not 0 < n <= n_all:
        raise CalibrationError(f"n_calibration must lie in 1..{n_all} (the cached rows), got {n_calibration}")
    if folds < 2:
        raise CalibrationError(f"folds must be >= 2 (out-of-fold probabilities), got {folds}")
    y = None if labels is None else np.asarray(labels, np.int64)
    if y is not None and len(y) != n:
        raise CalibrationError(f"{len(y)} labels for {n} calibration rows")
    targets = np.concatenate([_soft_targets(teacher[:n], y, alpha if y is not None else 1.0, 1.0),
                              _soft_targets(teacher[n:], None, 1.0, 1.0)])
    rng = np.random.default_rng(seed)
    # extra training rows get fold -1: no member's held-out fold, so every member trains on them
    fold = np.r_[_fold_ids(y if y is not None else teacher[:n].argmax(1), folds, rng), np.full(n_all - n, -1)]
    members = folds + 1  # the K cross-fitted heads, then the head on every row (shipped)
    old_threads = torch.get_num_threads()
    # one thread by default: the per-step tensors are small, and on a shared machine a preempted OpenMP
    # thread stalls every barrier (2 threads measured ~10x slower than 1 under load)
    torch.set_num_threads(int(threads) if threads else 1)
    torch.manual_seed(seed)
    heads, oof = [], np.zeros((cache.n_exits, n_all, c), np.float32)
    try:
        for e in range(cache.n_exits):
            head, oof[e] = _train_one(
                torch, cache, e, targets, fold, members, width=width, epochs=epochs, lr=lr,
                weight_decay=weight_decay, dropout=dropout, rng=rng, batch_size=batch_size,
            )
            heads.append(head)
            if progress is not None:
                progress(e + 1, cache.n_exits, f"exit {e}")
    finally:
        torch.set_num_threads(old_threads)
    oof = np.ascontiguousarray(oof[:, :n])
    final_pred = teacher[:n].argmax(1)
    oof_pred = oof.argmax(2)
    agreement = [round(100.0 * float((oof_pred[e] == final_pred).mean()), 2) for e in range(cache.n_exits)]
    accuracy = [None if y is None else round(100.0 * float((oof_pred[e] == y).mean()), 2) for e in range(cache.n_exits)]
    for e, head in enumerate(heads):
        head.info.update({"exit": e, "oof_agreement": agreement[e], "oof_accuracy": accuracy[e]})
    seconds = time.perf_counter() - t0
    config = {
        "heads": "trained", "pooling": "cls+mean+attn", "width": int(width), "activation": "gelu",
        "epochs": int(epochs), "lr": lr, "weight_decay": weight_decay, "alpha": alpha if y is not None else 1.0,
        "dropout": dropout, "batch_size": int(batch_size), "folds": int(folds), "seed": int(seed), "solver": "adamw (torch)",
    }
    if n_all > n:
        config["extra_training_rows"] = int(n_all - n)
    logger.info("trained %d exit heads in %.1f s; OOF agreement %s", len(heads), seconds, agreement)
    return FitResult(heads=heads, oof_probs=oof, oof_accuracy=accuracy, oof_agreement=agreement,
                     fit_seconds=seconds, config=config)


def _train_one(torch, cache, e, targets, fold, members, *, width, epochs, lr, weight_decay, dropout, rng, batch_size):
    """Train the ``members`` heads of exit ``e`` together; ``(shipped ExitHead, OOF probabilities [N, C])``."""
    mu_np, sd_np = _token_stats(cache, e)
    batches = cache.merged(e, batch_size)
    mu, sd = torch.from_numpy(mu_np), torch.from_numpy(sd_np)
    hdim = mu_np.shape[0]
    c = targets.shape[1]
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    q = torch.zeros(members, hdim, requires_grad=True)
    w1 = (torch.randn(members, 3 * hdim, width, generator=g) / math.sqrt(3 * hdim)).requires_grad_()
    b1 = torch.zeros(members, 1, width, requires_grad=True)
    w2 = (torch.randn(members, width, c, generator=g) / math.sqrt(width)).requires_grad_()
    b2 = torch.zeros(members, 1, c, requires_grad=True)
    params = [q, w1, b1, w2, b2]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    steps = epochs * len(batches)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    big = float(-ATTN_MASK_BIAS)
    tgt = torch.from_numpy(np.asarray(targets, np.float32))
    fold_t = torch.from_numpy(fold)
    member_ids = torch.arange(members)[:, None]

    def forward(h16, m, train):  # h16: [b, s, H] float16 states of exit e
        z = (torch.from_numpy(h16).float() - mu) / sd  # [b, s, H]
        mt = torch.from_numpy(m)
        cls = z[:, 0]
        mean = (z * mt[..., None]).sum(1) / mt.sum(1, keepdim=True).clamp_min(1.0)
        scores = torch.einsum("bsh,mh->mbs", z, q) + (mt - 1.0) * big
        attn = torch.einsum("mbs,bsh->mbh", torch.softmax(scores, -1), z)
        feats = torch.cat([cls.expand(members, -1, -1), mean.expand(members, -1, -1), attn], -1)
        if train and dropout > 0:
            feats = torch.nn.functional.dropout(feats, dropout, True)
        hid = torch.nn.functional.gelu(torch.baddbmm(b1, feats, w1))
        return torch.baddbmm(b2, hid, w2)  # [M, b, C]

    for _ in range(epochs):
        for i in rng.permutation(len(batches)):
            rows, m, h16 = batches[i]
            logits = forward(h16, m, True)
            r = torch.from_numpy(rows)
            ce = -(tgt[r][None] * torch.log_softmax(logits, -1)).sum(-1)  # [M, b]
            fr = fold_t[r][None]
            seen = ((fr != member_ids) | (member_ids == members - 1)).float()
            loss = ((ce * seen).sum(1) / seen.sum(1).clamp_min(1.0)).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    oof = np.zeros((len(fold), c), np.float32)
    with torch.no_grad():
        for rows, m, h16 in batches:
            p = torch.softmax(forward(h16, m, False), -1).numpy()  # [M, b, C]
            oof[rows] = p[fold[rows], np.arange(len(rows))]
    # fold the standardisation into the shipped member: z = (h - mu) / sd
    k = members - 1
    qk = q[k].detach().numpy().astype(np.float64)
    w1k = w1[k].detach().numpy().astype(np.float64)
    b1k = b1[k, 0].detach().numpy().astype(np.float64)
    sd3 = np.tile(sd_np.astype(np.float64), 3)
    mu3 = np.tile(mu_np.astype(np.float64), 3)
    w1_raw = w1k / sd3[:, None]
    b1_raw = b1k - mu3 @ w1_raw
    head = ExitHead(
        pooling="cls+mean+attn",
        layers=[(w1_raw.astype(np.float32), b1_raw.astype(np.float32), "gelu"),
                (w2[k].detach().numpy(), b2[k, 0].detach().numpy(), "none")],
        attn_query=(qk / sd_np.astype(np.float64)).astype(np.float32),
        info={"heads": "trained"},
    )
    return head, oof
