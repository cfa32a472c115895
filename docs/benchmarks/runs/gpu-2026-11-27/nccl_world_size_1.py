"""NCCL at world size 1, as a re-formed epoch does it: bind the device, init per device type with device_id,
barrier / all_gather_object / broadcast_object_list / all_reduce on CUDA and CPU tensors, destroy, form again."""
import json, socket, time
from datetime import timedelta
import torch, torch.distributed as dist
from meridian.workers.distributed.devices import bind_device, init_kwargs

out = []
for epoch in range(2):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    t0 = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=30))
    kw = init_kwargs(bind_device("cuda"))
    dist.init_process_group(store=store, rank=0, world_size=1, timeout=timedelta(seconds=30), **kw)
    dist.barrier()
    objs = [None]; dist.all_gather_object(objs, {"epoch": epoch})
    lst = [{"b": epoch}]; dist.broadcast_object_list(lst, src=0)
    g = torch.ones(4, device="cuda"); dist.all_reduce(g)
    c = torch.ones(4); dist.all_reduce(c)
    sub = dist.new_group([0]); dist.all_reduce(g, group=sub)
    torch.cuda.synchronize()
    out.append({"epoch": epoch, "backend": kw["backend"], "device": str(kw.get("device_id")), "gathered": objs,
                "broadcast": lst, "cuda_sum": g.tolist(), "cpu_sum": c.tolist(), "form_and_ops_s": time.perf_counter() - t0,
                "current_device": torch.cuda.current_device()})
    dist.destroy_process_group()
print(json.dumps(out))
