"""Named case lists: the suites ``compare.py --suite`` runs and the tests cross-validate."""
from __future__ import annotations

from collections.abc import Callable

from reference.case import RopeCase


def _both_styles(case: RopeCase) -> list[RopeCase]:
    return [case.replace(style=s) for s in ("rotate_half", "interleaved")]


def smoke() -> list[RopeCase]:
    """Small cases that run in seconds on a CPU: every layout, position kind and direction."""
    c = RopeCase(2, 16, 4, 32, label="smoke")
    return [
        *_both_styles(c),
        c.replace(layout="sbhd", rotary_dim=16),
        c.replace(layout="bhsd", positions="ids", dtype="bf16"),
        c.replace(layout="thd", seqlens=(16, 3), positions="arange"),
        c.replace(positions="offset", dtype="fp16"),
        c.replace(direction="backward", asymmetric=True),
        c.replace(direction="backward", grad="broadcast", style="interleaved"),
    ]


def crossval() -> list[RopeCase]:
    """Named cross-validation cases: tiny, odd sizes, strided input, long sequence, and more."""
    cases = []
    for case in [
        RopeCase(1, 4, 1, 8, label="tiny"),
        RopeCase(3, 61, 7, 92, label="odd sizes"),
        RopeCase(2, 33, 6, 64, contiguous=False, label="strided (q of a packed qkv)"),
        RopeCase(2, 33, 6, 64, layout="sbhd", contiguous=False, label="strided sbhd"),
        RopeCase(1, 8192, 1, 128, label="long sequence, one head"),
        RopeCase(2, 4096, 4, 64, layout="sbhd", label="long sequence"),
        RopeCase(1, 1024, 1, 512, label="seed-001 shaped"),
        RopeCase(2, 40, 4, 64, rotary_dim=32, label="partial rotary"),
        RopeCase(3, 50, 4, 32, positions="ids", layout="bhsd", label="per-token ids"),
        RopeCase(4, 50, 2, 32, positions="offset", label="per-sequence offset"),
        RopeCase(4, 64, 3, 32, layout="thd", seqlens=(64, 1, 17, 30), label="thd uneven"),
        RopeCase(2, 24, 4, 32, kv_heads=1, label="q and k, MQA"),
        RopeCase(2, 24, 4, 32, kv_heads=2, dtype="bf16", label="q and k, GQA, bf16"),
        RopeCase(2, 24, 8, 128, kv_heads=2, dtype="bf16", label="q and k, GQA, head 128, bf16"),
    ]:
        cases += _both_styles(case)
    low = RopeCase(2, 128, 8, 64, label="half precision")
    for dtype in ("fp16", "bf16"):
        cases += _both_styles(low.replace(dtype=dtype))
        cases += _both_styles(low.replace(dtype=dtype, cos_sin_dtype="same"))
    back = RopeCase(2, 48, 4, 64, direction="backward", label="backward")
    cases += _both_styles(back)
    cases += _both_styles(back.replace(asymmetric=True))
    cases += _both_styles(back.replace(grad="broadcast", dtype="bf16"))
    return cases


def leetcuda_table() -> list[RopeCase]:
    """Seed 001's table: x[M, N] fp32, interleaved, M in {4096, 8192}, N in {512, 1024}."""
    return [RopeCase(1, m, 1, n, style="interleaved", label=f"leetcuda table M={m} N={n}")
            for m in (4096, 8192) for n in (512, 1024)]


def decode() -> list[RopeCase]:
    """One decode step (s = 1): the latency floor. Each sequence sits at its own position in a
    4k context (at position 0 the rotation is the identity and would hide every error)."""
    return [RopeCase(b, 1, 32, 128, dtype="bf16", positions="offset", max_position=4096,
                     label=f"decode b={b}") for b in (1, 64)]


def anchors() -> list[RopeCase]:
    """Five forward reference points: three prefill shapes (bf16, fp16, fp32), one 32k-token
    sequence and a 64-sequence decode step (bshd, rotate-half, tables in x's dtype)."""
    shapes = [((4, 4096, 32, 128), "bf16"), ((8, 4096, 64, 128), "fp16"),
              ((2, 4096, 32, 128), "fp32"), ((1, 32768, 8, 128), "bf16"),
              ((64, 1, 32, 128), "bf16")]
    return [RopeCase(*shape, dtype=dtype, cos_sin_dtype="same", label="anchor")
            for shape, dtype in shapes]


PREFILL_SHAPES = ((1, 4096, 32, 128), (4, 4096, 32, 128), (8, 4096, 64, 128), (1, 32768, 8, 128))


def prefill() -> list[RopeCase]:
    """Prefill: bshd and sbhd, four (b, s, h, d) shapes, fp16/bf16/fp32, rotate-half, tables in
    x's dtype (the ports that read tables as x's dtype need it)."""
    return [RopeCase(*shape, layout=layout, dtype=dtype, cos_sin_dtype="same",
                     label=f"prefill {layout}")
            for layout in ("bshd", "sbhd") for shape in PREFILL_SHAPES
            for dtype in ("fp16", "bf16", "fp32")]


def qkv() -> list[RopeCase]:
    """q, k and v rotated by one fused launch or by one launch each (Paddle V1's design point),
    on a prefill shape and a decode step; bf16, tables in x's dtype."""
    return [
        RopeCase(4, 4096, 32, 128, dtype="bf16", cos_sin_dtype="same", kv_heads=32, with_v=True,
                 label="qkv prefill"),
        RopeCase(64, 1, 32, 128, dtype="bf16", cos_sin_dtype="same", kv_heads=32, with_v=True,
                 positions="offset", max_position=4096, label="qkv decode"),
    ]


MIDDLE_PREFILL_SHAPE = (4, 4096, 32, 128)  # used by the single-axis suites


def partial() -> list[RopeCase]:
    """Partial rotary: R = d/2 and d/4 (the tail passes through), bshd and sbhd, bf16."""
    return [RopeCase(*MIDDLE_PREFILL_SHAPE, layout=layout, dtype="bf16",
                     cos_sin_dtype="same", rotary_dim=128 // div, label=f"partial R=d/{div}")
            for layout in ("bshd", "sbhd") for div in (2, 4)]


def interleaved() -> list[RopeCase]:
    """The interleaved (GPT-J) convention on the prefill shapes, bshd, bf16 and fp32."""
    return [RopeCase(*shape, style="interleaved", dtype=dtype, cos_sin_dtype="same",
                     label="interleaved")
            for shape in PREFILL_SHAPES[1:3] for dtype in ("bf16", "fp32")]


def positions() -> list[RopeCase]:
    """Random per-token position ids (a different row per sequence) and per-sequence offsets."""
    return [RopeCase(*MIDDLE_PREFILL_SHAPE, dtype="bf16", cos_sin_dtype="same", positions=kind,
                     max_position=32768, label=f"positions {kind}")
            for kind in ("ids", "offset")]


def varlen() -> list[RopeCase]:
    """thd: packed sequences of uneven lengths (one of length 1)."""
    lengths = (4096, 1, 977, 2048, 3001, 64, 4096, 1500)
    return [RopeCase(len(lengths), max(lengths), 32, 128, layout="thd", seqlens=lengths,
                     dtype=dtype, cos_sin_dtype="same", label="varlen")
            for dtype in ("bf16", "fp32")]


def gqa() -> list[RopeCase]:
    """q with 32 heads and k with fewer (GQA 8, MQA 1), rotated together."""
    return [RopeCase(*MIDDLE_PREFILL_SHAPE, dtype="bf16", cos_sin_dtype="same", kv_heads=kv,
                     label=f"gqa kv={kv}") for kv in (8, 1)]


def long() -> list[RopeCase]:
    """Just over 2^31 elements (bf16, 4.3 GB per tensor): a port works or refuses cleanly."""
    return [RopeCase(1, 16385, 1024, 128, dtype="bf16", cos_sin_dtype="same",
                     label="long: 2^31 + 2^17 elements")]


def apex() -> list[RopeCase]:
    """apex's own layout, sbhd (s x b x h x d): prefill shapes in bf16, fp16 and fp32, a 32k
    sequence, partial rotary (R = 64) and a decode step."""
    shapes = [((4096, 4, 32, 128), "bf16", None), ((4096, 8, 64, 128), "fp16", None),
              ((4096, 2, 32, 128), "fp32", None), ((32768, 1, 8, 128), "bf16", None),
              ((4096, 4, 32, 128), "bf16", 64), ((1, 64, 32, 128), "bf16", None)]
    return [RopeCase(b, s, h, d, layout="sbhd", dtype=dtype, rotary_dim=rot, label="apex anchor")
            for (s, b, h, d), dtype, rot in shapes]


def ablation() -> list[RopeCase]:
    """Where fastrope's ideas matter: prefill (bf16, fp32), a decode step, GQA q+k,
    partial rotary, interleaved, and 128k computed angles. Run with
    ``--only fastrope fastrope-ablation``."""
    pre = RopeCase(*MIDDLE_PREFILL_SHAPE, dtype="bf16", label="ablation prefill")
    return [pre, pre.replace(dtype="fp32"), pre.replace(style="interleaved"),
            pre.replace(rotary_dim=64), pre.replace(kv_heads=8, label="ablation gqa"),
            pre.replace(layout="sbhd"),
            RopeCase(64, 1, 32, 128, dtype="bf16", positions="offset", max_position=4096,
                     kv_heads=8, label="ablation decode"),
            RopeCase(1, 131072, 8, 128, dtype="fp32", label="ablation 128k positions")]


def peers() -> list[RopeCase]:
    """Every implementation, the production peers among them, on equal inputs, each case with a
    GQA k (8 heads) rotated beside q and tables in x's dtype, as models hand them to these
    libraries. Prefill (bshd): 4 x 4096 x 32 (bf16, fp32, bf16 interleaved), 8 x 4096 x 64,
    1 x 32768 x 32 and 1 x 4096 x 32. Decode: 1, 64 and 256 sequences of one token at their
    own positions in a 4k context (32 heads; 64 at b=256), and b=64 in fp32. compare.py times
    this suite's CUDA-graph replays too (decode is launch-bound). The bf16 b=64 decode step is
    the last case."""
    pre = RopeCase(*MIDDLE_PREFILL_SHAPE, dtype="bf16", cos_sin_dtype="same", kv_heads=8,
                   label="peers prefill")
    dec = RopeCase(64, 1, 32, 128, dtype="bf16", cos_sin_dtype="same", kv_heads=8,
                   positions="offset", max_position=4096, label="peers decode")
    return [pre, pre.replace(dtype="fp32"), pre.replace(style="interleaved"),
            pre.replace(batch=8, heads=64), pre.replace(batch=1, seqlen=32768),
            pre.replace(batch=1),
            dec.replace(batch=1), dec.replace(batch=256, heads=64), dec.replace(dtype="fp32"),
            dec]


def serving() -> list[RopeCase]:
    """The serving frameworks' shapes: q with a GQA k rotated together, NeoX unless named, bshd,
    tables in x's dtype (vLLM's cache form) unless named fp32 (FlashInfer's cache must be fp32).
    27 cases:

    * decode (one token per sequence at its own position in a 4k context), 32 q / 8 kv heads,
      bf16: head size 64, 80, 128 and 256 x b = 1, 64 and 256 (12); at head size 128 and b = 64:
      64/8 heads, fp16, fp32, and fp32 tables (4);
    * prefill, 32 q / 8 kv heads, bf16: 1 x 4096 tokens at head size 64, 80, 128 and 256 (4);
      1 x 32768 at head size 80 and 128, and 64/8 heads at 128 (3); at head size 128: 4 x 1024
      in fp16, 1 x 4096 in fp32, GPT-J pairs, and fp32 tables (4).
    """
    dec = RopeCase(64, 1, 32, 128, dtype="bf16", cos_sin_dtype="same", kv_heads=8,
                   positions="offset", max_position=4096, label="serving decode")
    pre = RopeCase(1, 4096, 32, 128, dtype="bf16", cos_sin_dtype="same", kv_heads=8,
                   label="serving prefill")
    head_sizes = (64, 80, 128, 256)
    return [
        *(dec.replace(batch=b, head_dim=d) for d in head_sizes for b in (1, 64, 256)),
        dec.replace(heads=64), dec.replace(dtype="fp16"), dec.replace(dtype="fp32"),
        dec.replace(cos_sin_dtype="fp32"),
        *(pre.replace(head_dim=d) for d in head_sizes),
        pre.replace(seqlen=32768, head_dim=80), pre.replace(seqlen=32768),
        pre.replace(seqlen=32768, heads=64),
        pre.replace(batch=4, seqlen=1024, dtype="fp16"), pre.replace(dtype="fp32"),
        pre.replace(style="interleaved"), pre.replace(cos_sin_dtype="fp32"),
    ]


# Suites whose forward cases compare.py also times as CUDA-graph replays, --graph or not.
GRAPH_SUITES = ("peers",)

SUITES: dict[str, Callable[[], list[RopeCase]]] = {
    "smoke": smoke,
    "crossval": crossval,
    "leetcuda_table": leetcuda_table,
    "decode": decode,
    "anchors": anchors,
    "prefill": prefill,
    "qkv": qkv,
    "partial": partial,
    "interleaved": interleaved,
    "positions": positions,
    "varlen": varlen,
    "gqa": gqa,
    "long": long,
    "apex": apex,
    "ablation": ablation,
    "peers": peers,
    "serving": serving,
}


def _seed_suites() -> dict[str, Callable[[], list[RopeCase]]]:
    from ports.harness.seed_suites import SEED_SUITES

    return SEED_SUITES


SUITES.update(_seed_suites())


def get_suite(name: str) -> list[RopeCase]:
    if name not in SUITES:
        raise KeyError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    return SUITES[name]()
