#!/usr/bin/env bash
# Run record: MiniLM-L6 sentiment int4 (block 32) and int4 x early exit on the CUDA EP (the GPU machine reaches no
# registry). The plans were compiled on the CPU machine with --provider cuda:
#
#   dyncompile $M --provider cuda --passes "quantize-int4{block_size=32}" -o m-q4
#   dyncompile $M --provider cuda --passes "quantize-int4{block_size=32},early-exit" --calib $C --budget 1.0 -o m-q4-ee
#
# and carried with the original model (at the path the plans record, under $HOME/.cache/dyncompile/models), the
# movie-test rows and onnxruntime-gpu 1.31.1 as one tar in 50,000,000-byte pieces c00..c09 (sha256 in $BUNDLE_SHA).
#
#   PARTS=DIR BUNDLE_SHA=... [SITE=DIR] [WORK=DIR] [OUT=DIR] bash bench-results/quantized-cuda/cuda_int4_bench.sh
set -euo pipefail
P=${PARTS:?set PARTS to the folder with the carried pieces}
REPO=$PWD
O=${OUT:-${TMPDIR:-/tmp}/out}
SITE=${SITE:-${TMPDIR:-/tmp}/site}
W=${WORK:-${TMPDIR:-/tmp}/work}
mkdir -p "$O" "$W/b" "$SITE-pkg"
cat "$P"/c?? > "$W/cq.tar"
echo "${BUNDLE_SHA:?set BUNDLE_SHA}  $W/cq.tar" | sha256sum -c
tar xf "$W/cq.tar" -C "$W/b" && rm "$W/cq.tar"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$W"/b/whl/*.whl
mkdir -p "$HOME/.cache/dyncompile/models" && cp -r "$W/b/model/minilm-l6-sentiment" "$HOME/.cache/dyncompile/models/"
ln -sfn "$REPO" "$SITE-pkg/dyncompile"
export PYTHONPATH="$SITE:$SITE-pkg" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for p in m-q4 m-q4-ee; do
  python3 -m dyncompile.tools.cli bench classify "$W/b/plans/$p" --data "$W/b/data/movie-test.jsonl" --provider cuda \
      --batch1-rows 500 --report-dir "$O"
done
