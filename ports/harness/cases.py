"""The cases of a ``compare.py`` run: the ``--suite`` lists and the ``--shape`` grid.

Separate from :mod:`ports.harness.cli` (which parses without importing torch or the reference) so
that :mod:`ports.harness.modes` and the tests build cases from parsed arguments without reaching
back into the parser.
"""
from __future__ import annotations

import random
from collections.abc import Sequence


def uneven_seqlens(batch: int, max_len: int, seed: int) -> tuple[int, ...]:
    """Deterministic uneven lengths in [1, max_len], the longest exactly max_len."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, max_len) for _ in range(batch)]
    lengths[rng.randrange(batch)] = max_len
    return tuple(lengths)


def case_from_shape(dims: tuple[int, int, int, int], layout: str, seed: int = 0,
                    seqlens: Sequence[int] | None = None, **fields):
    """A case from a shape in ``layout``'s order (thd takes b x s x h x d: b sequences <= s)."""
    from reference.case import RopeCase

    order = "bshd" if layout == "thd" else layout
    size = dict(zip(order, dims))
    if layout == "thd":
        fields["seqlens"] = (tuple(seqlens) if seqlens
                             else uneven_seqlens(size["b"], size["s"], seed))
    return RopeCase(size["b"], size["s"], size["h"], size["d"], layout=layout, **fields)


def cases_from_args(args) -> list:
    """The ``RopeCase`` list of ``--suite`` and ``--shape`` (times dtypes, styles, directions)."""
    from ports.harness.suites import get_suite

    cases = []
    for name in args.suite or ():
        cases += get_suite(name)
    directions = (["backward"] if args.backward_only
                  else ["forward", "backward"] if args.backward else ["forward"])
    for dims in args.shape or ():
        for dtype in args.dtype:
            for style in args.style:
                for direction in directions:
                    cases.append(case_from_shape(
                        dims, args.layout, args.seed, args.seqlens, dtype=dtype, style=style,
                        rotary_dim=args.rotary_dim, positions=args.positions,
                        cos_sin_dtype=args.cos_sin_dtype, base=args.base,
                        kv_heads=args.kv_heads, contiguous=not args.strided,
                        direction=direction))
    if args.suite and (args.backward or args.backward_only):
        suite_cases = [c for c in cases if c.direction == "forward" and args.shape is None]
        backward = [c.replace(direction="backward") for c in suite_cases]
        if args.backward_only:  # the suites' own backward cases, then the converted ones
            cases = [c for c in cases if c.direction == "backward"] + backward
        else:
            cases += backward
    return cases
