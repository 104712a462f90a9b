#!/usr/bin/env bash
# Run record: the speculative-decoding benchmark on the CUDA EP that produced this folder's
# smollm2-prompt-lookup-cuda-all.{json,md} (a GPU machine without a package registry; Python 3.12, PyTorch cu130
# provides the CUDA 13 libraries).
#
#   PARTS=DIR [DYNCOMPILE_HOME=DIR] [SITE=DIR] [WORK=DIR] [OUT=DIR] bash bench-results/speculative-cuda/cuda_spec_bench.sh [ARGS]
#
# run from the repository root.
#   PARTS           folder with the carried pieces:
#                     ort.part0..4  onnxruntime_gpu-1.30.0-cp312 wheel split with `split -b 58M`; the onnx_ir-1.1.0 wheel
#                     part.aa..ae   SmolLM2-135M's model.onnx.data (fp32, 538 MB), `zstd -12` then `split -b 58M`
#                     model.onnx, tokenizer.json, dyncompile-model.json of smollm2-135m; the zstandard wheel
#   DYNCOMPILE_HOME model cache (default: $HOME/.cache/dyncompile)
#   SITE            where the wheels are installed (default: $TMPDIR/site)
#   WORK            where the compiled plan goes (default: $TMPDIR/work)
#   OUT             report folder (default: $TMPDIR/out); ARGS go to `dyncompile bench generate`
set -euo pipefail
P=${PARTS:?set PARTS to the folder with the carried pieces}
DYNCOMPILE_HOME=${DYNCOMPILE_HOME:-$HOME/.cache/dyncompile}
SITE=${SITE:-${TMPDIR:-/tmp}/site}
W=${WORK:-${TMPDIR:-/tmp}/work}
REPO=$PWD
cd "$P"
cat ort.part0 ort.part1 ort.part2 ort.part3 ort.part4 > onnxruntime_gpu-1.30.0-cp312-cp312-manylinux_2_28_x86_64.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" onnxruntime_gpu-*.whl onnx_ir-*.whl zstandard-*.whl
export PYTHONPATH="$SITE"
M=$DYNCOMPILE_HOME/models/smollm2-135m
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
mkdir -p "$SITE-pkg" "$W" && ln -sfn "$REPO" "$SITE-pkg/dyncompile"
export PYTHONPATH="$SITE:$SITE-pkg" DYNCOMPILE_HOME PYTHONUNBUFFERED=1
python3 -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())"
O=${OUT:-${TMPDIR:-/tmp}/out}
python3 -m dyncompile.tools.cli "$M/model.onnx" --passes speculative --drafter prompt-lookup -o "$W/pl" -q
python3 -m dyncompile.tools.cli bench generate "$W/pl" --prompts bench-results/speculative-smollm2/all.jsonl \
  --provider cuda --io-binding --report-dir "$O" --name smollm2-prompt-lookup-cuda "$@"
