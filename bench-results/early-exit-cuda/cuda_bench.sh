#!/usr/bin/env bash
# Run record: the early-exit benchmark on the CUDA EP that produced this folder's early_exit.{json,md,png}
# (a GPU machine without a package registry; Python 3.12, PyTorch cu130 provides the CUDA 13 libraries).
#
#   PARTS=DIR [DYNCOMPILE_HOME=DIR] [SITE=DIR] [OUT=DIR] bash bench-results/early-exit-cuda/cuda_bench.sh [ARGS]
#
# run from the repository root (the checkout is imported as `dyncompile` through a symlink under $SITE-pkg).
#   PARTS           folder with the carried pieces:
#                     ort.part0..4     onnxruntime_gpu-1.30.0-cp312 wheel split into <=58 MiB pieces (`split -b 58M`)
#                     minilm.part0..1  the built minilm-l6-sentiment model.onnx, plus its tokenizer.json and
#                                      dyncompile-model.json
#                     movie-*.jsonl    the sentiment splits; the onnx_ir-1.1.0 wheel
#   DYNCOMPILE_HOME model cache to build into (default: $HOME/.cache/dyncompile)
#   SITE            where the wheels are installed (default: $TMPDIR/site)
#   OUT             report folder (default: $TMPDIR/out); ARGS go to the study (dyncompile.tools.studies.early_exit)
set -euo pipefail
P=${PARTS:?set PARTS to the folder with the carried pieces}
DYNCOMPILE_HOME=${DYNCOMPILE_HOME:-$HOME/.cache/dyncompile}
SITE=${SITE:-${TMPDIR:-/tmp}/site}
cd "$P"
cat ort.part0 ort.part1 ort.part2 ort.part3 ort.part4 > onnxruntime_gpu-1.30.0-cp312-cp312-manylinux_2_28_x86_64.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" onnxruntime_gpu-*.whl onnx_ir-*.whl
M=$DYNCOMPILE_HOME/models/minilm-l6-sentiment
mkdir -p "$M" data
cat minilm.part0 minilm.part1 > "$M/model.onnx"
cp tokenizer.json dyncompile-model.json "$M/"
cp movie-calib.jsonl movie-test.jsonl data/
cd - >/dev/null
mkdir -p "$SITE-pkg" && ln -sfn "$PWD" "$SITE-pkg/dyncompile"
export PYTHONPATH="$SITE:$SITE-pkg" DYNCOMPILE_HOME PYTHONUNBUFFERED=1
python3 -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())"
python3 -m dyncompile.tools.studies.early_exit --models minilm-l6-sentiment --provider cuda \
    --data-dir "$P/data" --out "${OUT:-${TMPDIR:-/tmp}/out}/ee-cuda" "$@"
