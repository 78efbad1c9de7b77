#!/usr/bin/env bash
# `make fuzz`: the long server fuzz run, against a real `pagedrs serve` process.
#
#   1. builds the tiny random llama of tests/conftest.py in a temporary folder;
#   2. starts `python -m pagedrs.server` on it (64 KV pages) and reads its RSS (VmRSS);
#   3. runs a load twice (tests/fuzz_load.py: concurrent streams, early disconnects), reads RSS
#      after each (growth on the second pass would be a leak);
#   4. runs the Schemathesis fuzzer (tests/test_server_fuzz.py) with PAGEDRS_SERVER_FUZZ_EXAMPLES
#      examples per operation and kind (default 300), randomized, reads RSS;
#   5. sends SIGTERM and requires exit status 0.
# Prints one JSON summary line (counts, RSS in kB) and writes it to $OUT (default fuzz-out.json).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-fuzz-out.json}
EXAMPLES=${PAGEDRS_SERVER_FUZZ_EXAMPLES:-300}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH=${PYTHONPATH:-python}

work=$(mktemp -d)
server_pid=""
cleanup() {
    if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then kill -KILL "$server_pid"; fi
    rm -rf "$work"
}
trap cleanup EXIT

"$PY" -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from conftest import make_tiny_model; make_tiny_model('llama', Path('$work/model'))" >/dev/null 2>&1
port=$("$PY" -c "from pagedrs.net import free_port; print(free_port())")
url="http://127.0.0.1:$port"
"$PY" -m pagedrs.server --model "$work/model" --served-model-name tiny-llama --port "$port" \
    --block-size 16 --num-gpu-blocks 64 --max-model-len 256 --log-level warning >"$work/server.log" 2>&1 &
server_pid=$!

rss() { awk '/^VmRSS/ {print $2}' "/proc/$server_pid/status"; }
for _ in $(seq 1 900); do
    if curl -fs "$url/health" >/dev/null 2>&1; then break; fi
    kill -0 "$server_pid" || { cat "$work/server.log"; exit 1; }
    sleep 0.2
done
rss_start=$(rss)

"$PY" tests/fuzz_load.py "$url" >"$work/load.json"
rss_after_load=$(rss)
"$PY" tests/fuzz_load.py "$url" >"$work/load2.json"  # a second pass: growth here would be a leak
rss_after_load2=$(rss)

PAGEDRS_SERVER_FUZZ_URL="$url" PAGEDRS_SERVER_FUZZ_EXAMPLES="$EXAMPLES" PAGEDRS_SERVER_FUZZ_RANDOM=1 \
    PAGEDRS_SERVER_FUZZ_REPORT="$work/fuzz.json" "$PY" -m pytest -q -p no:cacheprovider tests/test_server_fuzz.py
rss_after_fuzz=$(rss)

kill -TERM "$server_pid"
status=0
wait "$server_pid" || status=$?
server_pid=""
if grep -q Traceback "$work/server.log"; then cat "$work/server.log"; exit 1; fi

"$PY" - "$work/load.json" "$work/load2.json" "$work/fuzz.json" "$rss_start" "$rss_after_load" "$rss_after_load2" \
    "$rss_after_fuzz" "$status" "$OUT" <<'EOF'
import json, sys
load, load2, fuzz = (json.load(open(p)) for p in sys.argv[1:4])
rss_start, rss_load, rss_load2, rss_fuzz, status = (int(v) for v in sys.argv[4:9])
summary = {"load": [load, load2], "fuzz_requests": sum(fuzz.values()), "fuzz_counts": fuzz,
           "rss_kb": {"start": rss_start, "after_load": rss_load, "after_second_load": rss_load2,
                      "after_fuzz": rss_fuzz}, "exit_status": status}
open(sys.argv[9], "w").write(json.dumps(summary, indent=1))
print(json.dumps({k: v for k, v in summary.items() if k != "fuzz_counts"}))
sys.exit(0 if status == 0 else 1)
EOF
