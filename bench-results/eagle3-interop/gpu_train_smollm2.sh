#!/usr/bin/env bash
# Run record: the SmolLM2-135M EAGLE-3 head in the reference layout, trained on one GPU of the device machine
# (Python 3.12, PyTorch, transformers; no package registry). Narrative: README.md here.
#
#   bash bench-results/eagle3-interop/gpu_train_smollm2.sh store     # once per carried piece (.gpu/pN)
#   bash bench-results/eagle3-interop/gpu_train_smollm2.sh train     # with the last piece: reassemble, train, pack
#
# Carried (in .gpu/, ignored by git), made on the CPU machine from the GGUF the model cache's SmolLM2 was built from:
#   split -b 33000000 -d -a 1 SmolLM2-135M-Instruct.Q4_1.gguf p; sha256sum > sha
#   tokenizer.json (the model cache's), whl/gguf-0.19.0-py3-none-any.whl (transformers reads the GGUF with it)
# The corpus is that machine's CPython standard library minus HELD_OUT (train_drafter's default).
set -euo pipefail
REPO=$PWD
W=${WORK:-${TMPDIR:-/tmp}/e3w}
O=${OUT:-${TMPDIR:-/tmp}/out}
mkdir -p "$W" "$O"
log() { echo "== $(date -u +%H:%M:%S) $*"; }
case "${1:-}" in
store)
    cp .gpu/p? "$W/" && ls -la "$W"
    ;;
train)
    cp .gpu/p? .gpu/tokenizer.json "$W/"
    mkdir -p "$W/smol"
    cat "$W"/p0 "$W"/p1 "$W"/p2 > "$W/smol/SmolLM2-135M-Instruct.Q4_1.gguf"
    echo "$(cat .gpu/sha)  $W/smol/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
    cp "$W/tokenizer.json" "$W/smol/"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$W/site" .gpu/whl/*.whl
    mkdir -p "$W/pkg" && ln -sfn "$REPO" "$W/pkg/dyncompile"
    export PYTHONPATH="$W/site:$W/pkg" PYTHONUNBUFFERED=1
    log "train"
    python3 -c "
import logging; logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s')
from dyncompile.tools.train_drafter import train_drafter
info = train_drafter('$W/smol/SmolLM2-135M-Instruct.Q4_1.gguf', '$W/head', device='cuda', features='fused',
                     layout='reference', ttt_steps=3, distill_sequences=${DISTILL:-2048}, steps=${STEPS:-4000},
                     batch=${BATCH:-64}, seq_len=256, lr=${LR:-3e-4}, max_tokens=8_000_000, draft_vocab=8192,
                     eval_every=500, max_seconds=${MAX_SECONDS:-380}, progress=False)
print(info['eval'], info['training']['steps'], info['training']['seconds'])
" 2>&1 | grep -v "Loading weights" | tee "$O/train.log"
    cp "$W/head/eagle_head.json" "$O/"
    split -b 15000000 -d -a 1 "$W/head/eagle_head.npz" "$O/eagle_head.npz.part"
    sha256sum "$W/head/eagle_head.npz" | tee "$O/npz.sha"
    ls -la "$O"
    ;;
*) echo "usage: $0 store|train" >&2; exit 2 ;;
esac
