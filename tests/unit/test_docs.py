"""The documentation, README.md and docs/*.md, builds and says only what works.

- Sphinx builds the site in strict mode: a warning (a broken link, a heading
  anchor that does not exist, a page left out of the table of contents)
  fails. The README's own links must reach a file, and a heading of the
  built site when they name one.
- Every configuration block declares what it is, in an HTML comment on the
  line before it (invisible on GitHub and in the site), and is checked as
  such:

  ``<!-- docs-test: rules -->``            ``sluice check`` accepts it
  ``<!-- docs-test: rls -->``              ``sluice check`` accepts it as a
                                           Rate Limit Service configuration
  ``<!-- docs-test: nginx CONTEXT -->``    ``nginx -t`` accepts it inside
                                           ``main``, ``http``, ``server`` or
                                           ``location``, with Sluice's
                                           snippets rendered beside it
  ``<!-- docs-test: envoy -->``            ``envoy --mode validate`` accepts
                                           it, Sluice's fragments pasted where
                                           its ``# sluice-*.yaml:`` comments say
  ``<!-- docs-test: kubernetes -->``       every object validates offline
                                           (``validate_manifest``)
  ``<!-- docs-test: skip REASON -->``      not checked, and the reason says why

  A ``yaml`` or ``nginx`` block without a declaration is refused.
"""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from devstack import launcher
from sidecar import cli
from tests.unit.deploy_files import validate_manifest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = REPO / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

# The languages whose blocks are configuration, and must say what they are.
CONFIGURATION_LANGUAGES = {"yaml", "nginx"}
DECLARATION = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->$")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<language>[\w-]*)\s*$")

# How a snippet of each context is wrapped into a whole nginx configuration.
NGINX_CONTEXTS = {
    "main": "{block}",
    "http": "http {{\n{block}\n}}",
    "server": "http {{\n    server {{\n        listen 127.0.0.1:8080;\n{block}\n    }}\n}}",
    "location": "http {{\n    server {{\n        listen 127.0.0.1:8080;\n"
                "        location / {{\n{block}\n        }}\n    }}\n}}",
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, counted from 1
    language: str
    declaration: str | None
    text: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def kind(self) -> str:
        return (self.declaration or "").split(" ", 1)[0]

    @property
    def argument(self) -> str:
        return (self.declaration or "").partition(" ")[2].strip()


def code_blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, each with the declaration
    on the closest non-blank line before it, if that line is one."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, at = [], 0
    while at < len(lines):
        opening = FENCE.match(lines[at])
        if opening is None:
            at += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        end = at + 1
        while end < len(lines) and not re.match(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        before = next((line.strip() for line in reversed(lines[:at]) if line.strip()), "")
        declared = DECLARATION.match(before)
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[at + 1:end])
        found.append(Block(page, at + 1, opening["language"], declared[1] if declared else None, body + "\n"))
        at = end + 1
    return found


BLOCKS = [block for page in PAGES for block in code_blocks(page)]
CONFIGURATION = [block for block in BLOCKS if block.language in CONFIGURATION_LANGUAGES]


def of_kind(kind: str) -> list[Block]:
    return [block for block in CONFIGURATION if block.kind == kind]


def ids(blocks: list[Block]) -> list[str]:
    return [block.name for block in blocks]


# -- the site ---------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `make docs` builds it, warnings as errors (-W), every
    warning reported (--keep-going), references checked (-n)."""
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
         "-d", str(out / ".doctrees"), str(DOCS), str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def test_the_site_builds_with_no_warning(site: Path) -> None:
    built = {path.stem for path in site.glob("*.html")}
    assert {page.stem for page in DOCS.glob("*.md")} <= built


def test_the_readme_is_short() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 300


def heading_ids(html: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', html.read_text(encoding="utf-8")))


def test_every_link_of_the_readme_reaches_a_file_and_its_heading(site: Path) -> None:
    text = re.sub(r"```.*?```", "", README.read_text(encoding="utf-8"), flags=re.DOTALL)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"^[a-z]+:", link)]
    assert relative, "the README links to no page"
    for link in relative:
        path, _, anchor = urllib.parse.unquote(link).partition("#")
        target = REPO / path if path else README
        assert target.exists(), f"README.md links to {link}: no such file"
        if anchor and target.suffix == ".md":
            assert target.parent == DOCS, f"README.md links to a heading of {path}, which is not built"
            assert anchor in heading_ids(site / f"{target.stem}.html"), f"README.md links to {link}: no such heading"


# -- declarations -------------------------------------------------------------


KINDS = {"rules", "rls", "nginx", "envoy", "kubernetes", "skip"}


def declaration_problem(block: Block) -> str | None:
    """What is wrong with a configuration block's declaration, if anything."""
    if block.declaration is None:
        return "no <!-- docs-test: KIND --> line before it"
    if block.kind not in KINDS:
        return f"unknown kind {block.kind!r}; one of {', '.join(sorted(KINDS))}"
    if block.kind == "nginx" and block.argument not in NGINX_CONTEXTS:
        return f"nginx needs a context, one of {', '.join(NGINX_CONTEXTS)}"
    if block.kind == "skip" and not block.argument:
        return "skip needs a reason"
    if block.kind not in ("nginx", "skip") and block.argument:
        return f"{block.kind} takes nothing after it"
    expected = "nginx" if block.kind == "nginx" else "yaml"
    if block.kind != "skip" and block.language != expected:
        return f"a {block.kind} block is ```{expected}, not ```{block.language}"
    return None


def test_every_configuration_block_says_what_it_is() -> None:
    problems = [f"{block.name}: {problem}" for block in CONFIGURATION
                if (problem := declaration_problem(block)) is not None]
    assert not problems, "\n".join(problems)


def test_an_undeclared_or_misdeclared_block_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```nginx\nhttp {}\n```\n\n<!-- docs-test: nginx stream -->\n```nginx\nevents {}\n```\n\n"
                    "<!-- docs-test: skip -->\n```yaml\na: 1\n```\n\n<!-- docs-test: rules -->\n\n"
                    "```yaml\nrules: []\n```\n")
    blocks = code_blocks(page)

    assert [declaration_problem(block) for block in blocks] == [
        "no <!-- docs-test: KIND --> line before it",
        "nginx needs a context, one of main, http, server, location",
        "skip needs a reason",
        None,
    ]


def test_the_docs_check_blocks_of_every_kind() -> None:
    assert {kind: len(of_kind(kind)) > 0 for kind in KINDS} == dict.fromkeys(KINDS, True)
    assert len(of_kind("rules")) >= 10


# -- rules and Rate Limit Service files: sluice check --------------------------


def sluice_check(block: Block, tmp_path: Path) -> tuple[int, str]:
    """`sluice check` on the block written to a file. A `secret_file:` the
    block names on the reader's machine is made in tmp_path."""
    text = block.text
    for secret in set(re.findall(r"secret_file:\s*(\S+)", text)):
        made = tmp_path / f"secret-{len(list(tmp_path.iterdir()))}"
        made.write_bytes(b"a secret of the documentation's test, long enough\n")
        text = text.replace(f"secret_file: {secret}", f"secret_file: {made}")
    path = tmp_path / "block.yaml"
    path.write_text(text)
    result = CliRunner().invoke(cli.main, ["check", str(path)])
    return result.exit_code, result.output


@pytest.mark.parametrize("block", of_kind("rules") + of_kind("rls"), ids=ids(of_kind("rules") + of_kind("rls")))
def test_every_rules_file_of_the_docs_passes_sluice_check(block: Block, tmp_path: Path) -> None:
    code, output = sluice_check(block, tmp_path)

    assert code == 0, f"{block.name}:\n{output}"


def test_sluice_check_catches_a_broken_rules_block(tmp_path: Path) -> None:
    [block] = [block for block in of_kind("rules") if "penalty: 15m" in block.text and block.page == README]
    broken = Block(block.page, block.line, block.language, block.declaration,
                   block.text.replace("per: 1m", "per: 1 minute", 1))

    code, output = sluice_check(broken, tmp_path)

    assert code == 1
    assert "expected a duration like '10s', got '1 minute'" in output


def test_a_rules_block_is_a_rules_file() -> None:
    for block in of_kind("rules"):
        assert "rules" in yaml.safe_load(block.text), f"{block.name}: a rules file has rules:"
    for block in of_kind("rls"):
        assert "domain" in yaml.safe_load(block.text), f"{block.name}: an RLS file has a domain"


# -- nginx: nginx -t ----------------------------------------------------------


def nginx_test(block: Block, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """nginx -t of the block in its declared context, with Sluice's snippets
    rendered into the prefix's snippets/ for blocks that include them."""
    assert launcher.main(["--render", "nginx/snippets", str(tmp_path / "snippets")]) == 0
    body = NGINX_CONTEXTS[block.argument].format(block=block.text.rstrip("\n"))
    config = tmp_path / "nginx.conf"
    config.write_text(f"events {{}}\n{body}\n")
    return subprocess.run(
        [launcher.find_nginx(), "-t", "-q", "-e", "stderr", "-p", str(tmp_path), "-c", str(config),
         "-g", f"pid {tmp_path / 'nginx.pid'};"],
        capture_output=True, text=True, timeout=30,
    )


@pytest.mark.parametrize("block", of_kind("nginx"), ids=ids(of_kind("nginx")))
def test_every_nginx_block_of_the_docs_passes_nginx_t_in_its_context(block: Block, tmp_path: Path) -> None:
    result = nginx_test(block, tmp_path)

    assert result.returncode == 0, f"{block.name}:\n{result.stderr}"


def test_nginx_t_catches_a_block_in_the_wrong_context(tmp_path: Path) -> None:
    [block] = [block for block in of_kind("nginx") if block.argument == "http"][:1]
    misplaced = Block(block.page, block.line, block.language, "nginx location", block.text)

    result = nginx_test(misplaced, tmp_path)

    assert result.returncode != 0
    assert "directive is not allowed here" in result.stderr


# -- Envoy: envoy --mode validate -----------------------------------------------


def envoy_validate(block: Block, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """envoy --mode validate of the block, each of Sluice's fragments pasted
    where a `# sluice-NAME.yaml:` comment says, indented alike."""
    fragments = tmp_path / "fragments"
    assert launcher.main(["--render", "envoy/fragments", str(fragments)]) == 0
    text = block.text
    for fragment in sorted(fragments.glob("*.yaml")):
        lines = fragment.read_text().splitlines()
        text = re.sub(rf"^( *)# {re.escape(fragment.name)}:.*$",
                      lambda match, lines=lines: "\n".join(match.group(1) + line if line else line for line in lines),
                      text, flags=re.MULTILINE)
    unpasted = re.findall(r"^ *# (sluice-[\w-]+\.yaml):", text, flags=re.MULTILINE)
    assert not unpasted, f"{block.name}: no such fragment: {unpasted}"
    bootstrap = tmp_path / "envoy.yaml"
    bootstrap.write_text(text)
    return subprocess.run(
        [launcher.find_envoy(), "--mode", "validate", "-c", str(bootstrap), "--disable-hot-restart",
         "--log-level", "error"],
        capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize("block", of_kind("envoy"), ids=ids(of_kind("envoy")))
def test_every_envoy_bootstrap_of_the_docs_passes_envoy_validate(block: Block, tmp_path: Path) -> None:
    result = envoy_validate(block, tmp_path)

    assert result.returncode == 0, f"{block.name}:\n{result.stdout}{result.stderr}"


def test_envoy_validate_catches_a_broken_bootstrap(tmp_path: Path) -> None:
    [block] = of_kind("envoy")[:1]
    broken = Block(block.page, block.line, block.language, block.declaration,
                   block.text.replace("route: {cluster: app}", "route: {cluster: nowhere}"))

    result = envoy_validate(broken, tmp_path)

    assert result.returncode != 0
    assert "nowhere" in result.stdout + result.stderr


# -- Kubernetes: validated offline -------------------------------------------------


def manifest_problems(block: Block) -> list[str]:
    return [problem for document in yaml.safe_load_all(block.text) if document is not None
            for problem in validate_manifest(document)]


@pytest.mark.parametrize("block", of_kind("kubernetes"), ids=ids(of_kind("kubernetes")))
def test_every_kubernetes_manifest_of_the_docs_validates(block: Block) -> None:
    assert manifest_problems(block) == [], block.name


def test_the_validation_catches_a_broken_manifest() -> None:
    for block in of_kind("kubernetes"):
        broken = Block(block.page, block.line, block.language, block.declaration,
                       re.sub(r"^( *)kind: (\w+)", r"\1kind: \2\n\1replicas: three", block.text, count=1,
                              flags=re.MULTILINE))
        assert manifest_problems(broken), f"{block.name}: an unknown field passed"
