#!/bin/bash
# One device run: install Meridian + Ray from carried wheels, then the GPU checks, each with its own timeout
# and none past the call's deadline (BUDGET seconds from the start).
REPO=$PWD; BUDGET=${BUDGET:-500}
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[+$(( $(date +%s) - T0 ))s] $*"; }
tmo() { local left=$(( BUDGET - ($(date +%s) - T0) - 5 )); [ $left -lt $1 ] && echo $left || echo $1; }
E=$OUT/stderr.log
mkdir -p /tmp/b && tar -xJf .gpu/wheels.tar.xz -C /tmp/b
python3 - <<'PY'
import os, zipfile
root = "/tmp/b/ray_unzipped"
with zipfile.ZipFile("/tmp/b/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl", "w", zipfile.ZIP_STORED) as z:
    for d, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(d, f); z.write(p, os.path.relpath(p, root))
PY
rm -rf /tmp/b/ray_unzipped
python3 -m pip install -q --no-index --no-deps --no-compile /tmp/b/*.whl .gpu/meridian-*.whl >> $E 2>&1 || { tail -30 $E; exit 1; }
el installed
cd /tmp
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, ray, meridian, sys; print(sys.version, torch.__version__, ray.__version__, meridian.__file__)"
nproc; free -g | head -2
summ() { python3 -c "
import json,sys;j=json.load(open(sys.argv[1]))
if 'state' in j: print(j['state'], j.get('message'), j.get('result'))
else:
  [print(k, j[k]) for k in j if k!='meridian'];m=j.get('meridian') or {};[print('m',k,m[k]) for k in m if k!='snapshot_cadence']
" $1 2>&1 | tail -25; }
el demo; echo "== demo" >> $E
timeout $(tmo 150) meridian demo --json --data-dir /tmp/demo > $OUT/demo.json 2>> $E; echo "demo rc=$?"; tail -c 2500 $OUT/demo.json | grep -E '"(state|message|final_loss|tokens_per_s|heldout_loss)"' | head
grep -q '"state": "succeeded"' $OUT/demo.json || grep -l -E "Traceback|Error" /tmp/ray/session_*/logs/*.err /tmp/ray/session_*/logs/*.out 2>/dev/null | head -40 | tar -czf $OUT/demo_raylogs.tgz -T - 2>/dev/null
el llama; echo "== llama" >> $E
timeout $(tmo 130) meridian bench gpu --json --steps 80 --model llama-160m --micro-batch 4 > $OUT/llama.json 2>> $E; echo "llama rc=$?"; summ $OUT/llama.json
el memcheck; echo "== memcheck" >> $E
timeout $(tmo 90) python3 $REPO/.gpu/memcheck.py > $OUT/memcheck.json 2>> $E; echo "memcheck rc=$?"; cat $OUT/memcheck.json
el pytest
cp -r $REPO/tests /tmp/t && cd /tmp && timeout $(tmo 400) python3 -m pytest /tmp/t -q -m "not slow" -n 12 -p no:cacheprovider --timeout 120 -rfE --continue-on-collection-errors > $OUT/pytest.txt 2>&1; echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.txt | cut -c1-200 | tail -40
el done
