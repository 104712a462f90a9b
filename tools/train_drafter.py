"""``dyncompile train-drafter TARGET --out HEAD_DIR``: train an EAGLE draft head on the target's own features.

EAGLE (Li et al. 2024) drafts at the feature level of the target: for position ``t`` it reads the
embedding of token ``t+1`` and the target's top-layer feature ``f_t`` (the hidden state entering the final
norm), and predicts ``f_{t+1}`` through ``fc([emb, f]) -> one decoder layer of the target's architecture``;
the target's own final norm and LM head turn the prediction into logits for token ``t+2``. This module
trains that head (``fc`` + the layer, initialised from the target's last layer) with EAGLE's loss:

    loss = SmoothL1(f_hat_{t+1}, f_{t+1}) + w_p * CE(softmax(target logits_{t+1}) || draft logits_{t+1})

on real text (the CPython standard library, minus the files the benchmark prompts are cut from:
:data:`HELD_OUT`) plus the target's own greedy continuations of it (self-distillation: the head learns
what the target *does* say). Inputs get uniform noise on the features (EAGLE's trick against the drift
of drafting on its own predictions). The draft LM head may cover only the ``draft_vocab`` most frequent
tokens of the training corpus (mapped back to target ids at run time).

EAGLE-3 (Li et al. 2025; ``features="fused"``, ``--features fused``): the head's feature input is instead
``fuse([h_low, h_mid, h_high])``, a trained projection of the residual stream after layers 2, ``L // 2`` and
``L - 3`` (:func:`feature_layers_for`; the ``eagle-drafter`` pass computes it inside the target's call), the
feature-regression term is dropped, and the loss covers ``ttt_steps`` draft steps unrolled on the head's own
predicted features with the attention pattern of drafted tokens at run time (:func:`rollout`, :func:`_ttt_mask`;
"training-time test"). Training can run across several calls: ``init=`` continues a saved head, and
``eval_every=`` writes a checkpoint and a held-out agreement curve (per draft step, against training tokens).

Writes ``HEAD_DIR/eagle_head.npz`` (fc, the layer's trained tensors by Hugging Face name, each with the
fingerprint of the target tensor it replaces, the draft vocabulary) and ``eagle_head.json`` (provenance,
corpus, held-out files, losses, draft accuracy on a held-out slice). The ``eagle-drafter`` pass builds the
ONNX drafter from them. EAGLE-3 heads train EAGLE-3's reference draft layer by default (``--layout reference``,
``mid.*``: :func:`reference_mid_layer`), the layout ``dyncompile export-eagle3`` writes for other runtimes;
``--layout fc`` trains ``fc`` + the target's layer, as EAGLE-1/2 heads do. PyTorch +
transformers are needed (the ``export`` extra); torch is imported here only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

from dyncompile.errors import DataError
from dyncompile.passes.speculative.eagle_drafter import (  # what the pass reads
    HEAD_FORMAT,
    HEAD_FORMAT_FUSED,
    HEAD_FORMAT_REFERENCE,
)

logger = logging.getLogger(__name__)

__all__ = ["HELD_OUT", "corpus_files", "feature_layers_for", "fingerprint", "load_corpus_tokens", "rollout",
           "train_drafter"]

#: stdlib files the benchmark prompts are cut from (tools/bench/prompt_sets.py CODE_FILES + GROUNDED_DOC_FILES):
#: never trained on.
HELD_OUT = (
    "argparse.py", "base64.py", "bisect.py", "calendar.py", "colorsys.py", "csv.py", "difflib.py", "fnmatch.py",
    "fractions.py", "heapq.py", "ipaddress.py", "json/__init__.py", "shlex.py", "statistics.py", "string.py",
    "textwrap.py",
)


def fingerprint(a: np.ndarray) -> list[float]:
    """Shape-free fingerprint of a weight (transposition-invariant): sum, sum of squares, max |x|."""
    a = np.asarray(a, np.float64)
    return [float(a.sum()), float((a * a).sum()), float(np.abs(a).max())]


def corpus_files(root: Path | None = None) -> list[Path]:
    """The CPython stdlib's own ``.py`` files (no site-packages: third-party code is kept for evaluation),
    minus :data:`HELD_OUT`, sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"corpus folder {root} does not exist; give --corpus DIR (a folder of .py files) or a .npy")
    held = {root / h for h in HELD_OUT}
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(part in ("site-packages", "dist-packages") for part in rel) or p in held:
            continue
        out.append(p)
    if not out:
        raise DataError(f"no .py files under {root}")
    return out


def load_corpus_tokens(corpus: str | Path | None, tokenizer_json: Path, *, max_tokens: int, eos: int) -> np.ndarray:
    """Token ids of the corpus (files joined by ``eos``): a ``.npy`` of ids, or a folder of ``.py`` files."""
    if corpus is not None and str(corpus).endswith(".npy"):
        ids = np.load(corpus, allow_pickle=False)
        return np.asarray(ids[:max_tokens], np.int64)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    files = corpus_files(Path(corpus) if corpus else None)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(files))  # a mix of modules, not the alphabetical first ones
    chunks, total = [], 0
    for i in order:
        try:
            text = files[i].read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tok.encode(text, add_special_tokens=False).ids
        chunks.append(np.asarray([*ids, eos], np.int64))
        total += len(ids) + 1
        if total >= max_tokens:
            break
    return np.concatenate(chunks)[:max_tokens]


def load_target(target: Path, device: Any = "cpu") -> Any:
    """The frozen fp32 PyTorch target: a model directory with ``hf/``, or the ``.gguf`` it was built from."""
    import torch
    from transformers import AutoModelForCausalLM

    if target.suffix == ".gguf":  # the GGUF the model cache was built from (dequantised: the same fp32 weights)
        model = AutoModelForCausalLM.from_pretrained(str(target.parent), gguf_file=target.name, dtype=torch.float32)
    else:
        hf_dir = target / "hf"
        if not (hf_dir / "config.json").is_file():
            raise DataError(f"{target} has no hf/config.json: train-drafter needs a model directory built by "
                            "`dyncompile models build` (or the .gguf it was built from)")
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def target_tokenizer_json(target: Path) -> Path:
    """The ``tokenizer.json`` that goes with a target :func:`load_target` reads: beside a ``.gguf``, inside a model
    directory."""
    return (target.parent if target.suffix == ".gguf" else target) / "tokenizer.json"


def _windows(ids: np.ndarray, seq_len: int) -> np.ndarray:
    n = len(ids) // seq_len
    return ids[: n * seq_len].reshape(n, seq_len)


SPLIT_SEED = 0  # the held-out split never depends on --seed: runs continuing a head (--init) keep its eval windows


def split_windows(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The corpus cut into ``seq_len`` windows, shuffled by :data:`SPLIT_SEED` and split into (eval, train): 2 % of
    the windows (at least 2) are held out. The split is the same for every ``--seed``, so a run that continues
    another (``--init``) reports agreement on windows no earlier run trained on."""
    wins = _windows(ids, seq_len)
    wins = wins[np.random.default_rng(SPLIT_SEED).permutation(len(wins))]
    n_eval = max(2, len(wins) // 50)
    return wins[:n_eval], wins[n_eval:]


def held_out_digest(eval_w: np.ndarray) -> str:
    """A fingerprint of the held-out windows (sha256 of their tokens, first 16 hex digits): a run continuing a head
    (``--init``) on another corpus, ``--max-tokens`` or ``--seq-len`` draws other windows, and this says so."""
    return hashlib.sha256(np.ascontiguousarray(eval_w, dtype=np.int64).tobytes()).hexdigest()[:16]


def distill_prompts(train_w: np.ndarray, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` self-distillation prompts of ``length`` tokens, each a slice of one training window (never of a
    held-out window, so the continuations carry no held-out text into training)."""
    if length > train_w.shape[1]:
        raise DataError(f"distillation prompts of {length} tokens do not fit windows of {train_w.shape[1]} tokens")
    rows = rng.integers(0, len(train_w), size=n)
    offs = rng.integers(0, train_w.shape[1] - length + 1, size=n)
    return np.stack([train_w[r, o : o + length] for r, o in zip(rows, offs)])


def _ttt_mask(n: int, blocks: int, device: Any) -> Any:
    """Boolean attention mask (True = attend) over ``blocks`` stacked copies of ``n`` positions (EAGLE-3's
    training-time test): a row of block 0 sees block 0 causally; row ``t`` of block ``i >= 1`` (the ``i``-th draft
    step after position ``t``) sees block 0 up to ``t`` (the true-feature cache) and row ``t`` of blocks
    ``1..i`` (its own earlier draft steps), exactly what a drafted token sees at run time."""
    import torch

    t = torch.arange(n, device=device)
    causal = t[None, :] <= t[:, None]
    diag = torch.eye(n, dtype=torch.bool, device=device)
    m = torch.zeros(blocks * n, blocks * n, dtype=torch.bool, device=device)
    for i in range(blocks):
        m[i * n : (i + 1) * n, :n] = causal
        for k in range(1, i + 1):
            m[i * n : (i + 1) * n, k * n : (k + 1) * n] = diag
    return m


def rollout(head: Any, base: Any, x: Any, feat: Any, steps: int) -> list[Any]:
    """The head's predicted features for ``steps`` draft steps after every position (training-time test).

    ``x``: tokens ``[B, T]``; ``feat``: the step-0 features of positions ``0..T-2`` (``[B, T-1, H]``, fused for
    EAGLE-3). Step 0 reads ``(x[t+1], feat[t])`` at position ``t``, causally: the drafter's catch-up call on true
    features. Step ``j >= 1`` reads ``(x[t+1+j], step j-1's output at t)`` at position ``t + j`` and attends as
    :func:`_ttt_mask` says: the ``j``-th drafted token after position ``t`` at run time. Returns one ``[B, T-1, H]``
    tensor per step (rows ``t >= T-1-j`` of step ``j`` run past the text and are padding). ``head``: ``fc`` and
    ``layer``, or ``mid`` (:func:`reference_mid_layer`); ``base``: the target's inner model (embeddings and rotary
    tables)."""
    import torch

    b, t = x.shape
    n = t - 1
    emb = base.embed_tokens(x).float()
    blocks, preds = [], []
    for j in range(steps):
        tok = emb[:, 1 + j :]
        if j:
            tok = torch.cat([tok, tok.new_zeros(b, j, tok.shape[-1])], dim=1)
        pos = torch.cat([torch.arange(n, device=x.device) + i for i in range(j + 1)])[None].expand(b, -1)
        mask = None if j == 0 else _ttt_mask(n, j + 1, x.device)[None, None]
        if "mid" in head:  # the reference layout: the token and the feature enter the layer side by side
            blocks.append((tok, feat))
            e, h = (torch.cat([blk[i] for blk in blocks], dim=1) for i in (0, 1))
            out = head["mid"](e, h, attention_mask=mask, position_embeddings=base.rotary_emb(h, pos))
        else:
            blocks.append(head["fc"](torch.cat([tok, feat], dim=-1)))
            h = torch.cat(blocks, dim=1)
            out = head["layer"](h, attention_mask=mask, position_ids=pos, position_embeddings=base.rotary_emb(h, pos),
                                use_cache=False)
        feat = (out[0] if isinstance(out, tuple) else out)[:, j * n :]
        preds.append(feat)
    return preds


#: the reference layer's tensors that stand in for a tensor of the same name in the target's last layer (the
#: ``eagle-drafter`` pass finds those by fingerprint); ``hidden_norm`` stands in for the target's ``input_layernorm``
_REF_SAME = ("self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
             "post_attention_layernorm.weight")
_REF_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


def reference_mid_layer(layer: Any, hidden: int) -> Any:
    """EAGLE-3's reference draft layer (``midlayer`` of the EAGLE-3 / AngelSlim / SpecForge checkpoints that vLLM,
    SGLang and OpenVINO GenAI run), initialised from the target's last decoder layer ``layer``::

        x = [input_layernorm(embedding), hidden_norm(h)]        # 2H wide
        h = h + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))
        h = h + mlp(post_attention_layernorm(h))

    ``q/k/v_proj`` read 2H and carry no bias (also for targets whose attention has one, as in the reference); the
    embedding half starts at zero, the feature half as the target's projection, the rest as the target's layer."""
    import copy

    import torch

    class ReferenceMidLayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = copy.deepcopy(layer.self_attn).float()
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(self.self_attn, name)
                new = torch.nn.Linear(2 * hidden, old.out_features, bias=False)
                with torch.no_grad():
                    new.weight.zero_()
                    new.weight[:, hidden:] = old.weight.float()
                setattr(self.self_attn, name, new)
            self.mlp = copy.deepcopy(layer.mlp).float()
            self.post_attention_layernorm = copy.deepcopy(layer.post_attention_layernorm).float()
            self.input_layernorm = copy.deepcopy(layer.input_layernorm).float()
            self.hidden_norm = copy.deepcopy(layer.input_layernorm).float()
            for p in self.parameters():  # the copies come from the frozen target: every tensor of the layer trains
                p.requires_grad_(True)

        def forward(self, emb, h, *, attention_mask, position_embeddings):
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
            h = h + self.self_attn(hidden_states=x, position_embeddings=position_embeddings,
                                   attention_mask=attention_mask)[0]
            return h + self.mlp(self.post_attention_layernorm(h))

    return ReferenceMidLayer()


def feature_layers_for(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high feature taps for a ``num_layers``-deep target: the residual stream after layers
    2, ``num_layers // 2`` and ``num_layers - 3`` (Hugging Face ``hidden_states`` indices)."""
    if num_layers < 4:
        raise DataError(f"fused features need a target of at least 4 layers, this one has {num_layers}")
    return sorted({2, num_layers // 2, num_layers - 3})


def self_distill(model: Any, train_w: np.ndarray, n: int, prompt_len: int, new_len: int, rng: np.random.Generator,
                 *, eos: int, progress: bool = True) -> np.ndarray:
    """``n`` greedy continuations (``new_len`` tokens) by the target of ``prompt_len``-token slices of training
    windows (:func:`distill_prompts`): rows of ``prompt_len + new_len`` tokens, the text the target itself would write
    (the self-distillation data of both trainers). On CUDA the target runs under bfloat16 autocast."""
    import torch
    from tqdm import tqdm

    if n <= 0:
        return np.zeros((0, prompt_len + new_len), np.int64)
    dev = next(model.parameters()).device
    amp = dev.type == "cuda"
    gen_bs = 512 if amp else 4
    prompts = distill_prompts(train_w, n, prompt_len, rng)
    outs = []
    bar = tqdm(range(0, len(prompts), gen_bs), desc="self-distillation", disable=not progress)
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
        for i in bar:
            p = torch.as_tensor(prompts[i : i + gen_bs], device=dev)
            g = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=new_len, min_new_tokens=new_len,
                               do_sample=False, pad_token_id=eos, eos_token_id=None)
            outs.append(g.cpu().numpy())
    distilled = np.concatenate(outs)
    logger.info("self-distillation: %d sequences of %d tokens", len(distilled), distilled.shape[1])
    return distilled


def train_drafter(
    target: str | Path,
    out: str | Path,
    *,
    corpus: str | Path | None = None,
    device: str = "cpu",
    steps: int = 200,
    batch: int = 8,
    seq_len: int = 256,
    lr: float = 3e-4,
    draft_vocab: int = 8192,
    max_tokens: int = 2_000_000,
    distill_sequences: int = 0,
    distill_prompt: int = 64,
    distill_new: int = 192,
    p_weight: float = 0.1,
    noise: float | None = None,
    features: str = "top",
    layout: str | None = None,
    ttt_steps: int = 1,
    ttt_decay: float = 0.8,
    init: str | Path | None = None,
    eval_every: int = 0,
    eval_windows: int = 64,
    seed: int = 0,
    max_seconds: float | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train an EAGLE head for ``target`` (a model directory with ``hf/``, or its ``.gguf``) and write it to ``out``.

    ``features="top"``: EAGLE-1/2 (the top-layer feature in, feature regression + distribution loss).
    ``features="fused"``: EAGLE-3 (Li et al. 2025): the head reads ``fuse([h_low, h_mid, h_high])``, a trained
    projection of three of the target's layers (:func:`feature_layers_for`); the loss is the distribution loss
    alone, over ``ttt_steps`` draft steps unrolled on the head's own predicted features (training-time test: step
    ``j`` feeds step ``j-1``'s output as the feature, attends as a drafted token does at run time (:func:`_ttt_mask`),
    and is weighted ``ttt_decay ** j``). ``layout="reference"`` (EAGLE-3 only; its default) trains EAGLE-3's reference
    draft layer (:func:`reference_mid_layer`), the layout other runtimes load (``dyncompile export-eagle3`` writes it
    as their checkpoint); ``layout="fc"`` trains ``fc`` + a copy of the target's layer instead (EAGLE-1/2's only
    layout). Without ``layout``, a continued head (``init``) keeps its own. ``init=HEAD_DIR`` continues from a saved
    head (same kind, same target): training across several runs, the vocabulary and history carried over. ``eval_every=N`` measures held-out
    agreement per draft step every ``N`` steps (the curve in ``eagle_head.json``) and saves the head then too, so a
    run stopped from outside keeps its last checkpoint."""
    import torch
    from tqdm import tqdm

    if features not in ("top", "fused"):
        raise DataError(f"features must be 'top' or 'fused', not {features!r}")
    if ttt_steps < 1 or (features == "top" and ttt_steps != 1):
        raise DataError(f"ttt_steps must be >= 1 (and 1 for features='top'), got {ttt_steps}")
    if layout is not None and (layout not in ("fc", "reference") or (layout == "reference" and features != "fused")):
        raise DataError(f"layout must be 'fc' or 'reference' (the latter with features='fused', EAGLE-3), got "
                        f"layout={layout!r} with features={features!r}")
    fused = features == "fused"
    if noise is None:
        noise = 0.0 if fused else 0.2
    t_start = time.perf_counter()
    # a head of another kind is refused before the target is loaded (seconds on CPU)
    prev = _load_init(init, fused, None if layout is None else layout == "reference") if init else None
    if layout is None:  # EAGLE-3's reference layer agrees more and drafts faster (eagle3-interop study)
        layout = _layout_of(prev["arrays"]) if prev else ("reference" if fused else "fc")
    reference = layout == "reference"
    target = Path(target).expanduser()
    torch.manual_seed(seed)
    dev = torch.device(device)
    model = load_target(target, dev)
    cfg = model.config
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id[0]
    ids = load_corpus_tokens(corpus, target_tokenizer_json(target), max_tokens=max_tokens, eos=eos)
    logger.info("corpus: %d tokens", len(ids))
    rng = np.random.default_rng(seed)
    eval_w, train_w = split_windows(ids, seq_len)
    amp = dev.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if amp else (lambda: torch.autocast("cpu", enabled=False))
    held_out = held_out_digest(eval_w)
    held_out_changed: bool | None = False
    if prev is not None:
        before = (prev["info"].get("corpus") or {}).get("held_out_windows_sha256")
        held_out_changed = None if before is None else before != held_out
        if held_out_changed is None:
            logger.warning("--init %s records no fingerprint of its held-out windows (written before heads recorded "
                           "one): this run cannot check that it evaluates on the same windows", init)
        elif held_out_changed:
            logger.warning("--init %s was evaluated on other held-out windows (%s; here %s: another corpus, --max-tokens "
                           "or --seq-len): this run's held-out agreement does not continue its curve, and its held-out "
                           "windows may hold text that run trained on; keep those options to continue a head",
                           init, before, held_out)

    # --- self-distillation: the target's own greedy continuations of corpus prefixes ---------------
    distilled = self_distill(model, train_w, distill_sequences, distill_prompt, distill_new, rng, eos=eos,
                             progress=progress)

    # --- draft vocabulary: most frequent tokens of the training text (corpus + continuations) -----
    vocab_size = int(cfg.vocab_size)
    counts = np.bincount(np.concatenate([train_w.ravel(), distilled.ravel()]), minlength=vocab_size)
    if prev is not None:
        vocab = prev["arrays"]["vocab"].astype(np.int64)
    elif draft_vocab and draft_vocab < vocab_size:
        vocab = np.sort(np.argsort(-counts, kind="stable")[:draft_vocab])
        if eos not in vocab:
            vocab = np.sort(np.append(vocab[1:] if len(vocab) else vocab, eos))
    else:
        vocab = np.arange(vocab_size)
    coverage = float(counts[vocab].sum() / max(1, counts.sum()))
    vocab_t = torch.as_tensor(vocab, device=dev)

    # --- the head: [fuse +] fc + a copy of the target's last decoder layer, or the reference layer --------
    import copy

    base = model.model
    hidden = int(cfg.hidden_size)
    last_idx = len(base.layers) - 1
    taps = feature_layers_for(last_idx + 1) if fused else []
    target_layer = base.layers[last_idx]
    layer_orig = {k: v.detach().float().cpu().numpy().copy() for k, v in target_layer.state_dict().items()}
    if reference:
        modules = {"mid": reference_mid_layer(target_layer, hidden)}
    else:
        layer = copy.deepcopy(target_layer).float()
        for p in layer.parameters():
            p.requires_grad_(True)
        fc = torch.nn.Linear(2 * hidden, hidden, bias=True)
        modules = {"fc": fc, "layer": layer}
        with torch.no_grad():  # start as "take the feature" (identity on the feature half)
            fc.weight.zero_()
            fc.weight[:, hidden:] = torch.eye(hidden)
            fc.bias.zero_()
    if fused:  # fuse: [h_low, h_mid, h_high] -> H, starting as "take the high tap"
        fuse = torch.nn.Linear(len(taps) * hidden, hidden, bias=False)
        with torch.no_grad():
            fuse.weight.zero_()
            fuse.weight[:, -hidden:] = torch.eye(hidden)
        modules["fuse"] = fuse
    head = torch.nn.ModuleDict(modules).to(dev)
    if prev is not None:
        _restore(head, prev, hidden, taps)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps)))))
    norm = base.norm
    w_head = model.lm_head.weight[vocab_t]  # [Vd, H]
    captured = {}
    hook = norm.register_forward_hook(lambda m, a, o: captured.__setitem__("f", a[0]))

    def target_pass(x):
        """(feature per position, the target's logits over the draft vocabulary)."""
        with torch.no_grad(), autocast():
            out = model(input_ids=x, use_cache=False, output_hidden_states=fused)
        f = captured.pop("f").float()
        if fused:
            f = torch.cat([out.hidden_states[k].float() for k in taps], dim=-1)
        logits = out.logits.float()[..., vocab_t]
        return f, logits

    def losses(x):
        """Per draft step: (feature loss or 0, distribution loss, top-1 agreement); x: tokens [B, T]."""
        f, logits = target_pass(x)
        f_in = f[:, :-1]
        if noise > 0 and head.training:
            f_in = f_in + (torch.rand_like(f_in) - 0.5) * noise
        out = []
        with autocast():
            preds = rollout(head, base, x, head["fuse"](f_in) if fused else f_in, ttt_steps)
            for j, pred in enumerate(preds):
                valid = pred.shape[1] - j  # rows t < n - j have a next token x[t + j + 2] to predict
                plog = torch.nn.functional.linear(norm(pred[:, :valid]), w_head).float()
                tl = logits[:, 1 + j :]
                tp = torch.softmax(tl, -1)
                ploss = -(tp * torch.log_softmax(plog, -1)).sum(-1).mean()
                acc = (plog.argmax(-1) == tl.argmax(-1)).float().mean()
                if fused:
                    vloss = ploss.new_zeros(())
                else:
                    tgt = f[:, 1:]
                    scale = tgt.detach().abs().mean()
                    vloss = torch.nn.functional.smooth_l1_loss(pred.float() / scale, tgt / scale)
                out.append((vloss, ploss, acc))
        return out

    def evaluate(windows):
        was = head.training
        head.eval()
        ev = []
        with torch.no_grad():
            for i in range(0, len(windows), batch):
                x = torch.as_tensor(windows[i : i + batch], device=dev)
                ev.append([[float(v) for v in step] for step in losses(x)])
        head.train(was)
        return np.asarray(ev).mean(0)  # [ttt_steps, 3]

    # training rows: corpus windows and distilled sequences (each cut to seq_len)
    rows = [r for r in train_w]
    for d in distilled:
        rows.append(d[:seq_len] if len(d) >= seq_len else d)
    lengths = {len(r) for r in rows}
    history = list(prev["info"].get("history", [])) if prev else []
    curve = list(prev["info"].get("curve", [])) if prev else []
    tokens_before = int((prev["info"].get("training") or {}).get("tokens_seen", 0)) if prev else 0
    tokens_seen = tokens_before
    out = Path(out).expanduser()
    weights = [ttt_decay ** j for j in range(ttt_steps)]
    meta = {"hidden": hidden, "last_idx": last_idx, "vocab_size": vocab_size, "cfg": cfg, "vocab": vocab,
            "coverage": coverage, "ids": ids, "corpus": corpus, "train_w": train_w, "eval_w": eval_w,
            "held_out": held_out,
            "seq_len": seq_len, "distilled": distilled, "distill_prompt": distill_prompt, "distill_new": distill_new,
            "taps": taps, "layer_orig": layer_orig, "target": target, "reference": reference}

    def save(done, ev_arr):
        info = _write_head(out, head, meta, {
            "steps": done, "planned_steps": steps, "batch": batch, "lr": lr, "p_weight": p_weight, "noise": noise,
            "seed": seed, "features": features, "layout": layout, "ttt_steps": ttt_steps, "ttt_decay": ttt_decay,
            "tokens_seen": tokens_seen, "continued_from": prev["info"]["training"] if prev else None,
            "held_out_changed": held_out_changed,
            "device": str(dev), "torch": torch.__version__, "seconds": round(time.perf_counter() - t_start, 1)},
            ev_arr, history, curve)
        return info

    head.train()
    bar = tqdm(range(steps), desc="train eagle head", disable=not progress)
    t_train = time.perf_counter()
    done = 0
    probe = eval_w[:eval_windows]
    for step in bar:
        if max_seconds is not None and time.perf_counter() - t_train > max_seconds:
            logger.info("stopping at step %d: --max-seconds %.0f reached", step, max_seconds)
            break
        done = step + 1
        L = sorted(lengths)[step % len(lengths)] if len(lengths) > 1 else seq_len
        pool = [i for i in range(len(rows)) if len(rows[i]) == L]
        pick = rng.choice(pool, size=min(batch, len(pool)), replace=False)
        x = torch.as_tensor(np.stack([rows[i] for i in pick]), device=dev)
        per_step = losses(x)
        loss = sum(w * (v + p_weight * p if not fused else p) for w, (v, p, _) in zip(weights, per_step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        sched.step()
        tokens_seen += int(x.numel())
        if step % 10 == 0 or step == steps - 1:
            v, pl, a = (float(t.detach()) for t in per_step[0])
            history.append({"step": step, "tokens": tokens_seen, "vloss": round(v, 5), "ploss": round(pl, 4),
                            "acc": [round(float(s[2]), 4) for s in per_step]})
            bar.set_postfix(p=f"{pl:.3f}", acc="/".join(f"{float(s[2]):.2f}" for s in per_step))
            if not progress and step % 200 == 0:
                logger.info("step %d: ploss %.3f acc %s", step, pl, [round(float(s[2]), 3) for s in per_step])
        if eval_every and (step + 1) % eval_every == 0:
            ev_arr = evaluate(probe)
            curve.append({"step": step + 1, "tokens": tokens_seen, "ploss": [round(float(e[1]), 4) for e in ev_arr],
                          "agreement": [round(float(e[2]), 4) for e in ev_arr]})
            logger.info("eval at %d tokens: agreement per draft step %s", tokens_seen, curve[-1]["agreement"])
            save(done, ev_arr)
    ev_arr = evaluate(eval_w)
    hook.remove()
    info = save(done, ev_arr)
    logger.info("eagle head: eval top-1 agreement per draft step %s; wrote %s", info["eval"]["ttt_agreement"], out)
    return info


def _layout_of(arrays: dict[str, Any]) -> str:
    """The draft layer's layout of a saved head: ``reference`` (EAGLE-3's ``mid.*`` layer) or ``fc``."""
    return "reference" if any(k.startswith("mid.") for k in arrays) else "fc"


def _load_init(init: str | Path, fused: bool, reference: bool | None = False) -> dict[str, Any]:
    """The head ``--init`` names, refused when its kind differs (``reference=None``: either layout)."""
    d = Path(init).expanduser()
    try:
        info = json.loads((d / "eagle_head.json").read_text(encoding="utf-8"))
        with np.load(d / "eagle_head.npz", allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k]) for k in z.files}
    except (OSError, ValueError) as e:
        raise DataError(f"--init {d}: not a head written by train-drafter ({e})") from None
    if ("fuse.weight" in arrays) != fused:
        raise DataError(f"--init {d} is a {'fused' if 'fuse.weight' in arrays else 'top'}-feature head; "
                        "continue it with the same --features")
    if reference is not None and (_layout_of(arrays) == "reference") != reference:
        raise DataError(f"--init {d} has the {'fc' if reference else 'reference'} layout; continue it with the same "
                        "--layout")
    return {"arrays": arrays, "info": info}


def _restore(head: Any, prev: dict[str, Any], hidden: int, taps: list[int]) -> None:
    import torch

    arrays, info = prev["arrays"], prev["info"]
    if (info.get("target_config") or {}).get("hidden_size") != hidden or list(info.get("feature_layers") or []) != taps:
        raise DataError("--init: that head was trained for another target (hidden size or feature layers differ)")
    with torch.no_grad():
        for name, mod in head.items():
            for k, v in mod.state_dict().items():
                v.copy_(torch.as_tensor(arrays[f"{name}.{k}"], device=v.device, dtype=v.dtype))


def _write_head(out: Path, head: Any, meta: dict[str, Any], training: dict[str, Any], ev_arr: np.ndarray,
                history: list[dict[str, Any]], curve: list[dict[str, Any]]) -> dict[str, Any]:
    """Write ``eagle_head.npz`` + ``eagle_head.json`` (each atomically: a checkpoint never half-written)."""
    import os

    out.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {"vocab": meta["vocab"].astype(np.int64)}
    params = {}
    orig = meta["layer_orig"]
    for name, mod in head.items():
        for k, v in mod.state_dict().items():
            arrays[f"{name}.{k}"] = v.detach().cpu().float().numpy()
            if name == "layer" or (name == "mid" and k in _REF_SAME):
                params[k] = {"shape": list(v.shape), "replaces": fingerprint(orig[k])}
            elif name == "mid" and k == "hidden_norm.weight":
                params[k] = {"shape": list(v.shape), "replaces": fingerprint(orig["input_layernorm.weight"])}
            elif name == "mid" and k in _REF_QKV:  # 2H wide: found by the target tensor it widens (and its bias)
                bias = orig.get(k.removesuffix("weight") + "bias")
                params[k] = {"shape": list(v.shape), "widens": fingerprint(orig[k]),
                             "drops_bias": None if bias is None else fingerprint(bias)}
    tmp = out / ".eagle_head.npz.tmp"
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
    os.replace(tmp, out / "eagle_head.npz")
    cfg, corpus = meta["cfg"], meta["corpus"]
    info = {
        "format": HEAD_FORMAT_REFERENCE if meta["reference"] else HEAD_FORMAT_FUSED if meta["taps"] else HEAD_FORMAT,
        "target": meta["target"].name,
        "target_config": {"hidden_size": meta["hidden"], "num_layers": meta["last_idx"] + 1,
                          "vocab_size": meta["vocab_size"], "model_type": cfg.model_type,
                          "rms_norm_eps": float(getattr(cfg, "rms_norm_eps", 1e-6))},
        "feature_layers": meta["taps"],
        "layer_params": params,
        "draft_vocab": int(len(meta["vocab"])),
        "draft_vocab_coverage": round(meta["coverage"], 4),
        "corpus": {"source": Path(str(corpus)).name if corpus else f"CPython {sysconfig.get_python_version()} stdlib",
                   "held_out": list(HELD_OUT), "tokens": int(len(meta["ids"])),
                   "train_windows": int(len(meta["train_w"])), "eval_windows": int(len(meta["eval_w"])), "split_seed": SPLIT_SEED,
                   "held_out_windows_sha256": meta["held_out"],
                   "seq_len": meta["seq_len"], "distilled_sequences": int(len(meta["distilled"])),
                   "distill_prompt": meta["distill_prompt"], "distill_new": meta["distill_new"]},
        "training": training,
        "eval": {"vloss": round(float(ev_arr[0][0]), 5), "ploss": round(float(ev_arr[0][1]), 4),
                 "draft_top1_agreement": round(float(ev_arr[0][2]), 4),
                 "ttt_agreement": [round(float(e[2]), 4) for e in ev_arr]},
        "curve": curve,
        "history": history,
    }
    tmp = out / ".eagle_head.json.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, out / "eagle_head.json")
    return info


def main(argv: list[str] | None = None) -> int:
    """``dyncompile train-drafter TARGET --out HEAD_DIR``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="dyncompile train-drafter",
        description="Train an EAGLE draft head (fc + one decoder layer of the target's architecture) on the target's "
        "own features over the CPython standard library (minus the files benchmark prompts are cut from) and the "
        "target's own greedy continuations of it. Needs PyTorch + transformers (`pip install dyncompile[train]`). "
        "Then: dyncompile MODEL.onnx --passes 'eagle-drafter{head=HEAD_DIR},speculative' -o PLAN",
        epilog="example (a tiny CPU head in ~1 min): dyncompile train-drafter ~/.cache/dyncompile/models/smollm2-135m "
        "--out ~/.cache/dyncompile/heads/smollm2-tiny --steps 40 --max-tokens 60000 --seq-len 128 --batch 4",
    )
    p.add_argument("target", help="model directory with hf/ (from `dyncompile models build`), or the .gguf it was built from")
    p.add_argument("--out", required=True, help="head directory to write (eagle_head.npz + eagle_head.json, or "
                   "medusa_heads.npz + medusa_heads.json)")
    p.add_argument("--kind", choices=("eagle", "medusa"), default="eagle",
                   help="eagle: fc + one decoder layer (default); medusa: K residual heads on the last hidden state "
                   "(Medusa-1), trained on the target's own predictions; then --passes 'medusa-heads{head=DIR},"
                   "explicit-attention,speculative{tree=true}'")
    p.add_argument("--heads", type=int, default=3, help="medusa: number of heads (1..16, default %(default)s)")
    p.add_argument("--corpus", help="folder of .py files or a .npy of token ids (default: this Python's stdlib)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument("--steps", type=int, help="default 200 (eagle) / 600 (medusa)")
    p.add_argument("--batch", type=int, help="default 8 sequences (eagle) / 256 positions (medusa)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, help="default 3e-4 (eagle) / 1e-3 (medusa)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft LM head size (0 = the full vocabulary)")
    p.add_argument("--max-tokens", type=int, help="corpus tokens to read (default 2,000,000 for eagle; 60,000 for "
                   "medusa, whose target pass over them is cached in memory)")
    p.add_argument("--distill", type=int, default=0, metavar="N", help="self-distillation: N greedy target continuations "
                   "of corpus prefixes added to the training text (both kinds)")
    p.add_argument("--distill-eval", type=int, metavar="N", help="medusa: N greedy target continuations of held-out "
                   "prefixes, the eval set that picks the checkpoint (default: --distill / 16)")
    p.add_argument("--lm-heads", action="store_true", help="medusa: one LM head per head over the draft vocabulary, "
                   "initialised from the target's and trained (the paper's Medusa-1 heads; default: the target's LM "
                   "head, frozen and shared)")
    p.add_argument("--features", choices=("top", "fused"), default="top",
                   help="eagle: top = the top layer's feature (EAGLE-1/2, default); fused = EAGLE-3: a trained "
                   "projection of a low, a middle and a high layer's features, distribution loss only")
    p.add_argument("--layout", choices=("fc", "reference"),
                   help="eagle: reference = EAGLE-3's reference draft layer (embedding and feature side by side into "
                   "a 2H-wide attention; the default with --features fused: it agrees more and drafts faster), the "
                   "checkpoint layout vLLM, SGLang and OpenVINO GenAI load (`dyncompile export-eagle3`); fc = "
                   "fc([embedding, feature]) + a copy of the target's last layer (EAGLE-1/2's, the default with "
                   "--features top); with --init, the head's own")
    p.add_argument("--ttt-steps", type=int, default=1, metavar="K",
                   help="eagle, fused: training-time test, K draft steps unrolled on the head's own predictions "
                   "(EAGLE-3 uses several; default %(default)s)")
    p.add_argument("--init", metavar="HEAD_DIR", help="eagle: continue training this head (several runs, one curve)")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="held-out agreement every N steps, saving the head each time (eagle: per draft step, the "
                   "curve in eagle_head.json; medusa: per head, keeping the best summed agreement so far, default 100)")
    p.add_argument("--max-seconds", type=float, help="stop training after this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    medusa = args.kind == "medusa"
    for name, eagle_default, medusa_default in (("steps", 200, 600), ("batch", 8, 256), ("lr", 3e-4, 1e-3),
                                                ("max_tokens", 2_000_000, 60_000)):
        if getattr(args, name) is None:
            setattr(args, name, medusa_default if medusa else eagle_default)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise DataError(f"train-drafter needs PyTorch and transformers ({e}); pip install 'dyncompile[train]'") from None
    for name in ("steps", "batch", "seq_len", "max_tokens"):
        if getattr(args, name) < 1:
            raise DataError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise DataError(f"--device must be cpu or cuda, not {args.device!r}")
    if args.kind == "medusa":
        from dyncompile.tools.train_medusa import train_medusa

        info = train_medusa(args.target, args.out, heads=args.heads, corpus=args.corpus, device=args.device, steps=args.steps,
                            batch=args.batch, seq_len=args.seq_len, lr=args.lr, draft_vocab=args.draft_vocab,
                            max_tokens=args.max_tokens, distill_sequences=args.distill, seed=args.seed,
                            distill_eval=args.distill_eval, lm_heads=args.lm_heads,
                            max_seconds=args.max_seconds, eval_every=args.eval_every or 100)
        print(f"medusa heads written to {args.out}: held-out top-1 agreement with the target per head "
              f"{info['eval']['head_top1_agreement']}, draft vocabulary {info['draft_vocab']}, "
              f"{info['training']['seconds']} s")
        return 0
    info = train_drafter(args.target, args.out, corpus=args.corpus, device=args.device, steps=args.steps,
                         batch=args.batch, seq_len=args.seq_len, lr=args.lr, draft_vocab=args.draft_vocab,
                         max_tokens=args.max_tokens, distill_sequences=args.distill, seed=args.seed,
                         max_seconds=args.max_seconds, progress=not args.quiet, features=args.features,
                         layout=args.layout, ttt_steps=args.ttt_steps, init=args.init, eval_every=args.eval_every)
    print(f"head written to {args.out}: draft agreement per step {info['eval']['ttt_agreement']} on held-out "
          f"windows, draft vocabulary {info['draft_vocab']} ({info['draft_vocab_coverage']:.1%} of corpus tokens), "
          f"{info['training']['seconds']} s")
    return 0
