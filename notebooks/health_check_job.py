# Written by %%torchrun --save. Run it with, for example:
#   torchrun --standalone --nproc-per-node 2 THIS_FILE.py
#   torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 THIS_FILE.py
import torch
import torch.distributed as dist

from course_lib import runtime

_ctx = runtime.init_distributed('gloo')
rank, world_size, local_rank, device = _ctx.rank, _ctx.world_size, _ctx.local_rank, _ctx.device

from course_lib.process_groups import health_check
print(f"rank {rank}: health check sum = {health_check(device):g}")

runtime.shutdown()
