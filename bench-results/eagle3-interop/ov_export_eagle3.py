"""Convert a reference EAGLE-3 checkpoint (``dyncompile export-eagle3``) to an OpenVINO IR draft model.

Run with the Python of the OpenVINO GenAI environment (openvino-genai, optimum-intel; README, section Peers):

    python ov_export_eagle3.py CHECKPOINT_DIR OUT_DIR

optimum-intel 2.2 exports EAGLE-3 drafts with its own ``LlamaEagle3ForCausalLM``; its command line reaches that class
only with ``--trust-remote-code``, whose import check of the class's module asks for diffusers and einops (and a
diffusers that does not import with transformers 5.5). So this script loads the class directly and calls
``export_from_model`` (telling it the library, which it cannot infer from a class that lives in optimum's own
module). The draft's feature taps are then written into the IR's ``rt_info["hidden_layers_list"]``: OpenVINO GenAI
reads the output of decoder layer ``i``, the checkpoint's ``eagle_aux_hidden_state_layer_ids`` (dyncompile's and
vLLM's count) the input of layer ``i``, so the list is ``dyncompile.openvino_layers`` from the checkpoint's config.
"""

import json
import os
import sys

import openvino as ov
import optimum.exporters.openvino.convert as convert
from optimum.exporters.openvino import export_from_model
from optimum.exporters.openvino.model_patcher import LlamaEagle3ForCausalLM
from transformers import AutoConfig

src, dst = sys.argv[1], sys.argv[2]
convert._infer_library_from_model_or_model_class = lambda *a, **k: "transformers"
model = LlamaEagle3ForCausalLM.from_pretrained(src, config=AutoConfig.from_pretrained(src))
export_from_model(model, dst, task="text-generation-with-past")

layers = json.load(open(os.path.join(src, "config.json")))["dyncompile"]["openvino_layers"]
m = ov.Core().read_model(os.path.join(dst, "openvino_model.xml"))
m.set_rt_info(layers, "hidden_layers_list")
ov.save_model(m, os.path.join(dst, "openvino_model.tmp.xml"), compress_to_fp16=False)
for ext in ("xml", "bin"):
    os.replace(os.path.join(dst, f"openvino_model.tmp.{ext}"), os.path.join(dst, f"openvino_model.{ext}"))
print(f"{dst}: EAGLE-3 draft IR, hidden_layers_list {layers}")
