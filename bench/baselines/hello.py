"""The start-latency baseline: a two-process torchrun hello-world (Gloo, one allreduce).

python -m torch.distributed.run --standalone --nproc-per-node 2 bench/baselines/hello.py
"""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"hello from rank {dist.get_rank()} of {int(t.item())}")
dist.destroy_process_group()
