"""``dyncompile train-drafter TARGET --kind medusa --out HEAD_DIR``: train Medusa-1 heads on the target's own predictions.

Medusa (Cai et al. 2024) drafts from the target's last hidden state ``h_t`` alone (the LM head's input, after the
final norm): head ``k`` (``k = 0..K-1``) is one residual block ``h + SiLU(W_k h + b_k)`` followed by an LM head,
and predicts token ``t + k + 2`` (the target's LM head itself gives ``t + 1``). The LM head is the target's own,
frozen and shared by the heads, or (``lm_heads=True``, the paper's Medusa-1 form) one per head, initialised from the
target's and trained with the block, over the draft vocabulary. The heads are trained with cross-entropy to the *target's own* predictions (self-distillation, teacher-forced: the label of
head ``k`` at position ``t`` is the target's argmax at position ``t + k + 1`` of the same text), on the CPython
standard library minus the files the benchmark prompts are cut from (:data:`~dyncompile.tools.train_drafter.HELD_OUT`),
the corpus the EAGLE trainer uses. The target runs once over the corpus: its hidden states and argmax labels are
cached, then only the heads train (cheap on CPU). The LM head may be restricted to the ``draft_vocab`` most frequent
tokens of the corpus (the rows of the target's head, mapped back to target ids inside the heads graph).

The checkpoint kept is the one of the highest summed top-1 agreement of the heads on the eval set (greedy
verification accepts on agreement; the eval loss turns up long before agreement stops rising). With
self-distillation on, that eval set is the target's own greedy continuations of held-out prefixes (what
verification will see at run time: the target's own text), and the corpus eval windows are reported beside it.

Writes ``HEAD_DIR/medusa_heads.npz`` (``w`` ``[K, H, H]`` in ``x @ w`` layout, ``b`` ``[K, H]``, ``vocab``, and with
per-head LM heads ``lm`` ``[K, H, Vd]``) and
``medusa_heads.json`` (provenance, corpus, held-out files, per-head top-1 agreement with the target on held-out
windows). The ``medusa-heads`` pass builds the ONNX heads graph from them. Needs PyTorch (the ``export`` extra).
"""

from __future__ import annotations

import json
import logging
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError
from dyncompile.passes.speculative.medusa_heads import HEAD_FILE_FORMAT
from dyncompile.tools.train_drafter import (
    HELD_OUT,
    _windows,
    fingerprint,
    load_corpus_tokens,
    load_target,
    target_tokenizer_json,
)

logger = logging.getLogger(__name__)

__all__ = ["MEDUSA_HEAD_FORMAT", "evaluate_medusa", "train_medusa"]

MEDUSA_HEAD_FORMAT = HEAD_FILE_FORMAT  # what the medusa-heads pass reads


def head_logits(x: Any, w: Any, b: Any, lm: Any) -> Any:
    """The heads' logits ``[K, n, Vd]`` for LM-head inputs ``x`` ``[n, H]``: ``z_k = x + SiLU(x @ w_k + b_k)``, then
    ``z_k @ lm`` with ``lm`` the shared ``[H, Vd]`` rows of the target's LM head or per-head ``[K, H, Vd]``."""
    import torch

    x = x.float()
    z = x[None] + torch.nn.functional.silu(torch.einsum("nh,khg->kng", x, w) + b[:, None])
    return z @ lm


def _as_windows(d: np.ndarray, seq_len: int, what: str) -> np.ndarray:
    """Distilled rows cut to ``seq_len`` tokens; none (with a warning) when they are shorter."""
    if d.shape[1] >= seq_len:
        return d[:, :seq_len]
    if len(d):
        logger.warning("medusa: distilled %s of %d tokens are shorter than --seq-len %d: not used", what, d.shape[1],
                       seq_len)
    return np.zeros((0, seq_len), d.dtype)


def train_medusa(
    target: str | Path,
    out: str | Path,
    *,
    heads: int = 3,
    corpus: str | Path | None = None,
    device: str = "cpu",
    steps: int = 300,
    batch: int = 256,
    seq_len: int = 256,
    lr: float = 1e-3,
    draft_vocab: int = 8192,
    max_tokens: int = 60_000,
    distill_sequences: int = 0,
    distill_prompt: int = 64,
    distill_new: int = 192,
    distill_eval: int | None = None,
    lm_heads: bool = False,
    eval_every: int = 100,
    seed: int = 0,
    max_seconds: float | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Train ``heads`` Medusa heads for ``target`` (a model directory with ``hf/``, or the ``.gguf`` it was built
    from, with a pre-tokenized ``.npy`` corpus) and write them to ``out``.

    The training text is the corpus windows (the last tenth, contiguous, held out for evaluation) plus
    ``distill_sequences`` greedy continuations by the target itself of training-window prefixes (the EAGLE
    trainer's self-distillation, :func:`~dyncompile.tools.train_drafter.self_distill`). One target pass caches the
    LM head's input and the target's argmax per position, then only the heads train. ``device="cuda"`` runs the
    target under bfloat16 autocast and keeps the cache in GPU memory as bfloat16 (about 3 KB a position for a
    1536-wide model). Every ``eval_every`` steps the heads are evaluated on the held-out windows; the weights of
    the best summed agreement so far are written to ``out`` each time it improves (a run stopped from outside keeps
    them), with the eval curve (agreement per head against training positions seen) in ``medusa_heads.json``.

    ``distill_eval`` (default ``distill_sequences // 16``) continuations of held-out prefixes form the eval set that
    picks the checkpoint when self-distillation is on. ``lm_heads=True`` trains one LM head per head (initialised from
    the target's rows for the draft vocabulary); it needs a draft vocabulary smaller than the target's."""
    import torch

    from dyncompile.tools.train_drafter import self_distill

    if heads < 1 or heads > 16:
        raise DataError(f"--heads must be in 1..16, got {heads}")
    if distill_eval is None:
        distill_eval = distill_sequences // 16
    t_start = time.perf_counter()
    if threads:
        torch.set_num_threads(int(threads))
    target = Path(target).expanduser()
    torch.manual_seed(seed)
    dev = torch.device(device)
    amp = dev.type == "cuda"
    store = torch.bfloat16 if amp else torch.float32  # the cached hidden states' dtype
    model = load_target(target, dev)
    cfg = model.config
    vocab_size = int(cfg.vocab_size)
    if lm_heads and not 0 < draft_vocab < vocab_size:  # before the target pass, which can take hours
        raise DataError(f"per-head LM heads need a draft vocabulary smaller than the target's {vocab_size} "
                        f"(--draft-vocab, e.g. 8192), got {draft_vocab}")
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id[0]
    ids = load_corpus_tokens(corpus, target_tokenizer_json(target), max_tokens=max_tokens, eos=eos)
    wins = _windows(ids, seq_len)
    if len(wins) < 4:
        raise DataError(f"the corpus gave {len(wins)} windows of {seq_len} tokens; raise --max-tokens")
    rng = np.random.default_rng(seed)
    # eval: the stream's last windows, contiguous (other files than most training windows: neighbouring windows of
    # one file would make a random split optimistic); training windows shuffled
    n_eval = max(2, len(wins) // 10)
    eval_w, train_w = wins[-n_eval:], wins[:-n_eval]
    distilled = self_distill(model, train_w, distill_sequences, distill_prompt, distill_new, rng, eos=eos,
                             progress=False)
    train_w = np.concatenate([train_w, _as_windows(distilled, seq_len, "sequences")])  # continuations as windows
    train_w = train_w[rng.permutation(len(train_w))]
    # the target's own continuations of held-out prefixes: the eval set that picks the checkpoint
    eval_d = _as_windows(self_distill(model, eval_w, distill_eval, distill_prompt, distill_new, rng, eos=eos,
                                      progress=False), seq_len, "eval sequences")

    # --- one target pass over the text: the LM head's input (normed hidden state) and the target's argmax ---
    captured: dict[str, Any] = {}
    hook = model.lm_head.register_forward_hook(lambda m, a, o: captured.__setitem__("h", a[0]))

    per_call = 4 if dev.type == "cpu" else 32  # windows per target forward

    def run(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        hs, ys = [], []
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            for i in range(0, len(windows), per_call):
                x = torch.as_tensor(windows[i : i + per_call]).to(dev)
                logits = model(input_ids=x, use_cache=False).logits
                hs.append(captured.pop("h").to(store))
                ys.append(logits.argmax(-1))
        return torch.cat(hs), torch.cat(ys)

    h_tr, y_tr = run(train_w)
    h_ev, y_ev = run(eval_w)
    h_ed, y_ed = run(eval_d) if len(eval_d) else (None, None)
    hook.remove()
    t_cache = time.perf_counter() - t_start
    logger.info("medusa: cached %d train / %d eval positions in %.0f s", y_tr.numel(), y_ev.numel(), t_cache)

    counts = np.bincount(np.concatenate([train_w.ravel(), y_tr.cpu().numpy().ravel()]), minlength=vocab_size)
    if draft_vocab and draft_vocab < vocab_size:
        vocab = np.sort(np.argsort(-counts, kind="stable")[:draft_vocab])
    else:
        vocab = np.arange(vocab_size)
    remap = torch.full((vocab_size,), -100, dtype=torch.int64, device=dev)  # outside the draft vocabulary: ignored
    remap[torch.as_tensor(vocab, device=dev)] = torch.arange(len(vocab), device=dev)
    w_head = model.lm_head.weight.detach()[torch.as_tensor(vocab).to(dev)].float()  # [Vd, H], frozen

    K, H = heads, int(h_tr.shape[-1])
    # rows (window, t) with labels for every head: t + K < seq_len
    T = seq_len - K

    class Rows:
        """Row ``i`` = position ``(i // T, i % T)`` of the cached ``[windows, seq_len, H]`` states, read in place (a
        ``[rows, H]`` copy would double the cache's memory: ~30 GB on the 1.5B's 10 M positions)."""

        def __init__(self, h: torch.Tensor) -> None:
            self.h = h

        def __len__(self) -> int:
            return self.h.shape[0] * T

        def __getitem__(self, i: torch.Tensor | slice) -> torch.Tensor:
            if isinstance(i, slice):
                i = torch.arange(*i.indices(len(self)), device=self.h.device)
            return self.h[i // T, i % T]

    def rows(h: torch.Tensor, y: torch.Tensor) -> tuple[Rows, torch.Tensor]:
        lab = torch.stack([remap[y[:, k + 1 : k + 1 + T]].reshape(-1) for k in range(K)], 1)  # head k: argmax at t+k+1
        return Rows(h), lab

    x_tr, l_tr = rows(h_tr, y_tr)
    x_ev, l_ev = rows(h_ev, y_ev)
    x_ed, l_ed = rows(h_ed, y_ed) if h_ed is not None else (None, None)
    del h_tr, h_ev, y_tr, y_ev, h_ed, y_ed
    W = torch.nn.Parameter(torch.zeros(K, H, H, device=dev))  # zero init: each head starts as the target's LM head
    B = torch.nn.Parameter(torch.zeros(K, H, device=dev))
    # per-head LM heads [K, H, Vd], from the target's rows (Medusa-1); else the target's, frozen and shared
    L = torch.nn.Parameter(w_head.T[None].repeat(K, 1, 1).contiguous()) if lm_heads else None
    opt = torch.optim.AdamW([W, B] + ([L] if lm_heads else []), lr=lr, weight_decay=0.0)
    lm = L if L is not None else w_head.T

    def loss_acc(x: torch.Tensor, lab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lg = head_logits(x, W, B, lm)  # [K, n, Vd]
        lab_t = lab.T  # [K, n]
        loss = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), lab_t.reshape(-1), ignore_index=-100)
        acc = (lg.argmax(-1) == lab_t).float().mean(1)  # per head (out-of-vocabulary labels count as misses)
        return loss, acc

    def evaluate(x_e: Rows, l_e: torch.Tensor) -> tuple[float, list[float]]:
        with torch.no_grad():
            ls, accs = [], []
            for i in range(0, len(x_e), 1024):
                lo, a = loss_acc(x_e[i : i + 1024], l_e[i : i + 1024])
                ls.append(float(lo))
                accs.append(a.cpu().numpy())
        return float(np.mean(ls)), [round(float(a), 4) for a in np.mean(accs, 0)]

    def evaluate_all() -> tuple[float, tuple[float, list[float]], tuple[float, list[float]] | None]:
        """(minus the summed head agreement that picks the checkpoint, corpus eval, distilled eval or None). Agreement,
        not the eval loss: the loss turns up long before agreement stops rising (the heads grow over-confident on
        the positions they miss), and greedy verification accepts on agreement alone."""
        ev = evaluate(x_ev, l_ev)
        ed = evaluate(x_ed, l_ed) if x_ed is not None else None
        return -float(sum((ed or ev)[1])), ev, ed

    out = Path(out).expanduser()
    lm_head_fingerprint = fingerprint(model.lm_head.weight.detach().cpu().numpy())  # once: ~1 GB read on a 1.5B
    history: list[dict[str, Any]] = []
    curve: list[dict[str, Any]] = []

    def save(w: torch.Tensor, b: torch.Tensor, lm: torch.Tensor | None, ev: tuple[float, list[float]],
             ed: tuple[float, list[float]] | None, done: int, kept: int) -> dict[str, Any]:
        out.mkdir(parents=True, exist_ok=True)
        tmp_npz = out / "medusa_heads.tmp.npz"
        arrays = {"w": w.detach().cpu().numpy().astype(np.float32), "b": b.detach().cpu().numpy().astype(np.float32),
                  "vocab": vocab.astype(np.int64)}
        if lm is not None:
            arrays["lm"] = lm.detach().cpu().numpy().astype(np.float32)
        np.savez(tmp_npz, **arrays)
        tmp_npz.replace(out / "medusa_heads.npz")
        info = {
            "format": MEDUSA_HEAD_FORMAT,
            "target": target.name,
            "target_config": {"hidden_size": H, "vocab_size": vocab_size, "model_type": cfg.model_type},
            "lm_head": {"fingerprint": lm_head_fingerprint},
            "heads": K,
            "lm_heads": "per head, trained" if lm_heads else "the target's, frozen",
            "draft_vocab": int(len(vocab)),
            "draft_vocab_coverage": round(float(counts[vocab].sum() / max(1, counts.sum())), 4),
            "corpus": {"source": Path(str(corpus)).name if corpus else f"CPython {sysconfig.get_python_version()} stdlib",
                       "held_out": list(HELD_OUT), "tokens": int(len(ids)), "train_windows": int(len(train_w)),
                       "eval_windows": int(len(eval_w)), "seq_len": seq_len, "distilled_sequences": int(len(distilled)),
                       "distill_prompt": distill_prompt, "distill_new": distill_new,
                       "distilled_eval_sequences": int(len(eval_d)),
                       "labels": "the target's own argmax (teacher-forced self-distillation)"},
            "training": {"steps": done, "planned_steps": steps, "kept_step": kept, "batch": batch, "lr": lr, "seed": seed,
                         "device": str(dev), "cache_dtype": str(store).removeprefix("torch."),
                         "positions_seen": done * batch, "train_positions": int(len(x_tr)),
                         "torch": torch.__version__, "cache_seconds": round(t_cache, 1),
                         "seconds": round(time.perf_counter() - t_start, 1)},
            "eval": {"loss": round(ev[0], 4), "head_top1_agreement": ev[1],
                     "before_training": {"loss": round(ev_before[1][0], 4), "head_top1_agreement": ev_before[1][1]},
                     "selected_by": "distilled_agreement" if ed is not None else "agreement"},
            **({"distilled_eval": {"loss": round(ed[0], 4), "head_top1_agreement": ed[1],
                                   "before_training": {"loss": round(ev_before[2][0], 4),
                                                       "head_top1_agreement": ev_before[2][1]}}}
               if ed is not None else {}),
            "curve": curve,
            "history": history,
        }
        tmp = out / "medusa_heads.json.tmp"
        tmp.write_text(json.dumps(info, indent=1))
        tmp.replace(out / "medusa_heads.json")
        return info

    def snapshot() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return W.detach().clone(), B.detach().clone(), (L.detach().clone() if L is not None else None)

    ev_before = evaluate_all()
    # early stopping on the (distilled) summed agreement: (selection value, weights, step, corpus eval, distilled eval)
    best = (ev_before[0], snapshot(), 0, ev_before[1], ev_before[2])
    t_train = time.perf_counter()
    done = 0
    g = torch.Generator(device=dev).manual_seed(seed)
    for step in range(steps):
        if max_seconds is not None and time.perf_counter() - t_train > max_seconds:
            logger.info("medusa: stopping at step %d (--max-seconds)", step)
            break
        pick = torch.randint(0, len(x_tr), (min(batch, len(x_tr)),), device=dev, generator=g)
        loss, acc = loss_acc(x_tr[pick], l_tr[pick])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done = step + 1
        if step % 20 == 0 or step == steps - 1:
            history.append({"step": step, "loss": round(float(loss.detach()), 4), "acc": [round(float(a), 4) for a in acc.detach()]})
            logger.info("medusa step %d: loss %.3f acc %s", step, float(loss.detach()), history[-1]["acc"])
        if (eval_every and (step + 1) % eval_every == 0) or step == steps - 1:
            sel, ev, ed = evaluate_all()
            point = {"step": step + 1, "positions": (step + 1) * batch, "eval_loss": round(ev[0], 4), "agreement": ev[1]}
            if ed is not None:
                point |= {"distilled_eval_loss": round(ed[0], 4), "distilled_agreement": ed[1]}
            curve.append(point)
            logger.info("medusa step %d (%d positions): eval loss %.3f acc %s%s", step + 1, (step + 1) * batch, *ev,
                        f"; distilled eval loss {ed[0]:.3f} acc {ed[1]}" if ed is not None else "")
            if sel < best[0]:
                best = (sel, snapshot(), step + 1, ev, ed)
                save(*best[1], ev, ed, done, step + 1)  # a checkpoint: the best weights so far
    _, weights, kept, ev, ed = best
    info = save(*weights, ev, ed, done, kept)  # the weights of the best (distilled) agreement
    logger.info("medusa heads: held-out top-1 agreement per head %s; wrote %s", ev[1], out)
    return info


def evaluate_medusa(target: str | Path, head_dir: str | Path, *, max_tokens: int = 8192, seq_len: int = 256,
                    threads: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """Per-head top-1 agreement of trained heads on the :data:`HELD_OUT` files (never trained on).

    ``agreement[k]``: head ``k``'s argmax equals the target's argmax for that position (what greedy verification
    accepts, given the earlier tokens were accepted); ``accuracy[k]``: it equals the text's true token; ``top{n}``:
    the target's argmax is among head ``k``'s ``n`` best (the tree's width).
    """
    import torch
    from tokenizers import Tokenizer

    if threads:
        torch.set_num_threads(int(threads))
    target = Path(target).expanduser()
    dev = torch.device(device)
    with np.load(Path(head_dir).expanduser() / "medusa_heads.npz", allow_pickle=False) as z:
        W, B, vocab = (torch.as_tensor(z[k]).to(dev) for k in ("w", "b", "vocab"))
        L = torch.as_tensor(z["lm"]).to(dev) if "lm" in z.files else None  # per-head LM heads [K, H, Vd]
    model = load_target(target, dev)
    lm = L if L is not None else model.lm_head.weight.detach()[vocab].T  # once, not per window
    tok = Tokenizer.from_file(str(target_tokenizer_json(target)))
    root = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in HELD_OUT:
        ids += tok.encode((root / name).read_text(encoding="utf-8"), add_special_tokens=False).ids
        if len(ids) >= max_tokens:
            break
    wins = _windows(np.asarray(ids[:max_tokens], np.int64), seq_len)
    K = int(W.shape[0])
    captured: dict[str, Any] = {}
    hook = model.lm_head.register_forward_hook(lambda m, a, o: captured.__setitem__("h", a[0]))
    hits = np.zeros((3, K))
    n = 0
    with torch.no_grad():
        for w in wins:
            x = torch.as_tensor(w[None]).to(dev)
            y = model(input_ids=x, use_cache=False).logits.argmax(-1)[0]
            h = captured.pop("h")[0]
            T = seq_len - K - 1
            lg = head_logits(h[:T], W, B, lm)  # [K, T, Vd]
            top = vocab[lg.topk(4, -1).indices]  # [K, T, 4]
            for k in range(K):
                tgt = y[k + 1 : k + 1 + T]
                hits[0, k] += float((top[k, :, 0] == tgt).sum())
                hits[1, k] += float((top[k, :, 0] == x[0, k + 2 : k + 2 + T]).sum())
                hits[2, k] += float((top[k] == tgt[:, None]).any(-1).sum())
            n += T
    hook.remove()
    r = hits / max(1, n)
    return {"held_out_files": list(HELD_OUT), "positions": n, "agreement": [round(float(v), 4) for v in r[0]],
            "accuracy": [round(float(v), 4) for v in r[1]], "top4_agreement": [round(float(v), 4) for v in r[2]]}
