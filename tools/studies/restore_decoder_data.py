"""Rebuild a recipe decoder's ``model.onnx.data`` on a machine that has its GGUF but not the fp32 ONNX weights.

The GPU machine reaches no registry and takes ~60 MB per call, so a 2.5 GB fp32 weight file cannot travel; its
GGUF (the source the recipe dequantises) can. This writes the ONNX graph's external weights from the GGUF's
dequantised tensors, using a map made where both exist (``--make-map``: each external initializer's offset and
length, and the HF parameter it equals, possibly transposed), and checks the result byte for byte against the
sha256 recorded where the recipe built it. The recipe's own export is not rerun (its torch/transformers differ
there and its graph would not be the one the plans were compiled from).

  python -m dyncompile.tools.studies.restore_decoder_data --make-map MODEL_DIR... -o map.json         # where both exist
  python -m dyncompile.tools.studies.restore_decoder_data --restore MODEL_DIR --gguf FILE --map map.json \
      [--save-hf DIR]                                      # where only the GGUF is (the map holds the sha256)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path


def make_map(model_dirs: list[str]) -> dict:
    import numpy as np
    import onnx
    from safetensors import safe_open

    from dyncompile.io import sha256_file

    out = {}
    for d in map(Path, model_dirs):
        m = onnx.load(str(d / "model.onnx"), load_external_data=False)
        st = safe_open(str(d / "hf" / "model.safetensors"), "np")
        idx = {}
        for k in st.keys():
            a = st.get_tensor(k)
            idx.setdefault(hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest(), (k, "id"))
            if a.ndim == 2:
                idx.setdefault(hashlib.sha1(np.ascontiguousarray(a.T).tobytes()).hexdigest(), (k, "T"))
        data = np.memmap(d / "model.onnx.data", dtype=np.uint8, mode="r")
        rows = []
        for t in m.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in t.external_data}
            off, ln = int(info.get("offset", 0)), int(info["length"])
            h = hashlib.sha1(data[off:off + ln]).hexdigest()
            if h not in idx:
                raise SystemExit(f"{d}: initializer {t.name} equals no HF parameter (transposed or not)")
            rows.append([t.name, off, ln, *idx[h]])
        out[d.name] = {"rows": rows, "size": int(data.size),
                       "sha256": sha256_file(d / "model.onnx.data")}
    return out


def restore(model_dir: str, gguf: str, map_file: str, save_hf: str | None) -> str:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    d = Path(model_dir)
    entry = json.loads(Path(map_file).read_text())[d.name]
    g = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32)
    sd = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    buf = np.zeros(entry["size"], np.uint8)
    for name, off, ln, key, how in entry["rows"]:
        a = sd[key].T if how == "T" else sd[key]
        b = np.ascontiguousarray(a, dtype=np.float32).view(np.uint8).ravel()
        if b.size != ln:
            raise SystemExit(f"{name}: {key} gives {b.size} bytes, the graph expects {ln}")
        buf[off:off + ln] = b
    tmp = d / f".model.onnx.data.tmp-{os.getpid()}"
    buf.tofile(tmp)
    digest = hashlib.sha256(memoryview(buf)).hexdigest()  # no second copy of a multi-GB buffer
    if digest != entry["sha256"]:
        tmp.unlink()
        raise SystemExit(f"{d}: restored weights differ from the recipe's build (sha256 {digest} != {entry['sha256']})")
    os.replace(tmp, d / "model.onnx.data")
    if save_hf:
        from dyncompile.models._decoders import _to_plain_model

        _to_plain_model(model).save_pretrained(save_hf)
    return digest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--make-map", nargs="+", metavar="MODEL_DIR")
    p.add_argument("-o", "--out")
    p.add_argument("--restore", metavar="MODEL_DIR")
    p.add_argument("--gguf")
    p.add_argument("--map")
    p.add_argument("--save-hf", help="also save the dequantised model as an HF folder (for peers' exporters)")
    a = p.parse_args(argv)
    if a.make_map:
        Path(a.out).write_text(json.dumps(make_map(a.make_map)))
        print("written", a.out)
    else:
        print(a.restore, "model.onnx.data sha256", restore(a.restore, a.gguf, a.map, a.save_hf), "(matches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
