#!/usr/bin/env bash
# Run record: Qwen2.5-Coder-0.5B on the CUDA EP as a float16 graph whose attention ONNX Runtime's CUDA
# GroupQueryAttention runs (`causal-attention,float16`: no attention_bias, float16 weights, activations and KV cache,
# the cache in one device buffer per tensor bound as past and present), against the float32 fused graph (whose GQA
# runs on the CPU EP), the unfused export, and onnxruntime-genai's float16 CUDA model of the same weights, in one run
# each; the EAGLE-3 head on the float16 target. GPU machine without a package registry (Python 3.12, PyTorch cu130
# provides the CUDA 13 libraries and the HF export of the restored weights). Narrative: README.md beside this file.
#
#   PARTS=DIR BUNDLE_SHA=... [DYNCOMPILE_HOME=DIR] [SITE=DIR] [WORK=DIR] [OUT=DIR] \
#     bash bench-results/speculative-cuda/cuda_fp16_bench.sh setup|check|target|peers|graph-check|graph|graph-peers|graph-peers-oggraph
#
# run from the repository root. Carried into $PARTS as p00..p17 (50,000,000-byte pieces of one tar, sha256 in
# $BUNDLE_SHA):
#   whl/    onnxruntime_gpu-1.31.1 (CUDA 13), onnxruntime_genai_cuda-0.18.0, onnx_ir-1.1.0, onnxscript-0.7.2, gguf-0.19.0
#   gguf/   qwen2.5-coder-0.5b-instruct-q4_k_m.gguf (the recipe's source)
#   m/      the recipe's qwen2.5-coder-0.5b folder without its weights; onnx-data-map.json beside whl/
#           (`restore_decoder_data --make-map`): the fp32 weights are rebuilt there from the GGUF, sha256-checked
#   heads/  qwen05-eagle3 (`dyncompile train-drafter`, bench-results/eagle3/README.md)
#
#   setup   reassemble, install, restore the model, compile the plans, build onnxruntime-genai's fp16 CUDA model
#           (GRAPH_ONLY=1: only the two float16 plans; with WITH_PEER=1 also onnxruntime-genai's model)
#   check   where ORT places the float16 graph's nodes; greedy tokens on the CUDA EP (shared buffer, concat) vs fp32
#   target  bench generate: float16 plan --also the float32 fused plan (UNFUSED=1: then --also the unfused plan)
#   peers   bench peers: the float16 plan against onnxruntime-genai's float16 CUDA model, 16 threads, one run
#   graph-check  tokens and rate of the plan without trim-logits, with and without CUDA graphs (cuda_graph=True)
#   graph   bench generate: that plan plain and with --cuda-graph, --also the trim-logits plan
#   graph-peers  bench peers: that plan with --cuda-graph against onnxruntime-genai's fp16 CUDA model, 16 threads
#   graph-peers-oggraph  the same against that model with onnxruntime-genai's own CUDA graphs (enable_cuda_graph)
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
FUSED="explicit-attention,fuse-decoder,pack-matmuls,trim-logits"
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
  log "plans: float16 causal (shared device buffer), the same without trim-logits (CUDA graphs)"
  $DC "$M/model.onnx" -o "$W/e3-half" -q --provider cuda -O0 \
      --passes "eagle-drafter{head=$H},$FUSED,causal-attention,float16,speculative"
  $DC "$M/model.onnx" -o "$W/e3-half-nt" -q --provider cuda -O0 \
      --passes "eagle-drafter{head=$H},explicit-attention,fuse-decoder,pack-matmuls,causal-attention,float16,speculative"
  if [ -z "${GRAPH_ONLY:-}" ]; then
    log "plans: float32 fused, unfused"
    $DC "$M/model.onnx" -o "$W/e3-fused" -q --provider cuda -O0 --passes "eagle-drafter{head=$H},$FUSED,speculative"
    $DC "$M/model.onnx" -o "$W/e3-plain" -q --provider cuda -O0 --passes "eagle-drafter{head=$H},explicit-attention,speculative"
  fi
  if [ -z "${GRAPH_ONLY:-}" ] || [ -n "${WITH_PEER:-}" ]; then
    log "onnxruntime-genai builder, fp16, CUDA"
    python3 -m onnxruntime_genai.models.builder -i "$W/hf-q05" -o "$W/og-q05-fp16" -p fp16 -e cuda -c "$W/cache-og" \
        > "$O/builder-q05-fp16.log" 2>&1 || { tail -20 "$O/builder-q05-fp16.log"; exit 1; }
    rm -rf "$W/cache-og"
  fi
  du -sh "$W"/e3-* "$W"/og-* 2>/dev/null || true
  log setup done
  ;;
check)
  python3 - "$W/e3-half" "$W/e3-fused" <<'PY'
import logging, subprocess, sys, time
import onnxruntime as ort
import dyncompile
half, fused = sys.argv[1:3]
# node placement of the float16 graph (ORT's verbose session log lists the nodes of every provider but the first)
code = ("import onnxruntime as o; so = o.SessionOptions(); so.log_severity_level = 0; "
        f"o.InferenceSession('{half}/model.onnx', so, providers=['CUDAExecutionProvider', 'CPUExecutionProvider'])")
log = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stderr.splitlines()
for line in log:
    if "placed on" in line or "Provider: [" in line or "MemcpyToHost" in line:
        print("ORT:", line[-300:])
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
prompt = "def quicksort(items):\n    "
runs = {}
m16, m32 = dyncompile.load(half, provider="cuda"), dyncompile.load(fused, provider="cuda")
for name, m, opts in (("fp16 shared", m16, {}), ("fp16 concat", m16, {"kv_buffer": "concat"}),
                      ("fp32 fused", m32, {}), ("fp16 eagle3", m16, {"speculative": True})):
    opts = {"speculative": False, **opts}
    m.generate(prompt, max_new_tokens=8, **opts)
    t = time.perf_counter()
    r = m.generate(prompt, max_new_tokens=64, **opts)
    runs[name] = r.token_ids
    print(f"{name}: {64 / (time.perf_counter() - t):.1f} tok/s", r.token_ids[:12])
print("identical to fp16 shared:", {k: v == runs["fp16 shared"] for k, v in runs.items()})
PY
  ;;
graph-check)
  python3 - "$W/e3-half-nt" <<'PY'
import logging, sys, time
import dyncompile
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
plan = sys.argv[1]
prompt = "def quicksort(items):\n    "
plain, graphed = dyncompile.load(plan, provider="cuda"), dyncompile.load(plan, provider="cuda", cuda_graph=True)
runs = {}
for name, m, spec in (("plain", plain, False), ("graph", graphed, False), ("graph eagle3", graphed, True)):
    m.generate(prompt, max_new_tokens=8, speculative=spec)
    t = time.perf_counter()
    r = m.generate(prompt, max_new_tokens=128, speculative=spec)
    runs[name] = r.token_ids
    print(f"{name}: {128 / (time.perf_counter() - t):.1f} tok/s, graph steps {m.handlers[-1].target.graph_steps}",
          r.token_ids[:10])
print("identical to plain:", {k: v == runs["plain"] for k, v in runs.items()})
PY
  ;;
graph-peers-oggraph)
  log "onnxruntime-genai's fp16 CUDA model with its own CUDA graphs: genai_config.json's cuda provider option"
  rm -rf "$W/og-q05-fp16-graph" && cp -r "$W/og-q05-fp16" "$W/og-q05-fp16-graph"
  python3 - "$W/og-q05-fp16-graph/genai_config.json" <<'PY'
import json, sys
path = sys.argv[1]
cfg = json.load(open(path))
opts = cfg["model"]["decoder"]["session_options"]["provider_options"]
for entry in opts:
    if "cuda" in entry:
        entry["cuda"]["enable_cuda_graph"] = "1"
print("provider_options:", opts, "search:", cfg["search"])
json.dump(cfg, open(path, "w"), indent=4)
PY
  log "bench peers: the float16 plan without trim-logits with CUDA graphs against it"
  $DC bench peers "$W/e3-half-nt" --prompts "$PROMPTS" --max-new-tokens 128 --peers ortgenai --cuda-graph \
      --peer-python "ortgenai=$(command -v python3)" --peer-model "ortgenai=$W/og-q05-fp16-graph" \
      --provider cuda --threads 16 -q --report-dir "$O" --name "qwen05-fp16-cuda-graph-og-fp16-graph-t16-peers"
  log graph-peers-oggraph done
  ;;
graph-peers)
  log "bench peers: the float16 plan without trim-logits with CUDA graphs against onnxruntime-genai's fp16 CUDA model"
  $DC bench peers "$W/e3-half-nt" --prompts "$PROMPTS" --max-new-tokens 128 --peers ortgenai --cuda-graph \
      --peer-python "ortgenai=$(command -v python3)" --peer-model "ortgenai=$W/og-q05-fp16" \
      --provider cuda --threads 16 -q --report-dir "$O" --name "qwen05-fp16-cuda-graph-og-fp16-t16-peers"
  log graph-peers done
  ;;
graph)
  log "bench generate: the float16 plan without trim-logits, plain and with CUDA graphs, --also the trim-logits plan"
  $DC bench generate "$W/e3-half-nt" --cuda-graph --also "$W/e3-half" --prompts "$PROMPTS" --max-new-tokens 128 \
      --provider cuda -q --report-dir "$O" --name qwen05-fp16-cuda-graph
  log graph done
  ;;
target)
  log "bench generate: float16 plan --also the float32 fused plan, EAGLE-3 chains, code prompts"
  $DC bench generate "$W/e3-half" --also "$W/e3-fused" --prompts "$PROMPTS" --max-new-tokens 128 \
      --provider cuda -q --report-dir "$O" --name qwen05-fp16-cuda
  if [ -n "${UNFUSED:-}" ]; then
    log "bench generate: float16 plan --also the unfused plan"
    $DC bench generate "$W/e3-half" --also "$W/e3-plain" --prompts "$PROMPTS" --max-new-tokens 128 \
        --provider cuda -q --report-dir "$O" --name qwen05-fp16-vs-unfused-cuda
  fi
  log target done
  ;;
peers)
  T=${THREADS:-16}
  log "bench peers: the float16 plan against onnxruntime-genai's float16 CUDA model, $T threads, one run"
  $DC bench peers "$W/e3-half" --prompts "$PROMPTS" --max-new-tokens 128 --peers ortgenai \
      --peer-python "ortgenai=$(command -v python3)" --peer-model "ortgenai=$W/og-q05-fp16" \
      --provider cuda --threads "$T" -q --report-dir "$O" --name "qwen05-fp16-cuda-og-fp16-t$T-peers"
  log peers done
  ;;
*)
  echo "usage: $0 setup|check|target|peers|graph-check|graph|graph-peers|graph-peers-oggraph" >&2
  exit 2
  ;;
esac
