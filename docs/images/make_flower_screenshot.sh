#!/usr/bin/env bash
# Screenshots of Flower with a real worker running ML jobs (docs/operations.md, "Flower"):
#   docs/images/flower-worker.png  the worker page, tab "Other": the ojs_ml.* rows
#   docs/images/flower-task.png    a job's task page: its band and devices
# Needs redis-server, headless Chromium (Debian: apt-get install chromium) and the
# project's venv. Run from anywhere: bash docs/images/make_flower_screenshot.sh
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PY=${PYTHON:-$ROOT/.venv/bin/python}
CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser)}
OUT=$ROOT/docs/images
WORK=$(mktemp -d)
PIDS=()
cleanup() {  # the worker's cold shutdown (SIGQUIT) does not wait for its jobs
    kill -QUIT "${PIDS[@]}" 2>/dev/null || true
    for _ in $(seq 20); do
        kill -0 "${PIDS[@]}" 2>/dev/null || break
        sleep 0.5
    done
    kill -KILL "${PIDS[@]}" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
REDIS_PORT=$(free_port)
FLOWER_PORT=$(free_port)
WORKER=gpu1@node
export OJS_TEST_BROKER=redis://127.0.0.1:$REDIS_PORT/0 PYTHONPATH=$ROOT FLOWER_UNAUTHENTICATED_API=true
export OJS_TEST_RECYCLE=warm  # the default: warm children (the test app retires them)

redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no >"$WORK/redis.log" 2>&1 &
PIDS+=($!) && disown
# The Flower config docs/operations.md gives (task page fields).
sed -n '/^# flowerconfig.py/,/^```/p' docs/operations.md | sed '$d' >"$WORK/flowerconfig.py"
"$PY" -m celery -A tests.integration.mlapp:app flower --port="$FLOWER_PORT" \
    --address=127.0.0.1 --conf="$WORK/flowerconfig.py" >"$WORK/flower.log" 2>&1 &
PIDS+=($!) && disown
"$PY" -m celery -A tests.integration.mlapp:app worker -n "$WORKER" -c 8 -E -l INFO \
    --without-mingle --without-gossip --ojs-ml-capabilities=profile:nvidia-a100x8 \
    >"$WORK/worker.log" 2>&1 &
PIDS+=($!) && disown

# A short job, three long ones (one on two GPUs), then wait until Flower's API shows them and the leader.
JOB=$("$PY" - "$FLOWER_PORT" "$WORKER" <<'EOF'
import json, sys, time, urllib.request
from tests.integration.mlapp import make_app
import os

port, worker = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"

def get(path):
    try:
        with urllib.request.urlopen(base + path, timeout=10) as resp:
            return json.loads(resp.read())
    except Exception:
        return {}

deadline = time.monotonic() + 120
while get("/api/workers?status=1").get(worker) is not True:  # Flower hears its events
    assert time.monotonic() < deadline, "Flower never saw the worker"
    time.sleep(0.5)
app = make_app(os.environ["OJS_TEST_BROKER"])
record = app.tasks["ml.record"]
record.apply_async(args=["warm-up", 0.2]).get(timeout=60)  # leaves a child bound to its GPU
pair = record.apply_async(args=["train-pair", 600], headers={"ext_ml_gpu_count": 2})
for tag in ("finetune", "eval"):
    record.apply_async(args=[tag, 600])
while True:
    stats = get("/api/workers?refresh=1").get(worker, {}).get("stats", {})
    info = get(f"/api/task/info/{pair.id}")
    if stats.get("ojs_ml.running") == 3 and stats.get("ojs_ml.leader") and info.get("ojs_devices"):
        break
    assert time.monotonic() < deadline, f"Flower never showed the jobs: {stats}"
    time.sleep(0.5)
print(pair.id)
EOF
)

shoot() {  # URL FILE HEIGHT (no animations: the tab is shown at once)
    "$CHROMIUM" --headless --no-sandbox --disable-gpu --hide-scrollbars \
        --force-prefers-reduced-motion --virtual-time-budget=5000 \
        --window-size="1280,$3" --screenshot="$2" "$1" >>"$WORK/chromium.log" 2>&1
    echo "wrote $2"
}
shoot "http://127.0.0.1:$FLOWER_PORT/worker/$WORKER#tab-other" "$OUT/flower-worker.png" 1120
shoot "http://127.0.0.1:$FLOWER_PORT/task/$JOB" "$OUT/flower-task.png" 1300
