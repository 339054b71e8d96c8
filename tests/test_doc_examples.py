"""Every fenced example of README.md and docs/*.md runs as written, on CPU.

Convention for documentation authors:

* ```bash / ```sh and ```python blocks run; ```text (output), ```json and unlabeled blocks never run.
* `<!-- doc-test: skip (reason) -->` on the line just before a block's fence skips it with that reason
  (GPU-only, installs, long benchmarks, placeholder paths, signature listings).
* A shell line `python -m jaxkv.serve ...` starts that server (on a free port) and waits for its ready
  line and `/health` instead of blocking; later blocks of the same page talk to it: `127.0.0.1:N` /
  `localhost:N` in their text becomes the real port, where N is the line's `--port` (8000 when left out).
  The rest of such a block runs after the server is up. A server stops once no later page starts the same
  command line (servers of equal command lines are one server).
* Python blocks of one page share one namespace, as a reader pasting them into one interpreter (run in
  this process, in page order). Shell blocks run with `bash -e -o pipefail` from the repository root, with
  `curl` failing on an HTTP error status. `/tmp/` in a block is a fresh temporary directory.

Each block is one test, named `file:line` (the fence's line). A block run alone first replays what it
depends on: the page's earlier server lines and Python blocks.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from jaxkv.serve.launch import ServerProcess

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = {"bash": "shell", "sh": "shell", "shell": "shell", "python": "python", "py": "python"}
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
_SKIP = re.compile(r"^\s*<!--\s*doc-test:\s*skip\s*(?:\((?P<reason>.*)\))?\s*-->\s*$")
_HOST_PORT = re.compile(r"\b(?:127\.0\.0\.1|localhost):(\d+)\b")
_SERVE = re.compile(r"^\s*python3? -m jaxkv\.serve\b")
BLOCK_TIMEOUT_S = 300


@dataclass
class Block:
    page: str  # path relative to the repository
    line: int  # 1-based line of the opening fence
    kind: str  # "shell" | "python"
    code: str
    skip: str | None = None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def server_lines(self) -> list[str]:
        if self.kind != "shell":
            return []
        return [line for line in _logical_lines(self.code) if _SERVE.match(line)]


def _logical_lines(code: str) -> list[str]:
    """Shell lines with backslash continuations joined."""
    return code.replace("\\\n", " ").splitlines()


def extract_blocks(path: Path, root: Path = REPO) -> list[Block]:
    """The fenced blocks of one Markdown file that run (or are skipped by a marker)."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence[0] * len(fence)):
            j += 1
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:j])
        kind = RUNNABLE.get(lang.lower())
        if kind is not None:
            marker = _SKIP.match(lines[i - 1]) if i else None
            skip = (marker["reason"] or "marked skip") if marker else None
            out.append(Block(str(path.relative_to(root)), i + 1, kind, body + "\n", skip))
        i = j + 1
    return out


BLOCKS = [b for page in PAGES for b in extract_blocks(page)]


def _serve_args(line: str) -> tuple[int, list[str]]:
    """(the documented port, the server's arguments without --port) of a `python -m jaxkv.serve` line."""
    words = shlex.split(line, comments=True)
    args = words[words.index("jaxkv.serve") + 1:]
    port, out, k = 8000, [], 0
    while k < len(args):
        if args[k] == "--port":
            port, k = int(args[k + 1]), k + 2
            continue
        if args[k].startswith("--port="):
            port = int(args[k].split("=", 1)[1])
        else:
            out.append(args[k])
        k += 1
    return port, out


@dataclass
class Session:
    """Servers (by command line) and per-page state shared by the blocks of this module."""

    tmp: Path
    servers: dict[tuple[str, ...], ServerProcess] = field(default_factory=dict)
    page: str | None = None
    ports: dict[int, ServerProcess] = field(default_factory=dict)  # documented port -> server
    namespace: dict = field(default_factory=dict)
    done: set[str] = field(default_factory=set)  # blocks of the current page run (or replayed)

    def enter(self, block: Block) -> None:
        """Switches to `block`'s page (stopping servers no later page starts) and replays what `block`
        depends on that did not run here: the page's earlier server lines and Python blocks."""
        if block.page != self.page:
            self.page, self.ports, self.namespace, self.done = block.page, {}, {}, set()
            later = {tuple(_serve_args(self._local(line))[1]) for b in BLOCKS[BLOCKS.index(block):]
                     if not b.skip for line in b.server_lines()}
            for key in [k for k in self.servers if k not in later]:
                self.servers.pop(key).stop()
        for b in BLOCKS[:BLOCKS.index(block)]:
            if b.page != block.page or b.skip or b.id in self.done:
                continue
            self.done.add(b.id)  # once, even when it fails (its own test reports that)
            if b.kind == "python":
                self.run_python(b)
            else:
                self.start_servers(b)

    def _local(self, text: str) -> str:
        return text.replace("/tmp/", f"{self.tmp}/")

    def start_servers(self, block: Block) -> None:
        for line in block.server_lines():
            port, args = _serve_args(self._local(line))
            key = tuple(args)
            if key not in self.servers:
                server = ServerProcess(args, timeout=BLOCK_TIMEOUT_S)
                self.servers[key] = server
                assert httpx.get(server.base + "/health", timeout=30).json() == {"status": "ok"}
            self.ports[port] = self.servers[key]

    def substitute(self, code: str) -> str:
        def real(m: re.Match) -> str:
            port = int(m[1])
            if port not in self.ports:
                raise AssertionError(f"the block talks to port {port}, but no earlier block of {self.page} "
                                     "starts a server there (python -m jaxkv.serve ... --port N)")
            return "127.0.0.1:" + self.ports[port].base.rsplit(":", 1)[1]

        return _HOST_PORT.sub(real, self._local(code))

    def run_python(self, block: Block) -> None:
        code = compile(self.substitute(block.code), block.id, "exec")
        exec(code, self.namespace)

    def run_shell(self, block: Block) -> None:
        self.start_servers(block)
        rest = "\n".join(line for line in _logical_lines(block.code) if not _SERVE.match(line))
        script = 'curl() { command curl --fail-with-body "$@"; }\n' + self.substitute(rest)
        env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        print(r.stdout)
        assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n" \
                                  f"{r.stderr[-3000:]}"

    def close(self) -> None:
        for s in self.servers.values():
            s.stop()
        self.servers.clear()


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    s = Session(tmp_path_factory.mktemp("doc-examples"))
    yield s
    s.close()


def test_the_convention(tmp_path):
    """What runs, what is skipped with its reason, what is output; server lines and their ports."""
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "# t", "", "```python", "print(1)", "```", "", "```text", "1", "```", "",
        "<!-- doc-test: skip (GPU only) -->", "```bash", "nvidia-smi", "```", "",
        "```sh", "python -m jaxkv.serve --model synthetic \\", "    --port 8001   # serves", "curl -s x",
        "```",
        "```json", "{}", "```", "```", "plain", "```"]) + "\n")
    blocks = extract_blocks(page, tmp_path)
    assert [(b.line, b.kind, b.skip) for b in blocks] == [(3, "python", None), (12, "shell", "GPU only"),
                                                          (16, "shell", None)]
    assert blocks[0].code == "print(1)\n"
    serve, = blocks[2].server_lines()
    assert _serve_args(serve) == (8001, ["--model", "synthetic"])
    assert _serve_args("python -m jaxkv.serve") == (8000, [])


def test_the_documents_have_runnable_examples():
    """The extractor sees the fences: README's client examples are collected and not skipped."""
    readme = [b for b in BLOCKS if b.page == "README.md" and not b.skip]
    assert any(b.kind == "python" and "openai" in b.code for b in readme)
    assert any(b.kind == "shell" and b.server_lines() for b in readme)
    assert all(b.skip.strip() for b in BLOCKS if b.skip is not None)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=[pytest.mark.skip(reason=b.skip)] if b.skip
                                                else []) for b in BLOCKS])
def test_doc_example(block: Block, session: Session):
    session.enter(block)
    session.done.add(block.id)
    if block.kind == "python":
        session.run_python(block)
    else:
        session.run_shell(block)
