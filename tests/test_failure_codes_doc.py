"""docs/failure-codes.md is generated from the knowledge base and errors, and nothing points outside
the repository for it."""

from __future__ import annotations

import io
import re
import subprocess
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from gpuwarden.cli import build_parser, main
from gpuwarden.errors import GPUWARDEN_CODES
from gpuwarden.explain import load_knowledge
from gpuwarden.explain.reference import failure_codes_markdown

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "failure-codes.md"


def test_the_committed_reference_is_what_the_knowledge_base_generates() -> None:
    assert DOC.read_text(encoding="utf-8") == failure_codes_markdown(), (
        "docs/failure-codes.md is out of date: run scripts/gen-failure-codes")


def test_every_code_has_cause_fix_and_what_to_look_at_next_in_the_reference() -> None:
    kb = load_knowledge()
    text = failure_codes_markdown(kb)
    for e in kb.entries:
        assert e.why and e.fix and e.next, f"{e.code}: the knowledge base needs why, fix and next"
        section = text[text.index(f"\n### {e.code}\n"):]
        section = section[:section.index("\n### ", 1)]
        for part in (e.why, e.fix, e.next, e.signatures[0].pattern.pattern):
            assert part in section, (e.code, part)
    for code, meaning in GPUWARDEN_CODES.items():
        assert f"| {code} | {meaning.replace('|', chr(92) + '|')} |" in text or code in kb.codes
    assert "\n### NONE\n" in text


@pytest.mark.slow
def test_the_check_mode_of_the_script_fails_on_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "failure-codes.md"
    stale.write_text("# Failure codes\n")
    script = ROOT / "scripts" / "gen-failure-codes"
    proc = subprocess.run([str(script), "--check", "--out", str(stale)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "out of date" in proc.stderr
    proc = subprocess.run([str(script), "--out", str(stale)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and stale.read_text() == DOC.read_text()


def test_readme_and_help_point_at_the_reference_inside_the_repository() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "(docs/failure-codes.md)" in readme
    parser = build_parser()
    assert "docs/failure-codes.md" in parser.format_help()
    explain = next(a for a in parser._subparsers._group_actions  # type: ignore[union-attr]
                   if a.dest == "command").choices["explain"]
    assert "docs/failure-codes.md" in explain.format_help()
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["explain", "--codes"]) == 0
    assert out.getvalue() == DOC.read_text()


def test_nothing_in_readme_docs_sources_or_help_points_outside_the_repository() -> None:
    texts = {p: p.read_text(encoding="utf-8") for p in
             [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "src").rglob("*.py"),
              *(ROOT / "src").rglob("*.toml")]}
    parser = build_parser()
    texts[Path("gpuwarden --help")] = parser.format_help()
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        for name, sub in (action.choices or {}).items():
            texts[Path(f"gpuwarden {name} --help")] = sub.format_help()
    # the project's shared brief folder (../shared: failure-codes.md, scenarios/, STYLE.md)
    outside = re.compile(r"\.\./shared|(?<![\w.-])shared/(?:failure-codes|scenarios|[A-Z]+\.md)")
    bad = [f"{p}: {m.group(0)}" for p, t in texts.items() for m in outside.finditer(t)]
    assert not bad, bad


@pytest.mark.slow
def test_every_module_with_an_error_class_is_imported_by_the_generator() -> None:
    """The reference lists the classes that carry each code by walking the subclasses of
    GpuwardenError, so a class in a module nobody imported would be missing or present by
    chance (the page then depends on test order): every such module is in _ERROR_MODULES."""
    import ast

    from gpuwarden.explain.reference import _ERROR_MODULES

    src = ROOT / "src"
    known = {"GpuwardenError"}
    defined: dict[str, str] = {}
    trees = {path: ast.parse(path.read_text()) for path in (src / "gpuwarden").rglob("*.py")}
    grew = True
    while grew:  # subclasses of subclasses, across modules, by name
        grew = False
        for path, tree in trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in known and any(
                        (b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")) in known
                        for b in node.bases):
                    known.add(node.name)
                    defined[node.name] = ".".join(path.relative_to(src).with_suffix("").parts)
                    grew = True
    outside = {mod for mod in defined.values() if mod != "gpuwarden.errors"}
    assert outside <= set(_ERROR_MODULES), sorted(outside - set(_ERROR_MODULES))
