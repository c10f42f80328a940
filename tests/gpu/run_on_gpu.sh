#!/usr/bin/env bash
# The GPU checks of one session, as one script for a lent GPU machine (about 10 minutes): the
# tests in tests/gpu, then the GPU benchmarks whose tables the docs leave open. Each step has its
# own time limit, so a slow one does not take the rest with it; logs and JSON go to $OUT (or
# ./gpu-out). The machine's own python3 holds torch; ddpkit runs from src/ without installing.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 DDPKIT_LOG_LEVEL=warning
STEPS=${STEPS:-tests trainer-gpt-small trainer-toy checkpoint dropout}  # a subset: STEPS="tests checkpoint"
step() {  # step NAME SECONDS COMMAND...: run COMMAND under a limit, its output to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    echo "=== $name (limit ${limit}s) $(date +%T)"
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name rc=$? $(date +%T)"
    tail -n 25 "$OUT/$name.log"
}
nvidia-smi -L
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
step tests 400 python3 -m pytest tests/gpu -n 0 -q -p no:cacheprovider --timeout 150 -rs
step trainer-gpt-small 100 python3 -m ddpkit bench trainer gpt --nproc 1 --precision bf16 --gpt small \
    --json "$OUT/trainer-gpt-small.json"
step trainer-toy 50 python3 -m ddpkit bench trainer toy --nproc 1 --json "$OUT/trainer-toy.json"
step checkpoint 170 python3 -m ddpkit bench checkpoint --nproc 1 --rounds 3 --json "$OUT/checkpoint.json"
step dropout 50 python3 -m ddpkit bench dropout --device cuda --rounds 10 --json "$OUT/dropout.json"
