#!/usr/bin/env bash
# Run record: lookahead decoding on Qwen2.5-Coder-0.5B (CPU EP) with 2, 4, 8 and 16 intra-op threads on one host
# with 16 cores — the measurement behind "how many cores lookahead needs" (bench-results/lookahead/README.md).
# This VM has 2 cores; the host with more is the GPU machine, which reaches no package registry, so the model
# travels as its GGUF (the recipe's source) and its fp32 weights are rebuilt there byte for byte.
#
#   PARTS=DIR BUNDLE_SHA=... [DYNCOMPILE_HOME=DIR] [SITE=DIR] [WORK=DIR] [OUT=DIR] [THREADS="2 4 8 16"] [LIMIT=4] \
#     bash bench-results/lookahead/cpu_cores_bench.sh setup|bench
#
# run from the repository root. Carried into $PARTS as p00, p01, ... (pieces of one tar, sha256 in $BUNDLE_SHA):
#   whl/    onnx_ir-1.1.0, gguf-0.19.0 (the rest is in that machine's Python: onnxruntime, onnxscript, torch,
#           transformers)
#   gguf/   qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
#   m/      the recipe's qwen2.5-coder-0.5b folder without its weights; onnx-data-map.json beside whl/
#           (`python -m dyncompile.tools.studies.restore_decoder_data --make-map`)
#
#   setup   reassemble, install, restore the fp32 weights (sha256-checked), compile the lookahead plan (~3 min)
#   bench   for each thread count: the verification cost curve v(s) (512 tokens of past) and `bench generate`
#           (target alone vs lookahead, interleaved by prompt, greedy, 128 new tokens); one tar in $OUT
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
PROMPTS=bench-results/speculative-qwen/code.jsonl
log() { echo "== $(date -u +%H:%M:%S) $*"; }

case "${1:-}" in
setup)
  log reassemble
  cat "$P"/p?? > "$W/bundle.tar"
  echo "${BUNDLE_SHA:?set BUNDLE_SHA}  $W/bundle.tar" | sha256sum -c
  mkdir -p "$W/b" && tar xf "$W/bundle.tar" -C "$W/b" && rm "$W/bundle.tar"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$W"/b/whl/*.whl
  python3 -c "import onnxruntime as o, onnx_ir; print('onnxruntime', o.__version__, 'onnx_ir', onnx_ir.__version__)"
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|L3" || true
  mkdir -p "$M"
  cp -r "$W/b/m/qwen2.5-coder-0.5b/." "$M/"
  log "restore the fp32 weights from the GGUF (byte-checked)"
  python3 -m dyncompile.tools.studies.restore_decoder_data --restore "$M" --map "$W/b/onnx-data-map.json" \
      --gguf "$W"/b/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
  rm -rf "$W/b/gguf"
  log "plan: lookahead (window 5, n-gram 4, 5 guesses), as on the 2-core VM"
  $DC "$M/model.onnx" -o "$W/la" -q --passes "explicit-attention,speculative" --drafter lookahead
  log setup done
  ;;
bench)
  R="$W/reports" && mkdir -p "$R"
  for t in ${THREADS:-2 4 8 16}; do
    log "threads $t: verification cost curve"
    python3 -m dyncompile.tools.bench.generate curve "$M/model.onnx" --sizes 1,2,4,8,12,16,18,24,32 --past 512 \
        --threads "$t" --report-dir "$R" --name "qwen05-verify-curve-cpu-t$t"
    log "threads $t: target alone vs lookahead"
    $DC bench generate "$W/la" --prompts "$PROMPTS" --limit "${LIMIT:-4}" --max-new-tokens 128 --threads "$t" \
        --report-dir "$R" --name "qwen05-lookahead-cpu-t$t" -q
    grep -E "^\| (target|speculative)" "$R/qwen05-lookahead-cpu-t$t.md" || true
  done
  tar cf "$O/reports.tar" -C "$R" .
  log bench done
  ;;
*)
  echo "usage: $0 setup|bench" >&2
  exit 2
  ;;
esac
