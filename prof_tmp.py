import torch, time
torch.set_num_threads(1)
from trainer.config import load_config
from model import build_model
m = build_model(load_config(['model=s']))
x = torch.randint(0,8192,(8,256))
y=m(x); y.float().logsumexp(-1).mean().backward()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    t=time.perf_counter()
    y=m(x); torch.nn.functional.cross_entropy(y.flatten(0,1), x.flatten()).backward()
    print('step', time.perf_counter()-t)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
