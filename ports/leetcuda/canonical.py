"""LeetCUDA's kernels as registry entries: what they support, and the call from a canonical case.

They handle exactly one sequence of one head (``b == h == 1``) as ``x[S, D]``, fp32, interleaved,
positions ``0..S-1``, base 10000, full rotary, forward only.
"""
from __future__ import annotations

from ports import _alloc
from ports._spec import DENSE_LAYOUTS, ImplSpec
from reference.case import RopeCase, RopeInputs
from reference.tolerances import ANGLE_REL_ERR_FAST_MATH

UPSTREAM = "xlite-dev/LeetCUDA@cb6a0497:kernels/rope/rope.cu"


def _one_head_of_one_sequence(case: RopeCase) -> str | None:
    if case.batch != 1 or case.heads != 1 or case.kv_heads is not None:
        return "one sequence of one head only (x[S, D]: b = h = 1)"
    if case.base != 10000.0:
        return "base is fixed at 10000 in the kernel"
    return None


def _v2_check(case: RopeCase) -> str | None:
    return _one_head_of_one_sequence(case) or (
        "block = head_dim/2 threads: needs head_dim <= 2048" if case.head_dim > 2048 else None)


def _x4_check(case: RopeCase) -> str | None:
    return _one_head_of_one_sequence(case) or (
        "float4 kernel: needs head_dim % 4 == 0" if case.head_dim % 4 else None)


def _prepare(kernel):
    def prepare(case: RopeCase, inputs: RopeInputs):
        x2d = inputs.x.view(case.seqlen, case.head_dim)

        def run():
            out = _alloc.empty_like(x2d)
            kernel(x2d, out)
            return (out.view(inputs.x.shape),)

        return run

    return prepare


def _specs():
    from ports import leetcuda

    common = dict(
        family="leetcuda", backend="cupy", upstream=UPSTREAM, styles=frozenset({"interleaved"}),
        layouts=DENSE_LAYOUTS, dtypes=frozenset({"fp32"}), partial=False,
        positions=frozenset({"arange"}), backward=False, strided=False, index_bits=32,
        table_source="computed", angle_rel_err=ANGLE_REL_ERR_FAST_MATH,
    )
    return [
        ImplSpec(name="leetcuda.rope_f32",
                 launch='1-D, 256 threads, ceil(S*D/2/256) blocks', per_thread='1 pair',
                 access='2 x 4 B scalar', math='fp32, fast-math powf/sinf/cosf per pair',
                 summary="1 pair/thread, 256-thread 1-D grid, fast-math",
                 prepare=_prepare(leetcuda.rope_f32), check=_one_head_of_one_sequence, **common),
        ImplSpec(name="leetcuda.rope_f32_v2",
                 launch='block per token, D/2 threads', per_thread='1 pair',
                 access='2 x 4 B scalar', math='fp32, fast-math powf/sinf/cosf per pair',
                 summary="block per token, thread per pair",
                 prepare=_prepare(leetcuda.rope_f32_v2), check=_v2_check, **common),
        ImplSpec(name="leetcuda.rope_f32x4_pack",
                 launch='1-D, 256 threads, ceil(S*D/4/256) blocks', per_thread='2 pairs',
                 access='16 B float4', math='fp32, fast-math powf/sinf/cosf per pair',
                 summary="2 pairs/thread via float4",
                 prepare=_prepare(leetcuda.rope_f32x4_pack), check=_x4_check, **common),
    ]


SPECS = _specs()
