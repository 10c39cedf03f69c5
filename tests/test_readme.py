"""The README and docs/ against the code: the options table lists exactly the fields of `Options`
(environment variable, values, default), the environment switches table lists exactly the other
`SEQFAST_*` variables the package reads, the quick-start commands `.ci/run` runs are near the top,
and every relative link resolves to a file and, with a `#anchor`, to a heading there."""

import dataclasses
import re
from pathlib import Path

import pytest

from seqcompile.ops.registry import implementations_offered
from seqcompile.options import Budget, OptionError, Options

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
OPTIONS_HEADER = ["option", "environment", "values", "default", "effect"]
SWITCHES_HEADER = ["variable", "effect"]


def without_code_blocks(text: str) -> str:
    """`text` with fenced code blocks blanked (line count kept), so their lines are not read as
    tables or links."""
    return re.sub(r"```.*?```", lambda m: "\n" * m[0].count("\n"), text, flags=re.DOTALL)


def tables(path: Path) -> list[tuple[list[str], list[list[str]]]]:
    """Each markdown table in `path`: its header cells and its rows' cells."""
    found, current = [], None
    for line in without_code_blocks(path.read_text()).splitlines():
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if current is None:
                current = (cells, [])
                found.append(current)
            elif not all(re.fullmatch(r":?-+:?", cell) for cell in cells):
                current[1].append(cells)
        else:
            current = None
    return found


def the_table(header: list[str]) -> tuple[Path, list[dict[str, str]]]:
    """The one table in the README or docs/ with `header`, as rows by column name."""
    hits = [(path, rows) for path in PAGES for head, rows in tables(path) if head == header]
    assert len(hits) == 1, f"{len(hits)} tables headed {header} in README.md and docs/"
    path, rows = hits[0]
    return path, [dict(zip(header, row, strict=True)) for row in rows]


def code(cell: str) -> str:
    """The text of a cell that is one code span: `` `x` `` -> x."""
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match, f"expected one code span, got {cell!r}"
    return match[1]


def rendered(value: object) -> str:
    """A default as the table writes it: `"auto"` for strings, 1.0 for the whole budget."""
    if isinstance(value, Budget):
        return repr(value.fraction) if value.size is None else str(value.size)
    if isinstance(value, str):
        return f'`"{value}"`'
    return repr(value)


def choices(name: str) -> set[str] | None:
    """The values a choice option takes, from the error a bad value gets; None for an option that
    is not a choice."""
    with pytest.raises(OptionError) as error:
        Options.resolve({name: ["not a value"]}, environ={})
    message = str(error.value)
    if "must be one of" not in message:
        return None
    listed = message.split("must be one of", 1)[1].split(";", 1)[0]
    found = set(re.findall(r"'([^']*)'", listed))
    return found | ({"None"} if " or None" in listed else set())


OPTION_ROWS = the_table(OPTIONS_HEADER)[1]
FIELDS = {field.name: field for field in dataclasses.fields(Options)}


def test_the_options_table_lists_every_option_once_in_the_readme():
    path, rows = the_table(OPTIONS_HEADER)
    assert path == README
    names = [code(row["option"]) for row in rows]
    assert sorted(names) == sorted(FIELDS), "the README's options table and Options differ"
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("row", OPTION_ROWS, ids=lambda row: row["option"].strip("`"))
def test_an_option_row_gives_the_code_s_variable_values_and_default(row):
    name = code(row["option"])
    field = FIELDS[name]
    assert code(row["environment"]) == f"SEQFAST_{name.upper()}"
    default = Options.resolve({}, environ={}).__getattribute__(name)
    made = field.default_factory if field.default is dataclasses.MISSING else None
    assert default == (made() if made else field.default)
    assert re.split(r"[:;]", row["default"])[0].strip() == rendered(default)

    values = row["values"]
    type_ = str(field.type)
    expected = choices(name)
    if expected is not None:
        listed = {v.strip().strip("`").strip('"') for v in values.split(",")}
        assert listed == expected, f"{name}: the table lists {listed}, the code takes {expected}"
    elif type_ == "bool":
        assert values == "bool"
        for value in ("1", "0", True, False):
            Options.resolve({name: value}, environ={})
    elif type_ == "int":
        assert values == "int >= 0"
        assert Options.resolve({name: 0}, environ={}).__getattribute__(name) == 0
        with pytest.raises(OptionError):
            Options.resolve({name: -1}, environ={})
    elif type_ == "Budget":
        assert "a fraction in (0, 1]" in values and "a number of bytes" in values
        for size in re.findall(r'`"([^"`]+)"`', values):
            assert Options.resolve({name: size}, environ={}).memory_budget.size
        assert Options.resolve({name: 0.5}, environ={}).memory_budget.fraction == 0.5
    elif type_ == "Mapping[str, str]":  # implementations: per operator or family
        offered = {i for names in implementations_offered().values() for i in names}
        assert set(re.findall(r'`"(\w+)"`', values)) == {"auto", *offered}
        (example,) = re.findall(r'`"(\w+=[^"`]+)"`', values)
        assert Options.resolve({}, environ={f"SEQFAST_{name.upper()}": example}).__getattribute__(
            name
        )
    else:
        assert type_ == "str | None" and values == "a directory", f"{name}: {type_}, {values}"

    # The variable the table names is the one the code reads.
    environ = {f"SEQFAST_{name.upper()}": "?not a value?"}
    if expected is not None or type_ != "str | None":
        with pytest.raises(OptionError, match=f"SEQFAST_{name.upper()}"):
            Options.resolve({}, environ=environ)


def seqfast_variables_in_the_package() -> set[str]:
    """Every `SEQFAST_*` name the package's source mentions."""
    names = set()
    for source in (ROOT / "seqcompile").rglob("*.py"):
        names |= set(re.findall(r"\bSEQFAST_[A-Z][A-Z0-9_]*[A-Z0-9]\b", source.read_text()))
    return names


def test_the_switches_table_lists_the_variables_that_are_not_options():
    path, rows = the_table(SWITCHES_HEADER)
    assert path == ROOT / "docs" / "debugging.md"
    listed = [re.fullmatch(r"`(SEQFAST_[A-Z_]+)=[^`]*`", row["variable"]) for row in rows]
    assert all(listed), [row["variable"] for row in rows]
    listed = [match[1] for match in listed]
    options = {f"SEQFAST_{name.upper()}" for name in FIELDS}
    assert sorted(listed) == sorted(seqfast_variables_in_the_package() - options)


def test_the_quick_start_commands_ci_runs_are_in_the_first_40_lines():
    """`.ci/run` runs the README's lines that match these, exactly as written."""
    lines = README.read_text().splitlines()
    for command in ("seqcompile demo", "pytest"):
        pattern = re.compile(rf"^pip install .* && python -m {command}$")
        hits = [i for i, line in enumerate(lines) if pattern.match(line)]
        assert hits and hits[0] < 40, f"the {command!r} command is not in the first 40 lines"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = without_code_blocks(path.read_text())
    return {slug(m[1]) for m in re.finditer(r"^#{1,6} +(.+?) *$", text, flags=re.MULTILINE)}


def links(path: Path) -> list[str]:
    """The targets of the relative links and images in `path`, outside code."""
    text = re.sub(r"`[^`\n]*`", "", without_code_blocks(path.read_text()))
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file_and_a_heading(page):
    broken = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        destination = (page.parent / file).resolve() if file else page
        if not destination.exists():
            broken.append(f"{target}: no file {destination}")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README)}
    orphans = [page.name for page in DOCS if page.resolve() not in linked]
    assert not orphans, f"docs pages the README does not link: {orphans}"
