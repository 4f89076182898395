"""Decode steps handed Hugging Face's rows: fastrope's drop-in against Liger's. (Needs a GPU.)

transformers hands ``apply_rotary_pos_emb`` each token's cos/sin rows, ``[b, 1, R]`` at a batched
decode step whose sequences sit at their own positions. The peers suite hands Liger those rows
(gathered outside the timed call) and fastrope the table with one offset per sequence; this
probe hands both the same rows. Cases: the peers suite's decode steps (GQA k with 8 heads,
tables in x's dtype, full width as transformers makes them). Rows, CUDA-graph us, the minimum of
interleaved medians:

* Liger, in place, handed the rows (it reads the first half of each row and computes in the
  rows' dtype);
* fastrope's drop-in (``ports.fastrope.hf.apply_rotary_pos_emb``) on transformers' ``[b, h, 1,
  d]`` views: the batch folded into one sequence, token t reading row t, both halves of every
  row read (the drop-in cannot know the halves are equal);
* the drop-in's path before the fold: the rows read through an offsets tensor made in the call;
* ``apply_rope`` folded the same way, handed the first half of each row (what Liger reads);
* ``fastrope.rope`` as the peers suite runs it (the table, one offset per sequence);
* the same-size copy.

    python -m tools.rows_given_probe [--reps 5] [--json FILE --commit SHA]
"""
from __future__ import annotations

import torch

from ports import registry
from ports.fastrope import apply_rope, hf
from ports.harness.suites import get_suite
from ports.harness.timing import copy_us, graph_median_us, min_of_interleaved
from reference.case import make_inputs
from tools._probe_kit import (parse_probe_arguments, probe_parser, require_gpu,
                              write_requested)

ROWS = ("Liger (rows, in place)", "fastrope drop-in (rows)",
        "rows through offsets made in the call", "fastrope folded (half rows)",
        "fastrope.rope (table, offsets)")
COLUMNS = ["case", *ROWS, "same-size copy"]


def _calls(case, inputs) -> dict:
    """Each row's call on the case's inputs; the fastrope calls checked to agree."""
    q, k = inputs.xs
    b, s, hq, d = q.shape
    pos = inputs.positions.reshape(-1)
    cos, sin = inputs.cos[pos].contiguous(), inputs.sin[pos].contiguous()  # [b * s, R]
    half_cos, half_sin = cos[:, : d // 2].contiguous(), sin[:, : d // 2].contiguous()
    views = q.transpose(1, 2), k.transpose(1, 2)  # transformers' [b, h, s, d]
    folded = q.view(1, b * s, hq, d), k.view(1, b * s, k.shape[2], d)
    calls = {
        ROWS[0]: registry.get("liger.rope").prepare(case, inputs),
        ROWS[1]: lambda: hf.apply_rotary_pos_emb(*views, cos.view(b, s, d), sin.view(b, s, d)),
        ROWS[2]: lambda: apply_rope(
            *views, cos=cos, sin=sin, layout="bhsd", check_positions=False,
            offsets=torch.arange(0, b * s, s, device=q.device, dtype=torch.int32)),
        ROWS[3]: lambda: apply_rope(*folded, cos=half_cos, sin=half_sin, check_positions=False),
        ROWS[4]: registry.get("fastrope.rope").prepare(case, inputs),
    }
    want = calls[ROWS[4]]()  # [b, s, h, d]
    for name in ROWS[1:4]:
        got = calls[name]()  # [b, h, s, d] views, or [1, b * s, h, d] (folded)
        got = [x.transpose(1, 2) if name != ROWS[3] else x.view(w.shape)
               for x, w in zip(got, want)]
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"{name}: differs"
    return calls


def main(argv=None) -> int:
    ap = probe_parser("tools.rows_given_probe", __doc__, reps=5)
    args = parse_probe_arguments(ap, argv)
    require_gpu(ap)
    missing = registry.get("liger.rope").missing()
    if missing:
        ap.error(missing)
    rows = []
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for case in get_suite("peers"):
        if case.seqlen != 1:
            continue
        inputs = make_inputs(case, 0, torch.device("cuda"))
        times = min_of_interleaved(_calls(case, inputs), reps=args.reps, timer=graph_median_us)
        copy = copy_us(case.io_bytes() // 2, graph=True)
        rows.append([case.describe(), *(f"{times[n]:.2f}" for n in ROWS), f"{copy:.2f}"])
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    write_requested(args, argv, tool="tools.rows_given_probe", doc=__doc__,
                    section="fastrope's Hugging Face drop-in handed the rows Liger is handed",
                    columns=COLUMNS, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
