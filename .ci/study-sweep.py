"""Device exploration for the study kernel (not a test): times against torch.compile and clone,
and an ncu target (--ncu) that runs each kernel between cudaProfilerStart/Stop."""
import sys
import torch
from ports.study import apply_rope, _launch, api
from ports.study.api import Tuning
from ports.harness.timing import median_us, graph_median_us, copy_bandwidth_gbps
from ports.eager.canonical import _compiled_apply

torch._dynamo.config.cache_size_limit = 64
hf = _compiled_apply()


def case(layout, dtype, shape, rot=128):
    q = torch.randn(shape, device="cuda", dtype=dtype)
    cos = torch.randn(max(shape[:2]), rot, device="cuda", dtype=dtype); sin = torch.randn_like(cos)
    s = shape[1] if layout == "bshd" else shape[0]
    b = shape[0] if layout == "bshd" else shape[1]
    cg, sg = cos[:s][None].expand(b, s, rot).contiguous(), sin[:s][None].expand(b, s, rot).contiguous()
    if layout == "sbhd":
        cg, sg = cg.transpose(0, 1), sg.transpose(0, 1)
    ours = lambda t=Tuning(): apply_rope(q, cos=cos, sin=sin, layout=layout, rotary_dim=rot,
                                         check_positions=False, _tuning=t)
    if rot == shape[-1]:
        comp = lambda: hf(q, None, cg, sg, 2)[0]
    else:
        comp = lambda: torch.cat([hf(q[..., :rot], None, cg, sg, 2)[0], q[..., rot:]], -1)
    return q, ours, comp


if "--ncu" in sys.argv:
    q, ours, comp = case("bshd", torch.bfloat16, (4, 4096, 32, 128))
    for f in (ours, comp, q.clone):
        f(); f()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    ours(); comp(); q.clone()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    sys.exit(0)

copy = copy_bandwidth_gbps(0)
print(f"copy {copy:.0f} GB/s")
for layout, dtype, shape, rot in [("bshd", torch.bfloat16, (4, 4096, 32, 128), 128),
                                  ("bshd", torch.float32, (4, 4096, 32, 128), 128),
                                  ("sbhd", torch.bfloat16, (4096, 4, 32, 128), 128),
                                  ("bshd", torch.bfloat16, (1, 32768, 8, 128), 128),
                                  ("bshd", torch.bfloat16, (4, 4096, 32, 128), 64)]:
    q, ours, comp = case(layout, dtype, shape, rot)
    nbytes = 2 * q.numel() * q.element_size()
    pct = lambda t: 100 * nbytes / (t * 1e-6) / 1e9 / copy
    t_clone, t_comp, t_ours = median_us(q.clone), median_us(comp), median_us(ours)
    print(f"{layout} {dtype} {shape} R={rot}: clone {t_clone:.1f} ({pct(t_clone):.1f}%)  compile "
          f"{t_comp:.1f} ({pct(t_comp):.1f}%)  study {t_ours:.1f} ({pct(t_ours):.1f}%)")
    ref = ours()
    for minb in (1, 2, 3, 4, 6, 8):
        _launch.OPTIONS = (f"-DSTUDY_MIN_BLOCKS={minb}",)
        _launch._function_ptr.cache_clear(); api._ENTRIES.clear()
        for unroll in (1, 2, 4):
            t = Tuning(unroll=unroll)
            assert torch.equal(ours(t), ref), "differs"
            tt = median_us(lambda: ours(t))
            print(f"    minb={minb} unroll={unroll}: {tt:.1f} ({pct(tt):.1f}%)")
    _launch.OPTIONS = ()
    _launch._function_ptr.cache_clear(); api._ENTRIES.clear()
    tb = median_us(lambda: ours(Tuning(flags=16)))
    print(f"    both halves per thread (old): {tb:.1f} ({pct(tb):.1f}%)")
    del q
    torch.cuda.empty_cache()

q = torch.randn(64, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
cos = torch.randn(4096, 128, device="cuda"); sin = torch.randn_like(cos)
off = torch.randint(0, 4000, (64,), device="cuda")
ids = off[:, None]
cg, sg = cos[ids].to(q.dtype), sin[ids].to(q.dtype)
for name, fn in [("study", lambda: apply_rope(q, cos=cos, sin=sin, offsets=off, check_positions=False)),
                 ("study computed", lambda: apply_rope(q, offsets=off)),
                 ("compile", lambda: hf(q, None, cg, sg, 2)[0])]:
    print(f"decode b=64 {name}: event {median_us(fn):.2f} us, graph {graph_median_us(fn):.2f} us")
