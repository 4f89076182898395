"""Per-device tuning tables: which alternative settings (plan.ALTERNATIVES) a GPU family's plan
takes for a row of plan.RULES.

A table is a JSON file in :data:`TUNED_DIR`, written by ``python -m ports.harness.tune`` on a GPU
of the family it names: its ``choices`` map a row's name to the alternative that beat the row's
own settings there, and its ``measurements`` keep the times that decided it. A family is the
properties a plan depends on: compute capability, SM count, L2 size and memory bus width (as
torch reports them, the H100 and the H200 differ in the last two: 50 and 60 MiB, 5120 and 6016
bits). A GPU whose family has no table runs plan.RULES as they are, the plan measured on the
H100. A table's optional ``qknorm`` entry sets the fused QK-norm's launch constants for the
family (``ports.fastrope.qknorm.DEVICE_TUNED``), written by ``python -m ports.harness.tune
--qknorm`` with its run and measurements beside it; a constant that ``qknorm_source`` names was
set by hand from the tools/qknorm_launch_sweep.py data file it names (the next ``--qknorm`` run
decides it, and drops the entry); the module's own values serve the rest.

tests/test_fastrope_plans.py pins the launches each shipped table gives
(tests/data/fastrope_tuned_plans.json): the tables results/ measured on a GPU describe them, and a
change that moves them fails there until re-recorded (tests/data/record_tuned_plans.py).
"""
from __future__ import annotations

import functools
import json
import pathlib

import torch

__all__ = ["TUNED_DIR", "choices", "device_family", "family_name", "qknorm_constants",
           "qknorm_values", "tables"]

TUNED_DIR = pathlib.Path(__file__).with_name("tuned")


def family_name(major: int, minor: int, sms: int, l2_bytes: int, memory_bus_bits: int) -> str:
    """The family of a GPU with these properties, as its tuning table names it."""
    return (f"sm_{major}{minor}, {sms} SMs, {l2_bytes / 2**20:g} MiB L2, "
            f"{memory_bus_bits}-bit memory bus")


@functools.cache
def device_family(device_index: int) -> str:
    """The family of CUDA device ``device_index``."""
    p = torch.cuda.get_device_properties(device_index)
    return family_name(p.major, p.minor, p.multi_processor_count, p.L2_cache_size,
                       p.memory_bus_width)


@functools.cache
def tables() -> dict[str, dict]:
    """Every shipped table by family; two tables for one family are refused."""
    found: dict[str, dict] = {}
    for path in sorted(TUNED_DIR.glob("*.json")):
        table = json.loads(path.read_text(encoding="utf-8"))
        family = table["family"]
        if family in found:
            raise ValueError(f"two tuning tables for {family!r}: {found[family]['path']} and "
                             f"{path.name}; keep one")
        found[family] = dict(table, path=path.name)
    return found


def choices(device_index: int) -> dict[str, str]:
    """The row -> alternative choices of the device's family (none without a table)."""
    table = tables().get(device_family(device_index))
    return dict(table["choices"]) if table else {}


def qknorm_constants(device_index: int) -> dict[str, int]:
    """The fused QK-norm's launch constants the device's family table sets (none without one)."""
    table = tables().get(device_family(device_index))
    return dict(table.get("qknorm", {})) if table else {}


def qknorm_values(name: str) -> set[int]:
    """Every value the shipped tables set for the fused QK-norm's constant ``name`` (the builds
    the GPUs with tables launch, beside the module's own value)."""
    return {t["qknorm"][name] for t in tables().values() if name in t.get("qknorm", {})}
