#!/usr/bin/env bash
# CUDA-EP benchmark on the borrowed GPU machine (no registry there; Python 3.12, PyTorch cu130 provides CUDA 13).
# The parts were carried in earlier calls into /root/parts (see README "CUDA EP"):
#   ort.part0..4      = onnxruntime_gpu-1.30.0-cp312 wheel split into <=58 MiB pieces (`split -b 58M`)
#   minilm.part0..1   = the built minilm-l6-sentiment model.onnx, plus its tokenizer.json / dyncompile-model.json
#   movie-*.jsonl     = the sentiment splits; onnx_ir-1.1.0 wheel
set -euo pipefail
P=/root/parts
cd "$P"
cat ort.part0 ort.part1 ort.part2 ort.part3 ort.part4 > onnxruntime_gpu-1.30.0-cp312-cp312-manylinux_2_28_x86_64.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site onnxruntime_gpu-*.whl onnx_ir-*.whl
M=/root/dc/models/minilm-l6-sentiment
mkdir -p "$M" data
cat minilm.part0 minilm.part1 > "$M/model.onnx"
cp tokenizer.json dyncompile-model.json "$M/"
cp movie-calib.jsonl movie-test.jsonl data/
cd - >/dev/null
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/dyncompile
export PYTHONPATH=/tmp/site:/tmp/pkg DYNCOMPILE_HOME=/root/dc PYTHONUNBUFFERED=1
python3 -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())"
python3 -m dyncompile.tools.studies.early_exit --models minilm-l6-sentiment --provider cuda \
    --data-dir "$P/data" --out "${OUT:-/tmp/out}/ee-cuda" "$@"
