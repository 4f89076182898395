"""Occupancy sweep for the study kernel (device exploration; not a test)."""
import torch
from ports.study import apply_rope, _launch
from ports.study.api import Tuning
from ports.study import api
from ports.harness.timing import median_us, copy_bandwidth_gbps

copy = copy_bandwidth_gbps(0)
print(f"copy {copy:.0f} GB/s")
cases = [("bshd", torch.bfloat16, (4, 4096, 32, 128)), ("bshd", torch.float32, (4, 4096, 32, 128)),
         ("sbhd", torch.bfloat16, (4096, 4, 32, 128)), ("bshd", torch.float16, (8, 4096, 64, 128)),
         ("sbhd", torch.bfloat16, (4096, 1, 32, 128))]
for layout, dtype, shape in cases:
    q = torch.randn(shape, device="cuda", dtype=dtype)
    cos = torch.randn(4096, 128, device="cuda", dtype=dtype); sin = torch.randn_like(cos)
    nbytes = 2 * q.numel() * q.element_size()
    tc = median_us(lambda: q.clone())
    print(layout, dtype, shape, f"clone {tc:.1f}us {100 * nbytes / (tc * 1e-6) / 1e9 / copy:.1f}%")
    for minb in (1, 2, 3, 4):
        _launch.OPTIONS = (f"-DSTUDY_MIN_BLOCKS={minb}",)
        _launch._function_ptr.cache_clear(); api._ENTRIES.clear()
        for unroll in (1, 2, 4):
            out = torch.empty_like(q)
            t = median_us(lambda: apply_rope(q, cos=cos, sin=sin, layout=layout, check_positions=False, _tuning=Tuning(unroll=unroll)))
            print(f"   minb{minb}/u{unroll}: {t:.1f}us {100 * nbytes / (t * 1e-6) / 1e9 / copy:.1f}%")
    del q
    torch.cuda.empty_cache()
