"""A one-GPU job whose training process is SIGKILLed mid-run (found as the GPU's compute process): does the
agent's next process re-form at world size 1 on CUDA and restore its RAM snapshot? Prints one JSON object."""
import json, os, signal, subprocess, sys, tempfile, time
from meridian.api.client import Client
from meridian.api.server import serve_in_thread
from meridian.service.core import MeridianService, ServiceConfig

steps, kill_at, every, preset = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
spec = {"name": "gpu-kill", "model": {"preset": preset},
        "training": {"steps": steps, "global_batch": 16, "micro_batch": 16, "precision": "bf16", "seed": 0},
        "topology": {"datacenters": "auto", "workers_per_datacenter": 1},
        "checkpoint": {"interval_steps": 0, "snapshot_every": every if every == "auto" else int(every)}}
out = {"snapshot_every": every}
with tempfile.TemporaryDirectory() as d:
    svc = MeridianService(ServiceConfig(data_dir=d, local_datacenters={"dc-a": 1}, cpus_per_node=4)).start()
    try:
        with serve_in_thread(svc, host="127.0.0.1", port=0) as url:
            c = Client(url)
            out["plan"] = c.plan(spec)
            job = c.submit(spec); jid = job["id"]; t0 = time.time(); killed = None
            while time.time() - t0 < 240:
                j = c.job(jid)
                if j["state"] in ("succeeded", "failed", "cancelled"): break
                step = (j.get("progress") or {}).get("step") or 0
                if killed is None and kill_at and step >= kill_at:
                    if preset == "nano":  # a CPU dry run: the busiest process is the training one
                        ps = subprocess.run(["ps", "-eo", "pid,pcpu,args", "--sort=-pcpu"], capture_output=True, text=True).stdout.splitlines()
                        out["ps"] = ps[:8]
                        pids = [ps[1].split()[0]]
                    else:  # the GPU's compute process holding the most memory: the training process
                        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                              capture_output=True, text=True).stdout.strip().splitlines()
                        out["gpu_apps"] = apps
                        pids = [max(apps, key=lambda a: int(a.split(",")[1])).split(",")[0].strip()] if apps else []
                    for p in pids: os.kill(int(p), signal.SIGKILL)
                    killed = {"at_step": step, "pids": pids, "t": time.time()}
                time.sleep(0.2)
            j = c.job(jid)
            ev = c.events(jid)["events"]
            out.update(state=j["state"], message=j["message"], result=j["result"], killed=killed,
                       events=[(round(e["time"] - (killed or {}).get("t", 0), 2), e["kind"], e["message"][:300])
                               for e in ev if e["kind"] not in ("progress",)][-40:],
                       placement=j.get("placement"))
    finally:
        svc.stop()
print(json.dumps(out, indent=1, default=str))
