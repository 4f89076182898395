"""A gradient autograd hands to two nodes: which RoPE backwards leave it alone. (Needs a GPU.)

``y = rope(q) + other`` hands the same dy tensor to RoPE's backward and to ``other``'s. A
backward that rotates dy in place (an in-place backward saves a buffer) changes what the other
node reads if it runs first, and autograd runs later-made nodes first, so ``other`` is made
before the rotation here: ``other = (z * 2)`` viewed as ``[b, h, s, d]``. q is a projection's
output viewed as transformers has it (``x @ w`` as ``[b, s, h, d]``, transposed to ``[b, h, s,
d]``), k likewise with 8 heads; q 32 heads of 128 at 2 x 256 tokens, fp32, fp32 tables of the
256 positions; dy is laid out ``[b, s, h, d]`` in memory, as an attention backward gives it.
Rows: the implementation; whether dy is unchanged after the backward; the largest error of
z's gradient against ``2 * dy``; and of x's against the float64 formula.

    python -m tools.shared_gradient_probe [--json FILE --commit SHA]
"""
from __future__ import annotations

import importlib

import torch

from ports.fastrope import apply_rope, apply_rope_inplace
from reference.eager import hf_apply_rotary_pos_emb
from reference.tables import rope_tables
from tools._probe_kit import output_arguments, require_gpu, write_requested

B, S, H, HK, D, WIDTH = 2, 256, 32, 8, 128, 512
COLUMNS = ["implementation", "dy unchanged", "other node's gradient, max error",
           "x's gradient against float64, max error"]


def _hf(q, k, cos, sin):
    """transformers' formula on [b, h, s, d] with rows [s, d]."""
    return hf_apply_rotary_pos_emb(q, k, cos[None], sin[None])


def _rotations() -> dict:
    """Each row's ``rope(q, k, cos, sin)`` on [b, h, s, d] views; None where not installed."""
    rows = {
        "fastrope apply_rope": lambda q, k, c, s: apply_rope(q, k, cos=c, sin=s, layout="bhsd"),
        "fastrope apply_rope_inplace": lambda q, k, c, s: apply_rope_inplace(
            q, k, cos=c, sin=s, layout="bhsd"),
        "torch.compile(transformers' formula)": torch.compile(_hf, fullgraph=True),
        "transformers' formula (eager)": _hf,
    }
    try:
        liger = importlib.import_module("liger_kernel.ops.rope").LigerRopeFunction
        rows["Liger LigerRopeFunction"] = lambda q, k, c, s: liger.apply(q, k, c[None], s[None])
    except ImportError:
        rows["Liger LigerRopeFunction"] = None
    return rows


def _step(rope, leaves, cos, sin, dy, dk):
    """The graph: ``other`` made first, then the projections, RoPE, ``qo + other``; backward."""
    x, wq, wk, z = leaves
    other = (z * 2).transpose(1, 2)
    q = (x @ wq).view(B, S, H, D).transpose(1, 2)
    k = (x @ wk).view(B, S, HK, D).transpose(1, 2)
    qo, ko = rope(q, k, cos, sin)
    torch.autograd.backward([qo + other, ko], [dy, dk])


def _leaves(like=None):
    """x, the two projections' weights and z, fp32 leaves (``like``: the same values in fp64)."""
    if like is not None:
        return [t.detach().double().requires_grad_(True) for t in like]
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(B, S, WIDTH), (WIDTH, H * D), (WIDTH, HK * D), (B, S, H, D)]
    return [(torch.randn(*s, device="cuda", generator=gen) / s[-2] ** 0.5).requires_grad_(True)
            for s in shapes]


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tools.shared_gradient_probe",
                                 description=__doc__.split("\n")[0])
    output_arguments(ap)
    args = ap.parse_args(argv)
    require_gpu(ap)
    cos, sin = rope_tables(S, D, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    dy0 = torch.randn(B, S, H, D, device="cuda", generator=gen).transpose(1, 2)
    dk = torch.randn(B, HK, S, D, device="cuda", generator=gen)
    wide = _leaves(like=_leaves())
    _step(_hf, wide, cos.double(), sin.double(), dy0.double(), dk.double())
    rows = []
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for name, rope in _rotations().items():
        if rope is None:
            rows.append([name, "not installed", "-", "-"])
        else:
            leaves, dy = _leaves(), dy0.clone(memory_format=torch.preserve_format)
            _step(rope, leaves, cos, sin, dy, dk.clone())
            z_err = float((leaves[3].grad - 2 * dy0.transpose(1, 2)).abs().max())
            x_err = float((leaves[0].grad.double() - wide[0].grad).abs().max())
            rows.append([name, "yes" if torch.equal(dy, dy0) else "no", f"{z_err:.3g}",
                         f"{x_err:.3g}"])
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    write_requested(args, argv, tool="tools.shared_gradient_probe", doc=__doc__,
                    section="a gradient autograd hands to two nodes", columns=COLUMNS,
                    rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
