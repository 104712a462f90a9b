#!/usr/bin/env bash
# Run record: EAGLE-3 heads trained on one GPU of the device machine (Python 3.12, PyTorch, transformers; no
# package registry there). Narrative: README.md here.
#
#   MODEL=qwen05 bash bench-results/eagle3-interop/gpu_train.sh store           # once per carried piece (.gpu/pNN)
#   MODEL=qwen05 LAYOUT=fc bash bench-results/eagle3-interop/gpu_train.sh train # reassemble, train, pack
#   bash bench-results/eagle3-interop/gpu_train.sh send FILE...                 # more of the packed parts to $OUT
#
# Carried (in .gpu/, ignored by git), made on the CPU machine from the GGUF the model cache was built from:
#   split -b 47000000 -d -a 2 MODEL.gguf p; sha256sum MODEL.gguf | cut -d' ' -f1 > sha
#   tokenizer.json.xz (the model cache's), whl/gguf-0.19.0-py3-none-any.whl (transformers reads the GGUF with it)
# The corpus is that machine's CPython standard library minus HELD_OUT (train_drafter's default). A head comes back
# in parts of 15.9 MB (at most 64 MB per call comes back, so `send` fetches the rest on the warm machine).
set -euo pipefail
REPO=$PWD
W=${WORK:-${TMPDIR:-/tmp}/e3w}
O=${OUT:-${TMPDIR:-/tmp}/out}
MODEL=${MODEL:-smollm2}
case "$MODEL" in
smollm2) GGUF=SmolLM2-135M-Instruct.Q4_1.gguf TTT=3 BATCH=${BATCH:-64} STEPS=${STEPS:-4000} DISTILL=${DISTILL:-2048} ;;
qwen05) GGUF=qwen2.5-coder-0.5b-instruct-q4_k_m.gguf TTT=4 BATCH=${BATCH:-32} STEPS=${STEPS:-2400} DISTILL=${DISTILL:-4096} ;;
*) echo "MODEL is smollm2 or qwen05" >&2; exit 2 ;;
esac
LAYOUT=${LAYOUT:-reference}
NAME=${NAME:-$LAYOUT}  # another name for a continued run (INIT=path of the head it continues)
mkdir -p "$W" "$O"
log() { echo "== $(date -u +%H:%M:%S) $*"; }
gather() { for f in .gpu/p*; do [ -e "$f" ] || continue; [ -e "$W/$(basename "$f")" ] || cp "$f" "$W/"; done; }
case "${1:-}" in
store)
    gather
    ls -la "$W"
    ;;
train)
    mkdir -p "$W/model"
    if [ ! -e "$W/model/$GGUF" ]; then
        gather
        cat "$W"/p* > "$W/model/$GGUF"
        echo "$(cat .gpu/sha)  $W/model/$GGUF" | sha256sum -c -
        rm -f "$W"/p*
        xz -dc .gpu/tokenizer.json.xz > "$W/model/tokenizer.json"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$W/site" .gpu/whl/*.whl
        mkdir -p "$W/pkg" && ln -sfn "$REPO" "$W/pkg/dyncompile"
    fi
    export PYTHONPATH="$W/site:$W/pkg" PYTHONUNBUFFERED=1
    H="$W/head-$NAME"
    log "train $MODEL $LAYOUT $NAME"
    python3 -c "
import logging; logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s')
from dyncompile.tools.train_drafter import train_drafter
info = train_drafter('$W/model/$GGUF', '$H', device='cuda', features='fused', layout='$LAYOUT', ttt_steps=$TTT,
                     distill_sequences=$DISTILL, steps=$STEPS, batch=$BATCH, seq_len=256, lr=${LR:-3e-4},
                     max_tokens=${MAX_TOKENS:-50_000_000}, draft_vocab=8192, eval_every=${EVAL_EVERY:-250},
                     max_seconds=${MAX_SECONDS:-450}, init=('${INIT:-}' or None), progress=False)
print(info['eval'], info['training']['steps'], info['training']['seconds'])
" 2>&1 | grep -v "Loading weights" | tee "$O/train-$NAME.log"
    cp "$H/eagle_head.json" "$O/$NAME.json"
    (cd "$H" && split -b 15900000 -d -a 1 eagle_head.npz "$W/$NAME.npz.part" && sha256sum eagle_head.npz) \
        | tee "$O/$NAME.npz.sha"
    for f in $(ls "$W/$NAME".npz.part* | head -n "${RETURN_PARTS:-3}"); do cp "$f" "$O/"; done
    ls -la "$O" "$W"
    ;;
send)
    shift; for f in "$@"; do cp "$W/$f" "$O/"; done; ls -la "$O"
    ;;
*) echo "usage: $0 store|train|send FILE..." >&2; exit 2 ;;
esac
