"""Run by tests/test_lab.py: a two-rank gloo all-reduce between an actor in dc-a and one in dc-b."""

import json
import sys

import ray

MB = 4


@ray.remote(num_cpus=1)
class Rank:
    def where(self):
        import os

        return ray.util.get_node_ip_address(), os.environ.get("GLOO_SOCKET_IFNAME")

    def all_reduce(self, rank: int, master: str) -> float:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{master}:29555", rank=rank, world_size=2)
        t = torch.full((MB * 2**20 // 4,), float(rank + 1))
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t[0].item()


ray.init(address=sys.argv[1], logging_level="WARNING", log_to_driver=False)
ranks = [Rank.options(label_selector={"datacenter": dc}).remote() for dc in ("dc-a", "dc-b")]
places = ray.get([r.where.remote() for r in ranks], timeout=120)
sums = ray.get([r.all_reduce.remote(i, places[0][0]) for i, r in enumerate(ranks)], timeout=120)
print(json.dumps({"sums": sums, "ifnames": [p[1] for p in places], "tensor_bytes": MB * 2**20}))
