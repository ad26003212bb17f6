import gc, os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
V = os.environ["VARIANT"]
dist.init_process_group("gloo")
m = DistributedDataParallel(torch.nn.Linear(64, 64))
opt = torch.optim.AdamW(m.parameters())
for _ in range(6):
    m(torch.randn(8, 64)).sum().backward(); opt.step(); opt.zero_grad()
t = torch.ones(4); dist.all_reduce(t)
dist.barrier()
if V == "gc":
    del m, opt; gc.collect()
dist.destroy_process_group()
if V == "exit":
    sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
