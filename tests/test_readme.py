"""The README's and the docs pages' Python examples run as written (on this machine's adapter, in a
scratch directory), so the documentation keeps matching the code. The pages share one namespace, as
a reader's session would: a block that uses a name an earlier block (of any page) defines is run
after it, whatever its place in the text. Links between the pages lead somewhere, and every result
file under benches/results is cited by a document."""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
GUIDES = [README, *sorted(DOCS.glob("*.md")), ROOT / "benches" / "README.md"]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)


def test_readme_and_docs_python_examples_run(tmp_path, capsys):
    blocks = [(page, i, code) for page in GUIDES for i, code in enumerate(python_blocks(page))]
    assert len(python_blocks(README)) >= 1 and len(blocks) >= 10
    namespace: dict = {}
    pending = blocks
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        while pending:
            waiting = []
            for page, i, code in pending:
                try:
                    exec(compile(code, f"{page.relative_to(ROOT)} python block {i + 1}", "exec"), namespace)
                except NameError:
                    waiting.append((page, i, code))
            assert len(waiting) < len(pending), \
                f"blocks {[(str(p.relative_to(ROOT)), i + 1) for p, i, _ in waiting]} use names no block defines"
            pending = waiting
    finally:
        os.chdir(cwd)
    out = capsys.readouterr().out
    assert "backward of rmsnorm: kernel rmsnorm_bwd_d_x" in out and "6.5" in out
    assert "bad.lk:2:13: unknown name 'q'" in out
    assert "CacheStats(hits=1, misses=1" in out


def test_readme_opens_with_the_two_commands_and_stays_a_guide():
    text = README.read_text()
    assert text.split("```bash\n", 1)[1].startswith("bash scripts/run-main.sh ")
    assert "\nbash scripts/run-tests.sh " in text.split("```", 3)[1]
    assert len(text.splitlines()) <= 250


def test_links_between_the_guides_lead_somewhere():
    for page in GUIDES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}, which is not there"
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", README.read_text()))
    assert linked == {p.name for p in DOCS.glob("*.md")}, "every docs page is linked from the README"


def test_every_result_file_is_cited_and_every_cited_one_is_there():
    texts = "\n".join(p.read_text() for p in GUIDES)
    results = ROOT / "benches" / "results"
    for f in results.iterdir():
        assert f.name in texts, f"benches/results/{f.name} is cited by no document"
    for page in GUIDES:
        for name in re.findall(r"results/([\w.]+\.(?:json|log))", page.read_text()):
            assert (results / name).exists(), f"{page.relative_to(ROOT)} cites results/{name}, which is not there"


def test_the_fuzzer_command_the_docs_give_is_the_fuzzers():
    """The fuzzer left the library for tests/fuzz: the docs give its command there."""
    assert (ROOT / "tests" / "fuzz" / "__main__.py").exists()
    text = "\n".join(p.read_text() for p in GUIDES)
    assert "python -m tests.fuzz N" in text and "lfm2jit fuzz" not in text


def _help(*command: str) -> str:
    import subprocess
    import sys
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", *command, "--help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))


def test_cli_page_lists_every_trainer_flag_and_no_other():
    """docs/cli.md's table of `python -m trainer` flags is the parser's: none missing, none made up."""
    page = (DOCS / "cli.md").read_text()
    table = page.split("## `python -m trainer`", 1)[1].split("Flags given with", 1)[0]
    options = _help("trainer").split("\nexamples:", 1)[0]      # the epilog's examples name generate's flags too
    assert _flags(table) == _flags(options) - {"--help"}


def test_cli_page_names_only_flags_generate_and_eval_have():
    page = (DOCS / "cli.md").read_text()
    section = page.split("## `python -m trainer generate` and `eval`", 1)[1].split("## `python -m lfm2jit`", 1)[0]
    known = _flags(_help("trainer", "generate")) | _flags(_help("trainer", "eval"))
    assert _flags(section) <= known, _flags(section) - known


def test_environment_table_is_settings():
    """Every LFM2JIT_ variable lfm2jit/settings.py reads is in docs/cli.md's table, and nothing else is."""
    page = (DOCS / "cli.md").read_text().split("## Environment variables", 1)[1]
    documented = set(re.findall(r"^\| `(LFM2JIT_[A-Z_]+)`", page, re.M))
    read = set(re.findall(r"\"(LFM2JIT_[A-Z_]+)\"", (ROOT / "lfm2jit" / "settings.py").read_text()))
    assert documented == read


def test_shipped_kernels_the_language_page_names_are_shipped():
    from lfm2jit.ops import library
    page = (DOCS / "kernel-language.md").read_text()
    paragraph = page.split("The shipped kernels (`python -m lfm2jit list`)", 1)[1].split("\n\n", 1)[0]
    named = {n for n in re.findall(r"`([a-z][a-z0-9_]+)`", paragraph)}
    assert len(named) >= 15 and named <= set(library.kernels()), named - set(library.kernels())


def test_files_the_guides_name_are_there():
    """A path in backticks that starts at the checkout's top (or inside lfm2jit/) names a file that exists."""
    tops = ("lfm2jit/", "trainer/", "tests/", "benches/", "templates/", "scripts/")
    inside = ("ops/", "ir/", "schedule/", "runtime/", "codegen/", "dsl/", "tune/", "model/")
    for page in GUIDES:
        for path in set(re.findall(r"`([\w./-]+/[\w.-]+\.(?:py|lk|lark|j2|sh|json|log|md))`", page.read_text())):
            if path.startswith(tops):
                assert (ROOT / path).exists(), f"{page.relative_to(ROOT)} names {path}, which is not there"
            elif path.startswith(inside):
                assert (ROOT / "lfm2jit" / path).exists(), f"{page.relative_to(ROOT)} names {path}, which is not there"


def test_design_page_table_of_templates_is_the_templates_directory():
    page = (DOCS / "design.md").read_text().split("## Parts and templates", 1)[1].split("\n\n", 2)[2]
    table = page.split("\n\n", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", "\n".join(line.split("|")[1] for line in table.splitlines()[2:])))
    shipped = {p.name[:-len(".wgsl.j2")] for p in (ROOT / "templates").glob("[!_]*.wgsl.j2")}
    assert named == shipped
