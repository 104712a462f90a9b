"""Does dyncompile's ONNX drafter compute what the reference EAGLE-3 layer computes, on the exported checkpoint?

Two steps, two environments (dyncompile's, then the OpenVINO GenAI one with optimum-intel and torch):

    python check_reference.py ours PLAN_DIR MODEL_DIR OUT.npz         # the plan's drafter on 30 rows of real code
    python check_reference.py theirs CHECKPOINT_DIR MODEL_DIR OUT.npz # optimum-intel's LlamaEagle3ForCausalLM

``ours`` runs the target (its fused features) and the plan's drafter on the rows of a stdlib prompt and stores the
token ids, the target's raw low/middle/high hidden states (Hugging Face, the taps of the checkpoint), and the
drafter's logits. ``theirs`` loads the exported checkpoint into optimum-intel's reference class (the embedding is
the target's, shared at run time: copied in here), feeds it the same ids and raw states, and compares logits.
"""

import json
import sys
from pathlib import Path

import numpy as np

mode, a, model_dir, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]).expanduser(), sys.argv[4]
ROWS = 30
if mode == "ours":
    import onnx
    import onnxruntime as ort
    import torch

    import dyncompile
    from dyncompile.plan import DecoderSpec
    from dyncompile.runtime.decode.eagle import EagleDecoder
    from dyncompile.tools.bench.prompt_sets import STDLIB
    from dyncompile.tools.train_drafter import load_target

    m = dyncompile.load(a)
    step = m.handlers[-1]
    code = (STDLIB / "bisect.py").read_text()
    ids = step.codec.encode(code[: code.index("def insort_left")])[-(ROWS + 10):]
    step.target.reset()
    step.target.forward(ids)
    feats = step.target.last_outputs["features"]
    d = json.loads((a / "plan.json").read_text())["steps"][0]["drafter"]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    dec = EagleDecoder(ort.InferenceSession(str(a / "drafter.onnx"), so, providers=["CPUExecutionProvider"]),
                       DecoderSpec.from_params(d["decoder"]), feature_input=d["feature_input"],
                       hidden_output=d["hidden_output"])
    dec.reset()
    logits, _ = dec.step(ids[1 : ROWS + 1], feats[:ROWS])
    vocab = np.asarray(step.drafter.vocab)
    hf = load_target(model_dir)
    meta = {p.key: p.value for p in onnx.load(str(a / "model.onnx"), load_external_data=False).metadata_props}
    taps = json.loads(meta["dyncompile.eagle"])["feature_layers"]
    with torch.no_grad():
        hs = hf(input_ids=torch.as_tensor([ids]), output_hidden_states=True).hidden_states
    raw = torch.cat([hs[k] for k in taps], -1)[0].numpy()
    np.savez(out, ids=np.asarray(ids[1 : ROWS + 1]), raw=raw[:ROWS], logits=np.asarray(logits), vocab=vocab)
    print(f"ours: {ROWS} rows, taps {taps}, logits {np.asarray(logits).shape} -> {out}")
else:
    import torch
    from optimum.exporters.openvino.model_patcher import LlamaEagle3ForCausalLM
    from safetensors import safe_open
    from transformers import AutoConfig

    model = LlamaEagle3ForCausalLM.from_pretrained(a, config=AutoConfig.from_pretrained(a)).eval()
    with safe_open(str(model_dir / "hf" / "model.safetensors"), framework="pt") as f:
        model.model.embed_tokens.weight.data[:] = f.get_tensor("model.embed_tokens.weight")
    z = np.load(out, allow_pickle=False)
    with torch.no_grad():
        ref = model(input_ids=torch.as_tensor(z["ids"])[None], hidden_states=torch.as_tensor(z["raw"])[None],
                    use_cache=False).logits[0].numpy()
    ours = z["logits"]
    d2t = model.model.d2t.numpy()
    report = {"rows": int(len(ours)), "max_abs_diff": float(np.abs(ref - ours).max()),
              "logit_scale": float(np.abs(ref).max()), "argmax_agreement": float((ref.argmax(-1) == ours.argmax(-1)).mean()),
              "d2t_maps_to_the_plan_vocabulary": bool((np.arange(len(d2t)) + d2t == z["vocab"]).all())}
    print(json.dumps(report))
