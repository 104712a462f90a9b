#!/usr/bin/env bash
# Run record: Medusa heads for Qwen2.5-Coder-1.5B trained on one NVIDIA H200 on the EAGLE-3 heads' data (the whole
# CPython standard-library corpus minus the benchmark's files, plus the target's own greedy continuations), on a
# GPU machine without a package registry (Python 3.12, PyTorch cu130, transformers). Narrative: README.md here.
#
#   PARTS=DIR BUNDLE_SHA=... [SITE=DIR] [WORK=DIR] [OUT=DIR] bash bench-results/medusa/gpu_medusa_train.sh setup|train|wait|fetch
#
# run 2: the defaults (DISTILL=4096, shared frozen LM head, checkpoint picked on the corpus eval windows);
# run 3: NAME=run3 LM_HEADS=1 DISTILL=12288 DISTILL_EVAL=768 MAX_SECONDS=240 (Medusa-1's per-head LM heads, the
#        checkpoint picked on the target's own continuations of held-out prefixes). A first attempt ran NAME=run3-lm
#        LM_HEADS=1 beside NAME=run3-shared (the shared-head ablation) at MAX_SECONDS=420; both were stopped at ~4,000
#        steps when selection still followed the eval loss (README), and only run3 was started again
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
#   train   start a training in its own session (it outlives the call): heads in $WORK/$NAME, log in $WORK/$NAME.log
#   wait    wait up to $WAIT seconds (default 540) for the trainings, then copy each one's record and log to $OUT and
#           cut its heads into pieces under 16 MB
#   fetch   copy the pieces FILES (a glob) to $OUT
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
    N=${NAME:-heads}
    log "train $N"
    setsid nohup python3 -c "
import logging; logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s')
from dyncompile.tools.train_medusa import train_medusa
train_medusa('$W/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf', '$W/$N', heads=3,
             corpus='$W/stdlib-qwen-tokens.npy', device='cuda', steps=${STEPS:-20000}, batch=4096, seq_len=256,
             lr=${LR:-1e-3}, max_tokens=8_000_000, distill_sequences=${DISTILL:-4096}, eval_every=500,
             distill_eval=${DISTILL_EVAL:-0}, lm_heads=bool(${LM_HEADS:-0}), max_seconds=${MAX_SECONDS:-420})
" > "$W/$N.log" 2>&1 < /dev/null &
    sleep 20; tail -5 "$W/$N.log"
    ;;
wait)
    # wait for every training, then per head folder NAME: NAME.json and NAME.log to $OUT, and the npz in pieces
    # under 16 MB to $WORK/split/NAME.npz.partN (fetch brings them back)
    end=$(( $(date +%s) + ${WAIT:-540} ))
    while pgrep -f "[t]rain_medusa" > /dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 10; done
    mkdir -p "$W/split"
    for j in "$W"/*/medusa_heads.json; do
        [ -f "$j" ] || continue
        d=$(dirname "$j"); N=$(basename "$d")
        tail -8 "$W/$N.log"; cp "$W/$N.log" "$O/$N.log"; cp "$j" "$O/$N.json"
        rm -f "$W/split/$N.npz.part"*
        split -b 15000000 -d -a 2 "$d/medusa_heads.npz" "$W/split/$N.npz.part"
        sha256sum "$d/medusa_heads.npz"; ls "$W/split"
    done
    pgrep -f "[t]rain_medusa" > /dev/null && log "still training" || log "done"
    ;;
fetch)
    # FILES: a glob under $WORK/split (at most 8 files, 64 MB, a call)
    cp "$W"/split/${FILES:?set FILES} "$O/" && ls -la "$O"
    ;;
*) echo "usage: $0 setup|train|wait|fetch" >&2; exit 2 ;;
esac
