#!/usr/bin/env bash
# Real-GPU checks (warm children, pinning, the NVML probe), for a machine with NVIDIA
# GPUs, PyTorch and no network.
#
# Carry-ins, prepared on a machine with pip (see docs/performance.md, "Real GPU"):
#   .whl/  the wheels of celery, kombu, redis, pydantic, jsonschema and their needs
#          for the GPU machine's Python (pip download --python-version 3.12 ...)
#   .gpu/  redis-server and the shared libraries it needs (.gpu/lib)
# Writes into $OUT (default /tmp/ojs-real-gpu): nvidia-smi.txt, probe*.json,
# infer.json, retire.json, log.txt.
#
#     OUT=/tmp/out bash bench/real_gpu.sh [GPUS]
#     OUT=/tmp/out INFER_ONLY=1 bash bench/real_gpu.sh [GPUS]   # the inference bench only
set -u
OUT=${OUT:-/tmp/ojs-real-gpu}
GPUS=${1:-1}
PY=${PY:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ojs-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/ojs-site:$PWD
fi
if [ -x .gpu/redis-server ]; then
    mkdir -p /tmp/ojs-bin
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/.gpu/lib exec %s/.gpu/redis-server "$@"\n' \
        "$PWD" "$PWD" > /tmp/ojs-bin/redis-server
    chmod +x /tmp/ojs-bin/redis-server
    export PATH=/tmp/ojs-bin:$PATH
fi
export PYTHONUNBUFFERED=1
infer() {
    time $PY bench/inference.py --real --gpus "$GPUS" --burst 200 --sequential 40 \
        --variants "$1" --json > "$OUT/$2.json"
    cat "$OUT/$2.json"
}
if [ -n "${INFER_ONLY:-}" ]; then
    infer plugin-warm,plugin-noprefetch,baseline infer
    infer baseline,plugin-noprefetch,plugin-warm infer2
    exit 0
fi
nvidia-smi --query-gpu=index,name,memory.total,compute_cap,uuid,pci.bus_id,mig.mode.current \
    --format=csv | tee "$OUT/nvidia-smi.txt"
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.device_count())"
echo "== probe (all devices)"
$PY -m celery_ojs_ml probe --json | tee "$OUT/probe.json"
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
echo "== probe (CUDA_VISIBLE_DEVICES=$UUID)"
CUDA_VISIBLE_DEVICES=$UUID $PY -m celery_ojs_ml probe --json > "$OUT/probe_uuid.json"
$PY -c "import json,sys; d=json.load(open(sys.argv[1]))['capabilities']; print('gpu:', d.get('gpu'))" \
    "$OUT/probe_uuid.json"
echo "== probe (CUDA_VISIBLE_DEVICES=-1: no device)"
CUDA_VISIBLE_DEVICES=-1 $PY -m celery_ojs_ml probe --json > "$OUT/probe_none.json"
$PY -c "import json,sys; d=json.load(open(sys.argv[1]))['capabilities']; print('gpu:', d.get('gpu'))" \
    "$OUT/probe_none.json"
echo "== inference: the defaults (warm children, prefetch 2), prefetch off, one worker per GPU"
time $PY bench/inference.py --real --gpus "$GPUS" --burst 200 --sequential 40 \
    --variants plugin-warm,plugin-noprefetch,baseline > "$OUT/infer.txt"
cat "$OUT/infer.txt"
$PY bench/inference.py --real --gpus "$GPUS" --burst 200 --sequential 40 \
    --variants baseline,plugin-warm --json > "$OUT/infer.json"
cat "$OUT/infer.json"
echo "== inference: children retired after each CUDA task (the behaviour before)"
time $PY bench/inference.py --real --gpus "$GPUS" --burst 4 --sequential 3 \
    --variants plugin-retire --json > "$OUT/retire.json"
cat "$OUT/retire.json"
