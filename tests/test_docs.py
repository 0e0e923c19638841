"""The shipped prose reads easily and its links lead somewhere: README.md, CHANGELOG.md, every page under docs/ and
every README under results/ keep their sentences short, README.md stays a front page, and relative links resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

LONGEST = 60  # words: no sentence may be longer
LONG = 40  # words: a sentence over this is long ...
LONG_SHARE = 0.05  # ... and at most this share of a file's sentences may be
README_LINES = 250

PAGES = sorted(
    [
        REPO / "README.md",
        REPO / "CHANGELOG.md",
        *(REPO / "docs").glob("**/*.md"),
        *(REPO / "results").glob("**/README.md"),
    ],
    key=lambda path: str(path.relative_to(REPO)),
)
BEING_REWRITTEN = {"results/README.md": "results/README.md is being rewritten"}

_LIST_ITEM = re.compile(r"\s*(?:[-*]|\d+\.)\s")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_LINK_DEFINITION = re.compile(r"\s{0,3}\[[^\]]+\]:\s")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def units(markdown: str) -> list[str]:
    """The prose of a Markdown page as units: each paragraph and each list item (without its marker, with its
    indented continuation lines) joined into one line. Code blocks, tables, headings, HTML comments and link
    definitions are not prose."""
    text = re.sub(r"<!--.*?-->", "", markdown, flags=re.DOTALL)
    found: list[list[str]] = []
    current: list[str] | None = None
    in_list_item = False
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            current = None
            continue
        if fenced:
            continue
        stripped = line.strip()
        if not stripped or stripped.startswith(("|", "#")) or _LINK_DEFINITION.match(line):
            current = None
            continue
        if item := _LIST_ITEM.match(line):
            current, in_list_item = [line[item.end() :].strip()], True
            found.append(current)
        elif current is not None and (not in_list_item or line[:1].isspace()):
            current.append(stripped)
        else:
            current, in_list_item = [stripped], False
            found.append(current)
    return [" ".join(lines) for lines in found]


def sentences(unit: str) -> list[str]:
    """A unit's sentences: an inline code span counts as one word and a link as its text; a sentence ends after
    `.`, `!` or `?` followed by whitespace or the end."""
    plain = _LINK.sub(r"\1", _CODE_SPAN.sub("CODE", unit))
    return [sentence for sentence in _SENTENCE_END.split(plain) if sentence.strip()]


def prose_sentences(path: Path) -> list[str]:
    return [sentence for unit in units(path.read_text()) for sentence in sentences(unit)]


def words(sentence: str) -> int:
    return len(sentence.split())


def _page_param(path: Path):
    name = str(path.relative_to(REPO))
    if name in BEING_REWRITTEN and not _reads_easily(path):
        return pytest.param(path, id=name, marks=pytest.mark.xfail(strict=True, reason=BEING_REWRITTEN[name]))
    return pytest.param(path, id=name)


def _reads_easily(path: Path) -> bool:
    lengths = [words(sentence) for sentence in prose_sentences(path)]
    return max(lengths, default=0) <= LONGEST and sum(n > LONG for n in lengths) <= LONG_SHARE * len(lengths)


def test_the_sentence_rule_drops_what_is_not_prose_and_splits_the_rest():
    page = (
        "# A heading that is long enough to count as a sentence if it were prose\n\n"
        "First sentence with `a long code span` and [a link](x.md). Second one!\n"
        "continued here? Yes.\n\n"
        "- an item\n  that continues.\n- another item\n"
        "| a | table |\n<!-- a comment. -->\n[ref]: https://example.com\n\n"
        "```bash\nnot prose. at all.\n```\n"
    )
    found = [sentence for unit in units(page) for sentence in sentences(unit)]
    assert found == [
        "First sentence with CODE and a link.",
        "Second one!",
        "continued here?",
        "Yes.",
        "an item that continues.",
        "another item",
    ]


@pytest.mark.parametrize("path", [_page_param(path) for path in PAGES])
def test_no_sentence_of_shipped_prose_is_over_60_words(path):
    too_long = [sentence for sentence in prose_sentences(path) if words(sentence) > LONGEST]
    longest = max(too_long, key=words, default="")
    assert not too_long, f"{path.relative_to(REPO)}: {len(too_long)} over {LONGEST} words, {words(longest)}: {longest}"


@pytest.mark.parametrize("path", [_page_param(path) for path in PAGES])
def test_at_most_5_percent_of_a_pages_sentences_are_over_40_words(path):
    found = prose_sentences(path)
    long = [sentence for sentence in found if words(sentence) > LONG]
    assert len(long) <= LONG_SHARE * len(found), (
        f"{path.relative_to(REPO)}: {len(long)} of {len(found)} sentences over {LONG} words, "
        f"the longest ({max(map(words, long))} words): {max(long, key=words)}"
    )


def test_the_readme_is_a_front_page_of_at_most_250_lines():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines; move detail to docs/"


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    targets = [match.group(1) for match in re.finditer(r"\]\(([^)\s]+)\)", text)]
    return [target for target in targets if not re.match(r"[a-z]+:", target)]


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    headings = re.findall(r"^#+\s+(.*)$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def _leads_nowhere(path: Path, target: str) -> bool:
    file, _, anchor = target.partition("#")
    page = (path.parent / file).resolve() if file else path
    if not page.exists():
        return True
    return bool(anchor) and page.suffix == ".md" and anchor not in _anchors(page)


DOC_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md")), REPO / "CHANGELOG.md"]


@pytest.mark.parametrize("path", DOC_PAGES, ids=lambda path: str(path.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(path):
    dead = [target for target in _relative_links(path) if _leads_nowhere(path, target)]
    assert not dead, f"{path.relative_to(REPO)} links to missing files or headings: {dead}"


def test_every_registered_policy_has_its_row_in_the_policies_table_and_its_config():
    """Adding a policy is its file, its config, its tests and its row in docs/policies.md: the registry finds the
    file, and this proves the row and the config are there (and that no row names a policy that is not)."""
    from h2o_eval.policies import POLICIES

    page = (REPO / "docs" / "policies.md").read_text()
    table = page[page.index("## The policies") :].split("\n\n", 2)[1]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|", table, flags=re.MULTILINE)
    assert sorted(rows) == sorted(POLICIES), "docs/policies.md's table and the policies in h2o_eval/policies/ differ"
    configs = {path.stem for path in (REPO / "conf" / "policy").glob("*.yaml")}
    assert configs == set(POLICIES), "conf/policy/ and the policies in h2o_eval/policies/ differ"


def test_the_readme_and_the_leaderboard_page_count_the_policies_and_name_each_as_the_preset_sweeps_it():
    """README's count is the registry's; the leaderboard page names every policy, those the preset sweeps first, and
    both state the preset's share of them."""
    import yaml

    from h2o_eval.conf import listed
    from h2o_eval.policies import POLICIES

    preset = yaml.safe_load((REPO / "conf" / "experiment" / "kv_leaderboard.yaml").read_text())
    swept = preset["hydra"]["sweeper"]["params"]["policy"].split(",")
    readme, board = ((REPO / name).read_text() for name in ("README.md", "docs/leaderboard.md"))
    share = f"{len(swept)} of the {len(POLICIES)} policies"
    assert f"the {len(POLICIES)} policies of" in readme and share in readme.replace("\n", " ") and share in board
    typed = listed("policy")  # the names policy= takes, as a refusal lists them
    presets = len(typed) - len(POLICIES)
    assert f"`policy=` takes {len(typed)} names, those {len(POLICIES)} and {presets} presets" in readme
    section = board[board.index("## The policies it sweeps") : board.index("## A smoke test")]
    sweeps, rest = section.split(f"Of the {len(POLICIES)},")
    assert set(re.findall(r"`([a-z_0-9/]+)`", sweeps)) == set(swept)
    assert set(POLICIES) - set(swept) <= set(re.findall(r"`([a-z_0-9/]+)`", rest))
