"""Ablations: the package's kernel with one idea of its design switched off, off the production
path.

Each :class:`Ablation` is a named set of plan rules put before the design's (plan.RULES: the
first row that gives a setting and holds wins), and whether q and k go in separate launches.
:func:`apply_rope` and :func:`apply_rope_inplace` are the public functions run with one (same
arguments, plus ``ablation``, a name of :data:`ABLATIONS`), through the same validation,
launcher and kernel with their own plans and launch cache. The registry's
``fastrope-ablation.*`` entries (canonical.py) call these; the public ``ports.fastrope``
functions always run the design. DESIGN.md ("Ablations") says what each idea is worth.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ports.fastrope import plan, run
from ports.fastrope.plan import Rule, always, unroll_from_work


@dataclass(frozen=True, eq=False)  # hashed by identity
class Ablation:
    """One idea switched off: ``rules`` go before plan.RULES; ``separate_launches``: q and k
    in two launches."""

    name: str
    summary: str
    rules: tuple[Rule, ...] = ()
    separate_launches: bool = False


def _always_set(name: str, summary: str, **settings) -> Ablation:
    return Ablation(name, summary, (Rule(f"ablation: {name}", "Ablations", always, settings),))


# An ablation that fixes the vector or the heads per step keeps the aligned width and the
# default heads per step (vector=None, unroll from the work) unless it sets them itself, and
# takes no step kernel, as the design's narrower rules past the L2 no longer apply.
_FIXED_SHAPE = dict(step_kernel=False, vector=None)

ABLATIONS: dict[str, Ablation] = {a.name: a for a in (
    _always_set("scalar_access", "one element per access (no 16-byte vectors)", vector_cap=1,
                vector=None, unroll=unroll_from_work),
    Ablation("one_half_per_thread", "rotate-half out of place: a thread owns one half and "
             "loads its partner", (Rule("ablation: one half per thread", "Ablations",
                                        lambda f: not f.in_place,
                                        dict(pair_per_thread=False)),)),
    _always_set("table_per_head", "cos/sin loaded again for every head", table_per_head=True),
    _always_set("one_head_per_step", "one head per thread per step (no unrolled loads)",
                unroll=1, **_FIXED_SHAPE),
    _always_set("wide_steps_past_l2", "past the L2: 16-byte accesses and 4 heads per step",
                vector_cap=8, unroll=4, **_FIXED_SHAPE),
    _always_set("fixed_launch", "the prefill launch shape for every size (no head splits)",
                unroll=4, head_splits=False, **_FIXED_SHAPE),
    _always_set("divmod_index", "indices from a flat id with div/mod per head",
                flat_index=True, step_kernel=False),
    _always_set("no_cache_hints", "plain loads/stores (no evict-first streaming hints)",
                streaming=False),
    _always_set("hints_at_every_size", "streaming hints even where the data fits in the L2",
                streaming=True),
    _always_set("int64_index", "64-bit offsets even when 32-bit fit", index_bits=64),
    _always_set("no_step_kernel", "small and mid-sized problems take the main kernel",
                step_kernel=False),
    _always_set("runtime_switches", "the step kernel reads the position form, id width, table "
                "width and direction at run time", fixed_switches=False),
    Ablation("separate_launches", "q and k in two launches", separate_launches=True),
    _always_set("sequence_per_block_row", "sbhd: the grid walks each sequence in turn",
                memory_order=False),
    _always_set("fp32_angles", "computed angles in fp32 (fp32 product, sincosf)",
                fp32_angles=True),
)}


def heads_per_step(n: int) -> Ablation:
    """The main kernel with ``n`` heads per thread per step everywhere (one_head_per_step: 1)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"heads per step must be a positive int, got {n!r}")
    return _always_set(f"heads_per_step_{n}", f"{n} heads per thread per step", unroll=n,
                       **_FIXED_SHAPE)


def step_heads(n: int) -> Ablation:
    """The step kernel with ``n`` heads per thread wherever it runs."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"step heads must be a positive int, got {n!r}")
    return _always_set(f"step_heads_{n}", f"{n} heads per step-kernel thread", step_heads=n)


def rules(ablation: Ablation, device_index: int | None = None) -> tuple[Rule, ...]:
    """The plan table an ablation runs with: its rows before plan.RULES, or before the rules of
    CUDA device ``device_index`` (its tuning table's choices, plan.device_rules)."""
    base = plan.RULES if device_index is None else plan.device_rules(device_index)
    return ablation.rules + base


@functools.cache
def planner(ablation: Ablation) -> run.Planner:
    """The run.Planner of an ablation (one launch cache each)."""
    def choose(p, operands, **call):
        table = rules(ablation, operands[0].src.get_device())
        return plan.choose_from(table, p, operands, **call)

    return run.Planner(choose, ablation.separate_launches)


def _resolve(ablation) -> Ablation:
    if isinstance(ablation, Ablation):
        return ablation
    if not isinstance(ablation, str):
        raise TypeError(f"ablation must be a name of ablation.ABLATIONS, got "
                        f"{type(ablation).__name__}")
    if ablation not in ABLATIONS:
        raise ValueError(f"unknown ablation {ablation!r}; choose from {', '.join(ABLATIONS)}")
    return ABLATIONS[ablation]


def apply_rope(q, k=None, *, ablation: str | Ablation, **kwargs):
    """``ports.fastrope.apply_rope(q, k, **kwargs)`` run with ``ablation``."""
    fn = functools.partial(run.rotate_planned, planner(_resolve(ablation)))
    return run.with_autograd(fn)(q, k, in_place=False, **kwargs)


def apply_rope_inplace(q, k=None, *, ablation: str | Ablation, **kwargs):
    """``ports.fastrope.apply_rope_inplace(q, k, **kwargs)`` run with ``ablation``."""
    fn = functools.partial(run.rotate_planned, planner(_resolve(ablation)))
    return run.with_autograd(fn)(q, k, in_place=True, **kwargs)
