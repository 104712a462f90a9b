#!/usr/bin/env bash
# Speculative-decoding benchmark on the CUDA EP (borrowed GPU machine: no registry, Python 3.12, PyTorch cu130
# provides the CUDA 13 libraries). Carried in earlier calls into /root/parts (README "CUDA EP"):
#   ort.part0..4        onnxruntime_gpu-1.30.0-cp312 wheel split with `split -b 58M`; onnx_ir-1.1.0 wheel
#   part.aa..ae         SmolLM2-135M's model.onnx.data (fp32, 538 MB), `zstd -12` then `split -b 58M`
#   model.onnx, tokenizer.json, dyncompile-model.json of smollm2-135m; the zstandard wheel (decompression)
set -euo pipefail
P=/root/parts
REPO=$PWD
cd "$P"
cat ort.part0 ort.part1 ort.part2 ort.part3 ort.part4 > onnxruntime_gpu-1.30.0-cp312-cp312-manylinux_2_28_x86_64.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site onnxruntime_gpu-*.whl onnx_ir-*.whl zstandard-*.whl
export PYTHONPATH=/tmp/site
M=/root/dc/models/smollm2-135m
mkdir -p "$M"
cp model.onnx tokenizer.json dyncompile-model.json "$M/"
cat part.aa part.ab part.ac part.ad part.ae | python3 -c \
  "import sys, zstandard; zstandard.ZstdDecompressor().copy_stream(sys.stdin.buffer, sys.stdout.buffer)" > "$M/model.onnx.data"
python3 - "$M" <<'PY'
import hashlib, json, sys, pathlib
m = pathlib.Path(sys.argv[1]); cfg = json.loads((m / "dyncompile-model.json").read_text())
size = (m / "model.onnx.data").stat().st_size
assert size == cfg["files"]["model.onnx.data"], (size, cfg["files"]["model.onnx.data"])
print("model.onnx.data restored:", size, "bytes")
PY
cd "$REPO"
mkdir -p /tmp/pkg && ln -sfn "$REPO" /tmp/pkg/dyncompile
export PYTHONPATH=/tmp/site:/tmp/pkg DYNCOMPILE_HOME=/root/dc PYTHONUNBUFFERED=1
python3 -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())"
O=${OUT:-/tmp/out}
python3 -m dyncompile.tools.cli "$M/model.onnx" --passes speculative --drafter prompt-lookup -o /root/pl -q
python3 -m dyncompile.tools.cli bench /root/pl --prompts bench-results/speculative-smollm2/all.jsonl \
  --provider cuda --io-binding --report-dir "$O" --name smollm2-prompt-lookup-cuda "$@"
