#!/usr/bin/env bash
# Run record: Medusa heads for Qwen2.5-Coder-1.5B trained on one NVIDIA H200 on the EAGLE-3 heads' data (the whole
# CPython standard-library corpus minus the benchmark's files, plus the target's own greedy continuations), on a
# GPU machine without a package registry (Python 3.12, PyTorch cu130, transformers). Narrative: README.md here.
#
#   PARTS=DIR BUNDLE_SHA=... [SITE=DIR] [WORK=DIR] [OUT=DIR] bash bench-results/medusa/gpu_medusa_train.sh setup|train|wait
#
# run from the repository root. Carried into $PARTS as p00..p24 (47,000,000-byte pieces of one tar, sha256 in
# $BUNDLE_SHA), made on the CPU machine with
#   tar cf bundle.tar whl gguf stdlib-qwen-tokens.npy && split -b 47000000 -d -a 2 bundle.tar p
#   whl/    gguf-0.19.0 (transformers reads the GGUF with it)
#   gguf/   qwen2.5-coder-1.5b-instruct-q4_k_m.gguf (the model cache's source: the same weights, dequantised)
#   stdlib-qwen-tokens.npy   `load_corpus_tokens(None, tokenizer.json, max_tokens=50_000_000, eos=151645)` of the
#           CPython 3.11 standard library minus HELD_OUT, as int32 (7,754,858 tokens)
#
#   setup   reassemble, check the sha256, unpack, install the wheel
#   train   start the training in its own session (it outlives the call), log in $WORK/train.log
#   wait    wait up to $WAIT seconds (default 540) for it, then copy the heads (in pieces under 16 MB) and the log to $OUT
set -euo pipefail
P=${PARTS:?set PARTS to the folder with the carried pieces}
REPO=$PWD
O=${OUT:-${TMPDIR:-/tmp}/out}
SITE=${SITE:-${TMPDIR:-/tmp}/site}
W=${WORK:-${TMPDIR:-/tmp}/work}
mkdir -p "$O" "$W"
export PYTHONUNBUFFERED=1
mkdir -p "$SITE-pkg" && ln -sfn "$REPO" "$SITE-pkg/dyncompile"
export PYTHONPATH="$SITE:$SITE-pkg"
log() { echo "== $(date -u +%H:%M:%S) $*"; }

case "${1:-}" in
setup)
    log "reassemble"
    cat "$P"/p?? > "$W/bundle.tar"
    echo "${BUNDLE_SHA:?set BUNDLE_SHA}  $W/bundle.tar" | sha256sum -c -
    tar xf "$W/bundle.tar" -C "$W" && rm "$W/bundle.tar"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$W"/whl/*.whl
    python3 -c "import torch, transformers, gguf; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
    ;;
train)
    log "train"
    setsid nohup python3 -c "
import logging; logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s')
from dyncompile.tools.train_medusa import train_medusa
train_medusa('$W/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf', '$W/heads', heads=3,
             corpus='$W/stdlib-qwen-tokens.npy', device='cuda', steps=${STEPS:-20000}, batch=4096, seq_len=256,
             lr=${LR:-1e-3}, max_tokens=8_000_000, distill_sequences=${DISTILL:-4096}, eval_every=500,
             max_seconds=${MAX_SECONDS:-420})
" > "$W/train.log" 2>&1 < /dev/null &
    sleep 20; tail -5 "$W/train.log"
    ;;
wait)
    end=$(( $(date +%s) + ${WAIT:-540} ))
    while pgrep -f train_medusa > /dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
    tail -25 "$W/train.log"
    cp "$W/train.log" "$O/"
    if [ -f "$W/heads/medusa_heads.json" ]; then
        cp "$W/heads/medusa_heads.json" "$O/"
        split -b 15000000 -d -a 1 "$W/heads/medusa_heads.npz" "$O/medusa_heads.npz.part"
        sha256sum "$W/heads/medusa_heads.npz"
    fi
    pgrep -f train_medusa > /dev/null && log "still training" || log "done"
    ;;
*) echo "usage: $0 setup|train|wait" >&2; exit 2 ;;
esac
