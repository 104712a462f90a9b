"""``dyncompile train-drafter TARGET --kind medusa --out HEAD_DIR``: train Medusa-1 heads on the target's own predictions.

Medusa (Cai et al. 2024) drafts from the target's last hidden state ``h_t`` alone (the LM head's input, after the
final norm): head ``k`` (``k = 0..K-1``) is one residual block ``h + SiLU(W_k h + b_k)`` followed by the target's own
LM head (frozen, shared), and predicts token ``t + k + 2`` (the target's LM head itself gives ``t + 1``). The heads
are trained with cross-entropy to the *target's own* predictions (self-distillation, teacher-forced: the label of
head ``k`` at position ``t`` is the target's argmax at position ``t + k + 1`` of the same text), on the CPython
standard library minus the files the benchmark prompts are cut from (:data:`~dyncompile.tools.train_drafter.HELD_OUT`),
the corpus the EAGLE trainer uses. The target runs once over the corpus: its hidden states and argmax labels are
cached, then only the heads train (cheap on CPU). The LM head may be restricted to the ``draft_vocab`` most frequent
tokens of the corpus (the rows of the target's head, mapped back to target ids inside the heads graph).

Writes ``HEAD_DIR/medusa_heads.npz`` (``w`` ``[K, H, H]`` in ``x @ w`` layout, ``b`` ``[K, H]``, ``vocab``) and
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
from dyncompile.tools.train_drafter import HELD_OUT, _windows, fingerprint, load_corpus_tokens, load_target

logger = logging.getLogger(__name__)

__all__ = ["MEDUSA_HEAD_FORMAT", "evaluate_medusa", "train_medusa"]

MEDUSA_HEAD_FORMAT = HEAD_FILE_FORMAT  # what the medusa-heads pass reads


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
    seed: int = 0,
    max_seconds: float | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Train ``heads`` Medusa heads for ``target`` (a model directory with ``hf/``, or the ``.gguf`` it was built
    from, with a pre-tokenized ``.npy`` corpus) and write them to ``out``. ``device="cuda"`` runs the target pass
    and the training on the GPU (the cached hidden states then live in GPU memory)."""
    import torch

    if heads < 1 or heads > 16:
        raise DataError(f"--heads must be in 1..16, got {heads}")
    t_start = time.perf_counter()
    if threads:
        torch.set_num_threads(int(threads))
    target = Path(target).expanduser()
    torch.manual_seed(seed)
    dev = torch.device(device)
    model = load_target(target, dev)
    cfg = model.config
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id[0]
    ids = load_corpus_tokens(corpus, target / "tokenizer.json", max_tokens=max_tokens, eos=eos)
    wins = _windows(ids, seq_len)
    if len(wins) < 4:
        raise DataError(f"the corpus gave {len(wins)} windows of {seq_len} tokens; raise --max-tokens")
    rng = np.random.default_rng(seed)
    # eval: the stream's last windows, contiguous (other files than most training windows: neighbouring windows of
    # one file would make a random split optimistic); training windows shuffled
    n_eval = max(2, len(wins) // 10)
    eval_w, train_w = wins[-n_eval:], wins[:-n_eval]
    train_w = train_w[rng.permutation(len(train_w))]

    # --- one target pass over the corpus: the LM head's input (normed hidden state) and the target's argmax ---
    captured: dict[str, Any] = {}
    hook = model.lm_head.register_forward_hook(lambda m, a, o: captured.__setitem__("h", a[0]))

    per_call = 4 if dev.type == "cpu" else 32  # windows per target forward

    def run(windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        hs, ys = [], []
        with torch.no_grad():
            for i in range(0, len(windows), per_call):
                x = torch.as_tensor(windows[i : i + per_call]).to(dev)
                logits = model(input_ids=x, use_cache=False).logits
                hs.append(captured.pop("h").float().cpu().numpy())
                ys.append(logits.argmax(-1).cpu().numpy())
        return np.concatenate(hs), np.concatenate(ys)

    h_tr, y_tr = run(train_w)
    h_ev, y_ev = run(eval_w)
    hook.remove()
    t_cache = time.perf_counter() - t_start
    logger.info("medusa: cached %d train / %d eval positions in %.0f s", y_tr.size, y_ev.size, t_cache)

    vocab_size = int(cfg.vocab_size)
    counts = np.bincount(np.concatenate([train_w.ravel(), y_tr.ravel()]), minlength=vocab_size)
    if draft_vocab and draft_vocab < vocab_size:
        vocab = np.sort(np.argsort(-counts, kind="stable")[:draft_vocab])
    else:
        vocab = np.arange(vocab_size)
    remap = np.full(vocab_size, -100, np.int64)  # label outside the draft vocabulary: ignored by the loss
    remap[vocab] = np.arange(len(vocab))
    w_head = model.lm_head.weight.detach()[torch.as_tensor(vocab).to(dev)].float()  # [Vd, H], frozen

    K, H = heads, int(h_tr.shape[-1])
    # rows (window, t) with labels for every head: t + K < seq_len
    T = seq_len - K
    def rows(h: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.as_tensor(h[:, :T].reshape(-1, H)).to(dev)
        lab = np.stack([remap[y[:, k + 1 : k + 1 + T]].reshape(-1) for k in range(K)], 1)  # head k: argmax at t+k+1
        return x, torch.as_tensor(lab).to(dev)

    x_tr, l_tr = rows(h_tr, y_tr)
    x_ev, l_ev = rows(h_ev, y_ev)
    del h_tr, h_ev
    W = torch.nn.Parameter(torch.zeros(K, H, H, device=dev))  # zero init: each head starts as the target's LM head
    B = torch.nn.Parameter(torch.zeros(K, H, device=dev))
    opt = torch.optim.AdamW([W, B], lr=lr, weight_decay=0.0)

    def logits_of(x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [K, n, Vd]
        z = x[None] + torch.nn.functional.silu(torch.einsum("nh,khg->kng", x, W) + B[:, None])
        return z @ w_head.T

    def loss_acc(x: torch.Tensor, lab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lg = logits_of(x)  # [K, n, Vd]
        lab_t = lab.T  # [K, n]
        loss = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), lab_t.reshape(-1), ignore_index=-100)
        acc = (lg.argmax(-1) == lab_t).float().mean(1)  # per head (out-of-vocabulary labels count as misses)
        return loss, acc

    def evaluate() -> tuple[float, list[float]]:
        with torch.no_grad():
            ls, accs = [], []
            for i in range(0, len(x_ev), 1024):
                lo, a = loss_acc(x_ev[i : i + 1024], l_ev[i : i + 1024])
                ls.append(float(lo))
                accs.append(a.cpu().numpy())
        return float(np.mean(ls)), [round(float(a), 4) for a in np.mean(accs, 0)]

    ev_before = evaluate()
    best = (ev_before[0], W.detach().clone(), B.detach().clone(), 0)  # early stopping on the eval loss
    history = []
    t_train = time.perf_counter()
    done = 0
    for step in range(steps):
        if max_seconds is not None and time.perf_counter() - t_train > max_seconds:
            logger.info("medusa: stopping at step %d (--max-seconds)", step)
            break
        pick = torch.as_tensor(rng.integers(0, len(x_tr), size=min(batch, len(x_tr)))).to(dev)
        loss, acc = loss_acc(x_tr[pick], l_tr[pick])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done = step + 1
        if step % 20 == 0 or step == steps - 1:
            history.append({"step": step, "loss": round(float(loss.detach()), 4), "acc": [round(float(a), 4) for a in acc.detach()]})
            logger.info("medusa step %d: loss %.3f acc %s", step, float(loss.detach()), history[-1]["acc"])
        if (step + 1) % 100 == 0 or step == steps - 1:
            ev_loss, ev_acc = evaluate()
            history.append({"step": step, "eval_loss": round(ev_loss, 4), "eval_acc": ev_acc})
            logger.info("medusa step %d: eval loss %.3f acc %s", step, ev_loss, ev_acc)
            if ev_loss < best[0]:
                best = (ev_loss, W.detach().clone(), B.detach().clone(), step + 1)
    with torch.no_grad():  # the weights of the best eval loss
        W.copy_(best[1])
        B.copy_(best[2])
    ev = evaluate()

    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    w_np = W.detach().cpu().numpy().astype(np.float32)
    np.savez(out / "medusa_heads.npz", w=w_np, b=B.detach().cpu().numpy().astype(np.float32),
             vocab=vocab.astype(np.int64))
    info = {
        "format": MEDUSA_HEAD_FORMAT,
        "target": target.name,
        "target_config": {"hidden_size": H, "vocab_size": vocab_size, "model_type": cfg.model_type},
        "lm_head": {"fingerprint": fingerprint(model.lm_head.weight.detach().cpu().numpy())},
        "heads": K,
        "draft_vocab": int(len(vocab)),
        "draft_vocab_coverage": round(float(counts[vocab].sum() / max(1, counts.sum())), 4),
        "corpus": {"source": Path(str(corpus)).name if corpus else f"CPython {sysconfig.get_python_version()} stdlib",
                   "held_out": list(HELD_OUT), "tokens": int(len(ids)), "train_windows": int(len(train_w)),
                   "eval_windows": int(len(eval_w)), "seq_len": seq_len,
                   "labels": "the target's own argmax (teacher-forced self-distillation)"},
        "training": {"steps": done, "planned_steps": steps, "kept_step": best[3], "batch": batch, "lr": lr, "seed": seed,
                     "device": str(dev),
                     "torch": torch.__version__, "cache_seconds": round(t_cache, 1),
                     "seconds": round(time.perf_counter() - t_start, 1)},
        "eval": {"loss": round(ev[0], 4), "head_top1_agreement": ev[1],
                 "before_training": {"loss": round(ev_before[0], 4), "head_top1_agreement": ev_before[1]}},
        "history": history,
    }
    tmp = out / "medusa_heads.json.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    tmp.replace(out / "medusa_heads.json")
    logger.info("medusa heads: held-out top-1 agreement per head %s; wrote %s", ev[1], out)
    return info


def evaluate_medusa(target: str | Path, head_dir: str | Path, *, max_tokens: int = 8192, seq_len: int = 256,
                    threads: int | None = None) -> dict[str, Any]:
    """Per-head top-1 agreement of trained heads on the :data:`HELD_OUT` files (never trained on).

    ``agreement[k]``: head ``k``'s argmax equals the target's argmax for that position (what greedy verification
    accepts, given the earlier tokens were accepted); ``accuracy[k]``: it equals the text's true token; ``top{n}``:
    the target's argmax is among head ``k``'s ``n`` best (the tree's width).
    """
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(int(threads))
    target = Path(target).expanduser()
    with np.load(Path(head_dir).expanduser() / "medusa_heads.npz", allow_pickle=False) as z:
        W, B, vocab = (torch.as_tensor(z[k]) for k in ("w", "b", "vocab"))
    model = AutoModelForCausalLM.from_pretrained(str(target / "hf"), dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
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
            x = torch.as_tensor(w[None])
            y = model(input_ids=x, use_cache=False).logits.argmax(-1)[0]
            h = captured.pop("h")[0]
            T = seq_len - K - 1
            z = h[None, :T] + torch.nn.functional.silu(torch.einsum("nh,khg->kng", h[:T], W) + B[:, None])
            lg = z @ model.lm_head.weight[vocab].T  # [K, T, Vd]
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
