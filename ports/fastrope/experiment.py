"""fastrope's experiment interface: the kernel built as a variant, launched with a chosen plan.

The probes under tools/ ask what a piece of the design is worth by changing it and timing the
result. They do it here, through public names, never by editing rope.cu's text or reaching into
the package's private names:

* :class:`Variant`: rope.cu built with named build options (rope.cu's ``ROPE_*`` macros; the
  design is built with none): plain data loads and/or stores where the plan streams them, the
  *minimal kernel* (``traffic_only``: the rotation replaced by a copy that keeps every load,
  table elements included, live: a row's memory traffic alone) and a ``__launch_bounds__``
  minimum of resident blocks for the main kernel; or another version of rope.cu (``source``:
  its text, for an A/B of a kernel change in one process, as ``tools/source_ab_probe.py`` runs
  it). Another source must keep the kernels' names, template arguments and parameter layouts,
  as the plans and the launcher use them.
* :func:`apply_rope`: ``ports.fastrope.apply_rope`` (or ``apply_rope_inplace`` with
  ``in_place=True``) run with a variant's kernels, planned by the design or a named ablation
  (ablation.ABLATIONS), optionally with the main kernel's heads per step (``unroll``) or head
  splits fixed; the plan's own arithmetic gives the rest of the shape.
  The rules are the device's (its tuning table's choices) unless ``choices`` names the
  alternatives (plan.ALTERNATIVES) of rows; ``python -m ports.harness.tune`` times them so.
* :func:`plans`: the plans such a call launches.

Example: the minimal kernel of a decode step::

    from ports.fastrope import experiment
    minimal = experiment.Variant(traffic_only=True)
    out = experiment.apply_rope(q, k, cos=cos, sin=sin, offsets=offsets, variant=minimal)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ports import _cupy
from ports.fastrope import ablation as ablations
from ports.fastrope import kernel, plan, run
from ports.fastrope.plan import Plan, Rule

__all__ = ["DESIGN", "Variant", "apply_rope", "plans"]


@dataclass(frozen=True)
class Variant:
    """rope.cu as built for an experiment; the defaults are the design."""

    plain_loads: bool = False    # plain data loads where the plan streams them
    plain_stores: bool = False   # plain data stores where the plan streams them
    traffic_only: bool = False   # no rotation: every chunk stored as loaded
    min_blocks: int | None = None  # the main kernel's __launch_bounds__ minimum blocks
    source: str | None = field(default=None, repr=False)  # rope.cu's text (None: the package's)

    def __post_init__(self):
        if self.min_blocks is not None and (not isinstance(self.min_blocks, int)
                                            or not 1 <= self.min_blocks <= 8):
            raise ValueError(f"min_blocks must be None or 1..8 (blocks of 256 threads per SM), "
                             f"got {self.min_blocks!r}")
        if self.source is not None and (not isinstance(self.source, str)
                                        or not all(f" {k}(" in self.source
                                                   for k in ("rope_rows", "rope_step"))):
            raise ValueError("source must be None or the text of a rope.cu that defines "
                             "rope_rows and rope_step")

    @property
    def options(self) -> tuple[str, ...]:
        """The NVRTC options that build it (rope.cu's ROPE_* macros)."""
        opts = tuple(f"-D{name}" for name, on in (
            ("ROPE_PLAIN_LOADS", self.plain_loads), ("ROPE_PLAIN_STORES", self.plain_stores),
            ("ROPE_TRAFFIC_ONLY", self.traffic_only)) if on)
        if self.min_blocks is not None:
            opts += (f"-DROPE_MIN_BLOCKS={self.min_blocks}",)
        return kernel.OPTIONS + opts


DESIGN = Variant()


def function_ptr(variant: Variant, device_index: int, name: str) -> int:
    """One instantiation of rope.cu built as ``variant`` for the device (compiled once)."""
    module = _cupy.load(device_index, variant.source or kernel.MODULE.source, kernel.FILENAME,
                        variant.options, (name,))
    return module[name].ptr


def _fixed(unroll: int | None, head_splits: int | None) -> tuple[Rule, ...]:
    settings = {}
    if unroll is not None:
        settings.update(unroll=unroll, vector=None, step_kernel=False)
    if head_splits is not None:
        settings.update(head_splits=head_splits, step_kernel=False)
    return (Rule("experiment: fixed shape", "", plan.always, settings),) if settings else ()


@functools.cache
def _planner(variant: Variant, ablation: str | None, unroll: int | None,
             head_splits: int | None, choices: tuple | None) -> tuple[run.Planner, list[Plan]]:
    """The planner of one setup, and the plans it has made."""
    rows = _fixed(unroll, head_splits)
    if ablation is not None:
        if ablation not in ablations.ABLATIONS:
            raise ValueError(f"unknown ablation {ablation!r}; choose from "
                             f"{', '.join(ablations.ABLATIONS)}")
        rows += ablations.ABLATIONS[ablation].rules
        separate = ablations.ABLATIONS[ablation].separate_launches
    else:
        separate = False
    given = None if choices is None else plan.with_choices(dict(choices))
    recorded: list[Plan] = []

    def choose(p, operands, **call):
        base = plan.device_rules(operands[0].src.get_device()) if given is None else given
        chosen = plan.choose_from(rows + base, p, operands, **call)
        recorded.append(chosen)
        return chosen

    compile_ = None if variant == DESIGN else functools.partial(function_ptr, variant)
    return run.Planner(choose, separate, compile_), recorded


def _choices(choices) -> tuple | None:
    if choices is None:
        return None
    if not isinstance(choices, dict):
        raise TypeError(f"choices must be a dict of plan.RULES row -> alternative "
                        f"(plan.ALTERNATIVES), got {type(choices).__name__}")
    plan.with_choices(choices)  # refuses unknown rows and alternatives
    return tuple(sorted(choices.items()))


def apply_rope(q, k=None, *, variant: Variant = DESIGN, ablation: str | None = None,
               unroll: int | None = None, head_splits: int | None = None,
               choices: dict[str, str] | None = None, in_place: bool = False, **kwargs):
    """``ports.fastrope.apply_rope`` (``in_place``: ``apply_rope_inplace``) with the kernels
    built as ``variant``, planned by the design or ``ablation``, with ``unroll`` heads per step
    and ``head_splits`` head splits of the main kernel where given (either takes the main
    kernel). The design's rules are the device's (its tuning table's choices) unless
    ``choices`` (row -> alternative, plan.ALTERNATIVES) names others: ``{}`` is plan.RULES as
    they are. ``kwargs``: ``apply_rope``'s. Autograd records the backward with the same
    setup."""
    planner, _ = _planner(variant, ablation, unroll, head_splits, _choices(choices))
    fn = functools.partial(run.rotate_planned, planner)
    return run.with_autograd(fn)(q, k, in_place=in_place, **kwargs)


def plans(q, k=None, **kwargs) -> list[Plan]:
    """The plans :func:`apply_rope` with these arguments launches (it runs the call once)."""
    planner, recorded = _planner(kwargs.get("variant", DESIGN), kwargs.get("ablation"),
                                 kwargs.get("unroll"), kwargs.get("head_splits"),
                                 _choices(kwargs.get("choices")))
    planner.entries.clear()
    recorded.clear()
    apply_rope(q, k, **kwargs)
    return list(recorded)
