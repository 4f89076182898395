"""Regenerate every results table in the documents from its data file under results/data/.

    python -m tools.results_tables           # rewrite the tables in place
    python -m tools.results_tables --check   # exit 1, naming each stale document, if any differs

A document quotes a data file ``results/data/NAME.json`` between two markers; everything between
them is generated, so edit the data file, never the table:

    <!-- table:NAME -->
    | ... the table, generated ... |
    <!-- /table -->

A data file holds one measured table and its provenance: ``command``, ``commit``, ``gpu``,
``driver``, ``versions``, ``date`` (each "not recorded" where the run's notes did not give it),
``section`` and ``context`` (the notebook's words about the run), ``columns`` and ``rows`` (the
cells, as strings, exactly as quoted), and optionally ``align`` (per column: "", "left", "right",
"center").

A *view* (``{"view": {"source": OTHER, "columns": [...], "rows": [...]}, "caption": ...}``) quotes
a subset of another data file: the named columns (by header) and the rows whose first cell is
named, in the order given, under a caption that states the source's GPU, commit and date. The
README's small results table is one, so its numbers are never copied by hand.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "results" / "data"
# The documents whose tables are generated, relative to the repository root.
DOCUMENTS = ("README.md", "results/README.md", "ports/fastrope/DESIGN.md")
BLOCK = re.compile(r"<!-- table:(?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /table -->", re.S)
_RULE = {"": "---", "left": ":---", "right": "---:", "center": ":---:"}


def load(data_dir: Path = DATA) -> dict[str, dict]:
    """Every data file by its stem."""
    paths = sorted(data_dir.glob("*.json"))
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in paths}


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _view(spec: dict, tables: dict[str, dict]) -> tuple[list[str], list[list[str]], str]:
    view = spec["view"]
    source = tables[view["source"]]
    cols = [source["columns"].index(c) for c in view["columns"]]
    by_first = {r[0]: r for r in source["rows"]}
    missing = [r for r in view["rows"] if r not in by_first]
    if missing:
        raise KeyError(f"view of {view['source']}: no rows {missing}")
    rows = [[by_first[r][i] for i in cols] for r in view["rows"]]
    command = source["command"]
    command = command if isinstance(command, str) else "; ".join(command)
    caption = spec["caption"].format(
        gpu=source["gpu"], driver=source["driver"], commit=source["commit"], date=source["date"],
        command=command, source=view["source"])
    return view["columns"], rows, caption


def render(name: str, tables: dict[str, dict]) -> str:
    """The markdown that belongs between NAME's markers (ends with a newline)."""
    spec = tables[name]
    caption = ""
    if "view" in spec:
        columns, rows, caption = _view(spec, tables)
        align = [""] * len(columns)
    else:
        columns, rows = spec["columns"], spec["rows"]
        align = spec.get("align") or [""] * len(columns)
    lines = []
    if caption:  # wrapped: the README keeps prose lines short
        lines = [textwrap.fill(caption, 110, break_long_words=False, break_on_hyphens=False), ""]
    lines += [_row(columns), _row([_RULE[a] for a in align])] + [_row(r) for r in rows]
    return "\n".join(lines) + "\n"


def regenerate(text: str, tables: dict[str, dict]) -> str:
    """TEXT with every marked table rendered from its data; an unknown name raises KeyError."""
    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in tables:
            raise KeyError(f"no data file results/data/{name}.json for the table marked {name!r}")
        return f"<!-- table:{name} -->\n{render(name, tables)}<!-- /table -->"
    return BLOCK.sub(fill, text)


def quoted(text: str) -> list[str]:
    """The names of the tables a document quotes, in order."""
    return [m.group("name") for m in BLOCK.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a document's tables differ from their data")
    args = parser.parse_args(argv)
    tables = load()
    stale = []
    for doc in DOCUMENTS:
        path = ROOT / doc
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        new = regenerate(text, tables)
        if new != text:
            stale.append(doc)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print(f"stale tables in {', '.join(stale)}: run python -m tools.results_tables",
              file=sys.stderr)
        return 1
    print(f"{'stale' if args.check else 'rewrote'}: {', '.join(stale) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
