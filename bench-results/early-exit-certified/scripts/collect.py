"""Cache per-row exit features (pooled hidden states) + teacher probs for calib and test of a model."""
import sys, time, logging
import numpy as np, onnx_ir as ir
from pathlib import Path
from dyncompile.io import read_jsonl, texts_and_labels
from dyncompile.models import build_model
from dyncompile.passes.early_exit.fit_exit_heads import collect_exit_features, find_exit_cuts
logging.basicConfig(level=logging.INFO)
name = sys.argv[1]
art = build_model(name)  # only returns the cached artifact if present
cfg = art.config
D = Path("/work/shared/data/sentiment")
model = ir.load(art.onnx_path)
L, cuts, _ = find_exit_cuts(model)
exits = list(range(1, L))
out = {}
for split in ("calib", "test"):
    t, y = texts_and_labels(read_jsonl(D / f"movie-{split}.jsonl"), cfg["labels"])
    t0 = time.time()
    feats, teacher = collect_exit_features(model, [cuts[k] for k in exits], t, tokenizer_file=art.tokenizer_path,
                                           max_length=cfg.get("max_length", 64), pooling="cls+mean", progress=False)
    print(split, "probe", time.time() - t0, flush=True)
    for j, f in enumerate(feats):
        out[f"{split}_f{j}"] = f
    out[f"{split}_teacher"] = teacher
    out[f"{split}_y"] = np.asarray(y)
np.savez(f"/tmp/cert-work/{name}.npz", L=L, exits=np.array(exits), **out)
print("done")
