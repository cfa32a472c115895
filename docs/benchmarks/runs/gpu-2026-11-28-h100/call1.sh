#!/bin/bash
# Device call 1: set up, the demo job through the API on the lab (issue 16), the one-GPU bench (issue 20's check).
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
start=$(date +%s)
bash .devrun/setup.sh > "$OUT/setup.log" 2>&1; rc=$?
cat "$OUT/setup.log"
[ $rc -eq 0 ] || exit $rc
cd /tmp  # the checkout has a meridian/ shim of the editable install: import the wheel
echo "== lab-demo at $(( $(date +%s) - start )) s"
timeout 300 meridian bench lab-demo --json --rounds 2 --probe > "$OUT/labdemo.json" 2> "$OUT/labdemo.err"
echo "lab-demo rc $? at $(( $(date +%s) - start )) s"; tail -c 1500 "$OUT/labdemo.err"
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({k: v for k, v in r.items() if k != "runs"})[:1500])' "$OUT/labdemo.json"
echo "== gpu at $(( $(date +%s) - start )) s"
timeout 150 meridian bench gpu --json > "$OUT/gpu.json" 2> "$OUT/gpu.err"
echo "gpu rc $? at $(( $(date +%s) - start )) s"; tail -c 1200 "$OUT/gpu.err"; head -c 2500 "$OUT/gpu.json"
echo "== done at $(( $(date +%s) - start )) s"
