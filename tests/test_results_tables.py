"""The committed results tables are what their data files produce (tools/results_tables.py)."""
import json
import re

import pytest

from tools import results_tables as rt

TABLES = rt.load()
PROVENANCE = ("command", "commit", "gpu", "driver", "versions", "date")


@pytest.mark.parametrize("doc", rt.DOCUMENTS)
def test_committed_tables_match_their_data(doc):
    text = (rt.ROOT / doc).read_text(encoding="utf-8")
    regenerated = rt.regenerate(text, TABLES)
    stale = [n for n in rt.quoted(text)
             if f"<!-- table:{n} -->\n{rt.render(n, TABLES)}<!-- /table -->" not in text]
    assert regenerated == text, f"{doc}: {stale} differ from data: python -m tools.results_tables"


@pytest.mark.parametrize("name", sorted(TABLES))
def test_data_file_states_its_run(name):
    spec = TABLES[name]
    source = TABLES[spec["view"]["source"]] if "view" in spec else spec
    for key in PROVENANCE:
        assert source.get(key), f"{name}: no {key} (write 'not recorded' where the run has none)"
    assert re.fullmatch(r"2026-\d\d-\d\d|not recorded", source["date"]), source["date"]
    if "view" not in spec:
        width = len(spec["columns"])
        assert all(len(r) == width for r in spec["rows"]), f"{name}: a row's width differs"


def test_every_data_file_is_quoted():
    """A data file no document quotes is stale. DESIGN.md's tables count once its markers are in."""
    texts = [(rt.ROOT / doc).read_text(encoding="utf-8") for doc in rt.DOCUMENTS]
    quoted = {n for text in texts for n in rt.quoted(text)}
    design = "ports/fastrope/DESIGN.md"
    unquoted = {n for n in TABLES if n not in quoted and TABLES[n].get("document") != design}
    assert not unquoted, f"data files no document quotes: {sorted(unquoted)}"


def test_a_changed_cell_is_caught():
    """The check can fail: one edited cell makes the regenerated text differ."""
    name = next(n for n in TABLES if "view" not in TABLES[n])
    edited = json.loads(json.dumps(TABLES))
    edited[name]["rows"][0][-1] += "0"
    text = f"x\n<!-- table:{name} -->\n{rt.render(name, TABLES)}<!-- /table -->\n"
    assert rt.regenerate(text, TABLES) == text
    assert rt.regenerate(text, edited) != text


def test_unknown_table_name_raises():
    with pytest.raises(KeyError, match="no data file"):
        rt.regenerate("<!-- table:no-such-run -->\n<!-- /table -->", TABLES)


def test_check_mode_reports_stale(tmp_path, monkeypatch, capsys):
    doc = tmp_path / "README.md"
    name = next(iter(TABLES))
    doc.write_text(f"<!-- table:{name} -->\n| stale |\n<!-- /table -->\n", encoding="utf-8")
    monkeypatch.setattr(rt, "ROOT", tmp_path)
    monkeypatch.setattr(rt, "DOCUMENTS", ("README.md",))
    assert rt.main(["--check"]) == 1
    assert "stale tables in README.md" in capsys.readouterr().err
    assert rt.main([]) == 0 and rt.main(["--check"]) == 0


def notebook_headings() -> list[str]:
    """results/README.md's '## ' and '### ' headings after its contents, outside code blocks."""
    text = (rt.ROOT / "results" / "README.md").read_text(encoding="utf-8")
    body = text[text.index("\n## Contents\n") + 1:]
    headings, in_code = [], False
    for line in body.splitlines()[1:]:
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{2,3} ", line):
            headings.append(line.split(" ", 1)[1])
    return headings


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_notebook_sections_are_dated_in_order():
    dates = []
    for heading in notebook_headings():
        m = re.match(r"(2026-\d\d-\d\d): ", heading)
        assert m, f"results/README.md section without a date: {heading!r}"
        dates.append(m.group(1))
    assert dates == sorted(dates), "results/README.md's sections are not in date order"


def test_notebook_contents_lists_every_section():
    text = (rt.ROOT / "results" / "README.md").read_text(encoding="utf-8")
    contents = text[text.index("\n## Contents\n"):]
    contents = contents[:contents.index("\n## ", 1)]
    missing = [h for h in notebook_headings() if f"](#{anchor(h)})" not in contents]
    assert not missing, f"not in results/README.md's contents: {missing}"


def test_notebook_calls_nothing_final():
    text = (rt.ROOT / "results" / "README.md").read_text(encoding="utf-8")
    assert not re.search(r"\bfinal\b", text, re.I), "a run called final is stale at the next commit"
