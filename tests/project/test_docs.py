"""The docs: every relative link of every tracked Markdown file resolves, README.md stays a
README (short, and opening with the two commands), every citation of the design in the code
names one of its headings, and every path and symbol the design and the walk name exists.

The design is ``docs/design.md``. Code cites it in one form only, the file and a heading
exactly as written there, in double quotes, after a comma::

    docs/design.md, "Ranks (tensor parallelism)"

A citation may break across lines of a comment or docstring (the line break, its indent and
a comment's ``#`` read as one space). Any other mention of ``design.md`` in the product's
code (``DESIGN.md "Ranks"``, a heading that does not exist) fails the test. A path in
backticks in ``docs/design.md`` or ``docs/request-walk.md`` that starts with a folder of the
repository must exist, and each hop of the walk (``N. `path.py` `Symbol`: ...``) must name a
function, class or method (``Class.method``) defined in that file, so neither page can go
stale without a test failing.

Only ``[text](target)`` links, images and ``[ref]: target`` definitions are links; a path
in backticks is code, not a link, and nothing inside a code span or a fenced block is read.
A target that names a scheme (``https:``, ``mailto:``) is left alone. A relative target
must name an existing file or folder, relative to the Markdown file (or to the repository
root when it starts with ``/``, as GitHub reads it); its anchor ``#x``, where the target is
a Markdown file, must be the GitHub-style slug of one of that file's ATX headings.
Pure standard library: no network, no package of the project imported.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
README_COMMANDS_WITHIN = 40  # lines: CI and the hook look for both commands this early

_FENCE = re.compile(r"^ *(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+).+?\1")
_INLINE_LINK = re.compile(r"\[[^\]]*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REF_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


class Link(NamedTuple):
    line: int  # 1-based line of the Markdown file
    target: str  # as written, without angle brackets


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    out: list[tuple[int, str]] = []
    fence = ""
    for number, line in enumerate(text.splitlines(), start=1):
        opening = _FENCE.match(line)
        if fence:
            closing = opening and opening.group(1).startswith(fence)
            if closing and not line.strip().lstrip(fence[0]):
                fence = ""
            continue
        if opening:
            fence = opening.group(1)
            continue
        out.append((number, line))
    return out


def links(text: str) -> list[Link]:
    """Every inline link, image and reference definition outside code, in order."""
    found: list[Link] = []
    for number, line in prose_lines(text):
        line = _CODE_SPAN.sub("", line)  # noqa: PLW2901 (a code span holds no link)
        targets = [m.group(1) for m in _INLINE_LINK.finditer(line)]
        definition = _REF_DEFINITION.match(line)
        if definition:
            targets.append(definition.group(1))
        found.extend(Link(number, t.removeprefix("<").removesuffix(">")) for t in targets)
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text, lower case, punctuation
    dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link reads as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"\*\*|\*|~~", "", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown file's ATX headings; a repeated slug gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(root: Path, files: list[Path]) -> list[str]:
    """``path:line: target: why`` for every link of ``files`` that does not resolve."""
    problems = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for link in links(text):
            if _SCHEME.match(link.target) or link.target.startswith("//"):
                continue
            where = f"{path.relative_to(root)}:{link.line}: {link.target}"
            file_part, _, anchor = link.target.partition("#")
            file_part = unquote(file_part)
            if not file_part:
                target = path
            elif file_part.startswith("/"):
                target = root / file_part.lstrip("/")
            else:
                target = path.parent / file_part
            if not target.exists():
                problems.append(f"{where}: no such file")
            elif anchor and target.suffix == ".md" and target.is_file():
                headings = anchors(target.read_text(encoding="utf-8"))
                if unquote(anchor) not in headings:
                    problems.append(f"{where}: no heading #{anchor} in {target.name}")
    return problems


def tracked_markdown(root: Path) -> list[Path]:
    """The repository's tracked ``*.md`` files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", "*.md"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return [root / name for name in listed.split("\0") if name]


def test_every_relative_link_of_every_tracked_markdown_file_resolves():
    files = tracked_markdown(ROOT)
    assert ROOT / "README.md" in files
    problems = broken_links(ROOT, files)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_is_short_and_opens_with_the_two_commands_in_code_blocks():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    head = lines[:README_COMMANDS_WITHIN]
    # Two fenced blocks and nothing else before them: ``` / scripts/main / ``` / ``` / ...
    fences = [i for i, line in enumerate(head) if _FENCE.match(line)]
    assert fences[:1] == [0], "README.md must open with a fenced code block"
    assert len(fences) >= 4, "README.md must open with two fenced code blocks"
    first = head[fences[0] + 1 : fences[1]]
    second = head[fences[2] + 1 : fences[3]]
    assert not "".join(head[fences[1] + 1 : fences[2]]).strip(), "text between the blocks"
    assert first and first[0].startswith("scripts/main"), first
    assert second and second[0].startswith("scripts/test"), second


def test_the_checker_reports_a_broken_link_by_file_and_line(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## The `launch` command\n")
    (tmp_path / "README.md").write_text(
        "# Top\n"  # 1
        "\n"  # 2
        "See [other](docs/other.md) and [its section](docs/other.md#the-launch-command).\n"  # 3
        "A [missing file](docs/gone.md) and a [missing heading](docs/other.md#nope).\n"  # 4
        "Back to [the top](#top), to [nowhere](#nowhere), to [the web](https://example.com).\n"
        "A path in backticks is code: `docs/gone.md`, `[x](docs/gone.md)`.\n"  # 6
        "```sh\n"  # 7
        "[inside a fence](docs/gone.md)\n"  # 8
        "```\n"  # 9
        "[ref]: ./docs/absent.md\n"  # 10
    )
    files = [tmp_path / "README.md", tmp_path / "docs" / "other.md"]
    assert broken_links(tmp_path, files) == [
        "README.md:4: docs/gone.md: no such file",
        "README.md:4: docs/other.md#nope: no heading #nope in other.md",
        "README.md:5: #nowhere: no heading #nowhere in README.md",
        "README.md:10: ./docs/absent.md: no such file",
    ]


def test_slugs_are_githubs():
    assert slug("What the fences buy (`ringfence bench e2e`)") == (
        "what-the-fences-buy-ringfence-bench-e2e"
    )
    assert slug("`ringfence launch`") == "ringfence-launch"
    assert slug("GPU check (`scripts/device-check`), torch 2.11.0+cu130, 2026-11-27") == (
        "gpu-check-scriptsdevice-check-torch-2110cu130-2026-11-27"
    )
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1", "a-2"}


# --- The design and the walk: citations, paths and symbols -------------------------------------

DESIGN = "docs/design.md"
WALK = "docs/request-walk.md"
PRODUCT = ("runtime", "actors", "shm", "cache", "sched")  # the five code folders
FOLDERS = (*PRODUCT, "tests", "scripts", "docs")  # a backticked path starting so must exist
_MENTION = re.compile(r"design\.md", re.IGNORECASE)
_CITATION = re.compile(r'docs/design\.md, "([^"]+)"')
_BREAK = re.compile(r"[ \t]*\n[ \t]*(?:#[ \t]*)?")  # a line break inside a comment or docstring
_PATH = re.compile(rf"^(?:{'|'.join(FOLDERS)})/[\w./-]*$")
_HOP = re.compile(r"^\d+\. `([^`]+)` `([^`]+)`:")


def headings(text: str) -> set[str]:
    """The text of every ATX heading of a Markdown file, as written."""
    return {m.group(2) for _, line in prose_lines(text) if (m := _HEADING.match(line))}


def bad_citations(root: Path, files: list[Path], names: set[str]) -> list[str]:
    """``path:line: problem`` for every mention of ``design.md`` in ``files`` that is not a
    citation of one of the headings ``names``."""
    problems = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for mention in _MENTION.finditer(text):
            start = max(mention.start() - len("docs/"), 0)
            window = _BREAK.sub(" ", text[start : mention.end() + 300])
            line = text.count("\n", 0, mention.start()) + 1
            where = f"{path.relative_to(root)}:{line}"
            cited = _CITATION.match(window)
            if cited is None:
                rest = text[mention.start() :].partition("\n")[0]
                shown = rest.partition(")")[0][:60].rstrip()  # the mention, on its own line
                problems.append(f'{where}: {shown!r}: cite as {DESIGN}, "<a heading of it>"')
            elif cited.group(1) not in names:
                problems.append(f'{where}: {DESIGN} has no heading "{cited.group(1)}"')
    return problems


def product_sources(root: Path) -> list[Path]:
    return sorted(p for folder in PRODUCT for p in (root / folder).rglob("*.py"))


def missing_paths(root: Path, page: Path) -> list[str]:
    """``page:line: path`` for every repository path in backticks on ``page`` that does not
    exist."""
    problems = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for span in re.findall(r"`([^`]+)`", line):
            if _PATH.match(span) and not (root / span).exists():
                problems.append(f"{page.relative_to(root)}:{number}: {span}: no such path")
    return problems


def _defines(text: str, name: str) -> bool:
    """Whether ``text`` defines a function, method or class ``name`` (at any depth)."""
    pattern = rf"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+{re.escape(name)}\b"
    return re.search(pattern, text, re.MULTILINE) is not None


def missing_symbols(root: Path, page: Path) -> list[str]:
    """``page:line: path Symbol`` for every hop of a walk whose symbol its file does not define."""
    problems = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        hop = _HOP.match(line)
        if hop is None:
            continue
        path, symbol = hop.groups()
        source = root / path
        text = source.read_text(encoding="utf-8") if source.is_file() else ""
        undefined = [name for name in symbol.split(".") if not _defines(text, name)]
        if undefined:
            why = "no such file" if not text else f"defines no {undefined[0]}"
            problems.append(f"{page.relative_to(root)}:{number}: {path} {symbol}: {why}")
    return problems


def test_every_citation_of_the_design_in_the_code_names_one_of_its_headings():
    names = headings((ROOT / DESIGN).read_text(encoding="utf-8"))
    problems = bad_citations(ROOT, product_sources(ROOT), names)
    assert not problems, "citations of the design:\n" + "\n".join(problems)


def test_the_code_cites_the_design():
    cited = [p for p in product_sources(ROOT) if _MENTION.search(p.read_text(encoding="utf-8"))]
    assert len(cited) >= 20, f"only {len(cited)} product modules cite {DESIGN}"


def test_every_path_the_design_and_the_walk_name_exists():
    problems = [*missing_paths(ROOT, ROOT / DESIGN), *missing_paths(ROOT, ROOT / WALK)]
    assert not problems, "\n".join(problems)


def test_every_hop_of_the_walk_names_a_symbol_its_file_defines():
    walk = ROOT / WALK
    assert len([line for _, line in prose_lines(walk.read_text()) if _HOP.match(line)]) >= 40
    problems = missing_symbols(ROOT, walk)
    assert not problems, "\n".join(problems)


def test_a_citation_not_in_the_form_or_of_no_heading_is_named_by_file_and_line(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "a.py").write_text(
        '"""Keys (docs/design.md, "Blocks and tiers"), ranks (docs/design.md, "Ranks\n'
        '    (tensor parallelism)").\n"""\n'  # 1-3: both fine, the second across a line
        "# fenced (docs/design.md,\n"  # 4
        '#   "Invariants I1-I4")\n'  # 5: fine, across a comment's lines
        'X = 1  # DESIGN.md "Ranks"\n'  # 6: the old form
        '# see docs/design.md, "Instances"\n'  # 7: no such heading
        "# the argument in design.md\n"  # 8: no heading at all
    )
    names = {"Blocks and tiers", "Ranks (tensor parallelism)", "Invariants I1-I4"}
    assert bad_citations(tmp_path, [tmp_path / "cache" / "a.py"], names) == [
        'cache/a.py:6: \'DESIGN.md "Ranks"\': cite as docs/design.md, "<a heading of it>"',
        'cache/a.py:7: docs/design.md has no heading "Instances"',
        "cache/a.py:8: 'design.md': cite as docs/design.md, \"<a heading of it>\"",
    ]


def test_a_walk_naming_a_missing_file_path_or_symbol_is_named_by_line(tmp_path):
    (tmp_path / "sched").mkdir()
    (tmp_path / "sched" / "s.py").write_text(
        "class Scheduler:\n    def schedule(self):\n        async def inner(): ...\n"
    )
    page = tmp_path / "walk.md"
    page.write_text(
        "1. `sched/s.py` `Scheduler.schedule`: fine.\n"  # 1
        "2. `sched/s.py` `inner`: fine, a nested function.\n"  # 2
        "3. `sched/s.py` `Scheduler.add`: no such method.\n"  # 3
        "4. `sched/gone.py` `Scheduler`: no such file.\n"  # 4
        "See `sched/` and `runs/<id>/` (not a folder of the repository), `cache/x.py`.\n"  # 5
    )
    assert missing_symbols(tmp_path, page) == [
        "walk.md:3: sched/s.py Scheduler.add: defines no add",
        "walk.md:4: sched/gone.py Scheduler: no such file",
    ]
    assert missing_paths(tmp_path, page) == [
        "walk.md:4: sched/gone.py: no such path",
        "walk.md:5: cache/x.py: no such path",
    ]
