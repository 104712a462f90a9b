#!/usr/bin/env bash
# Run record: does the CUDA EP's -O2 decoder preset (explicit-attention, fuse-decoder, pack-matmuls, trim-logits)
# also pay on SmolLM2-135M, the model on which an earlier run (at 2 intra-op threads) saw the fused graph lose?
# Prompt lookup, the fused plan (the default) against the unfused one (-O0), interleaved in one process, at ORT's
# default thread count and at 2 threads. GPU machine without a registry; carried as one tar in 50,000,000-byte
# pieces s00..s07 (sha256 in $BUNDLE_SHA): onnxruntime-gpu 1.31.1, onnx_ir 1.1.0, gguf 0.19.0; the recipe's
# SmolLM2-135M folder without its weights plus onnx-data-map.json (`restore_decoder_data --make-map`); the GGUF the
# recipe dequantises (the fp32 weights are rebuilt there, sha256-checked).
#
#   PARTS=DIR BUNDLE_SHA=... [SITE=DIR] [WORK=DIR] [OUT=DIR] bash bench-results/speculative-cuda/cuda_preset_check.sh
set -euo pipefail
P=${PARTS:?set PARTS to the folder with the carried pieces}
REPO=$PWD
O=${OUT:-${TMPDIR:-/tmp}/out}
SITE=${SITE:-${TMPDIR:-/tmp}/site}
W=${WORK:-${TMPDIR:-/tmp}/work}
mkdir -p "$O" "$W/b" "$SITE-pkg"
export DYNCOMPILE_HOME=${DYNCOMPILE_HOME:-$HOME/.cache/dyncompile} PYTHONUNBUFFERED=1
M=$DYNCOMPILE_HOME/models/smollm2-135m
cat "$P"/s?? > "$W/smol.tar"
echo "${BUNDLE_SHA:?set BUNDLE_SHA}  $W/smol.tar" | sha256sum -c
tar xf "$W/smol.tar" -C "$W/b" && rm "$W/smol.tar"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$W"/b/whl/*.whl
ln -sfn "$REPO" "$SITE-pkg/dyncompile"
export PYTHONPATH="$SITE:$SITE-pkg"
mkdir -p "$M" && cp -r "$W/b/m/smollm2-135m/." "$M/"
python3 -m dyncompile.tools.studies.restore_decoder_data --restore "$M" --map "$W/b/onnx-data-map.json" \
    --gguf "$W/b/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
DC="python3 -m dyncompile.tools.cli"
$DC "$M/model.onnx" -o "$W/smol-pl" -q --provider cuda --drafter prompt-lookup --passes speculative
$DC "$M/model.onnx" -o "$W/smol-pl-O0" -q --provider cuda -O0 --drafter prompt-lookup --passes speculative
for t in default 2; do
  $DC bench generate "$W/smol-pl" --also "$W/smol-pl-O0" --prompts bench-results/speculative-smollm2/all.jsonl --limit 8 \
      --max-new-tokens 128 --provider cuda $([ "$t" = 2 ] && echo --threads 2) -q --report-dir "$O" \
      --name "smollm2-preset-cuda-threads-$t"
done
