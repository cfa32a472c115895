export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1; REPO=$PWD; cd /tmp
timeout 95 python3 $REPO/.gpu/gpu_kill.py 300 100 1 small > $OUT/kill.json 2>> $OUT/stderr.log; echo "rc=$?"; python3 -c "
import json,sys; j=json.load(open(sys.argv[1])); print(j['state'], j['message'], j.get('killed'), j.get('gpu_apps'))
[print(e) for e in j['events'] if e[1] not in ('state','worker_started')]; print(j['result'])" $OUT/kill.json 2>&1 | cut -c1-400
