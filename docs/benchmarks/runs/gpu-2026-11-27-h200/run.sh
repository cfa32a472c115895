#!/bin/bash
# One device run: install Meridian + Ray from carried wheels, then the GPU checks, each with its own timeout
# and none past the call's deadline (BUDGET seconds from the start).
REPO=$PWD; BUDGET=${BUDGET:-215}
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
nproc
k() { el "kill $*"; echo "== kill $*" >> $E; timeout $(tmo 120) python3 $REPO/.gpu/gpu_kill.py "$@" > $OUT/kill_$3_$2.json 2>> $E; echo "rc=$?"; python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(j['state'], j['message'], j.get('killed'), j.get('gpu_apps')); print('plan:', j['plan'].get('explanation'))
[print(e) for e in j['events'] if e[1] not in ('state','worker_started')]; print(j['result'])" $OUT/kill_$3_$2.json 2>&1 | cut -c1-400; }
el pytest; mkdir -p /tmp/t2 && cp $REPO/.gpu/test_optimizer_restore.py /tmp/t2/ && timeout $(tmo 60) python3 -m pytest /tmp/t2 -q -p no:cacheprovider -rs 2>&1 | tail -5
k 1500 500 1 small
k 1500 500 2 small
el done
