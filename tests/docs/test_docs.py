"""The README and docs/ say what the code does: links resolve, code runs, commands parse, names exist.

Conventions the pages follow (and this file enforces):
- an HTML comment on the line before a code block says how it is checked:
  ``<!-- not runnable here: REASON -->`` skips running or parsing it (Python is still compiled);
  ``<!-- prelude: NAME -->`` runs a Python block after ``PRELUDES[NAME]`` (the reader's own
  model and data, which the block leaves out);
- every other ``python`` block runs to completion in a fresh interpreter in a scratch folder;
- every other ``bash`` block's commands are parsed by the command they name, without running:
  ``ddpkit train`` builds its whole config, ``ddpkit run`` parses torchrun's flags and finds the
  script, the other ``ddpkit`` commands parse their flags; ``python -m M`` needs module M, and
  ``python FILE`` a file of the repository (or the reader's own ``train.py``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = "not runnable here:"
READERS_SCRIPTS = {"train.py"}  # the script the README and the quickstart ask the reader to write
PRELUDES = {
    "toy": """
import torch
from torch import nn
from torch.utils.data import TensorDataset

Net = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
dataset = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
""",
}


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # the HTML comment on the line before the fence

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def skipped(self) -> bool:
        return self.marker is not None and self.marker.startswith(SKIP)


def blocks(page: Path) -> list[Block]:
    found, lines, i = [], page.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, lang = i, lines[i][3:].strip()
            i += 1
            while not lines[i].startswith("```"):
                i += 1
            prev = lines[start - 1].strip() if start else ""
            marker = prev[4:-3].strip() if prev.startswith("<!--") and prev.endswith("-->") else None
            found.append(Block(page, start + 1, lang, "\n".join(lines[start + 1 : i]) + "\n", marker))
        i += 1
    return found


def all_blocks(lang: str) -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang == lang]


def prose(page: Path) -> str:
    """The page without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)


def code_spans(page: Path) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(page))


def test_markers_are_known_and_give_a_reason():
    for block in all_blocks("python") + all_blocks("bash"):
        if block.marker is None:
            continue
        if block.marker.startswith(SKIP):
            assert block.marker[len(SKIP) :].strip(), f"{block}: say why it is not runnable here"
        else:
            name = block.marker.removeprefix("prelude:").strip()
            assert block.marker.startswith("prelude:") and name in PRELUDES, f"{block}: {block.marker!r}"


# --- links ---------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, counts = set(), {}
    for line in prose(page).splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            base = slug(match[1])
            counts[base] = counts.get(base, 0) + 1
            found.add(base if counts[base] == 1 else f"{base}-{counts[base] - 1}")  # GitHub's -1, -2
    return found


def test_links_resolve():
    bad = []
    for page in PAGES:
        text = re.sub(r"`[^`\n]*`", "code", prose(page))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                bad.append(f"{page.name}: {target} (no heading #{anchor} in {file.name})")
    assert not bad, "\n".join(bad)


# --- Python blocks -------------------------------------------------------------------------------


@pytest.mark.slow
def test_python_blocks_compile_and_run(tmp_path):
    runs = []
    for n, block in enumerate(all_blocks("python")):
        compile(block.code, str(block), "exec")  # a SyntaxError names the page and line
        if block.skipped:
            continue
        prelude = PRELUDES[block.marker.removeprefix("prelude:").strip()] if block.marker else ""
        where = tmp_path / f"block{n}"
        where.mkdir()
        (where / "block.py").write_text(prelude + block.code, encoding="utf-8")
        runs.append((block, where))
    assert runs, "no Python block runs: the pages lost their runnable examples"
    # One thread each: the blocks run side by side on what may be a 2-core machine.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        (block, where, subprocess.Popen(
            [sys.executable, "block.py"], cwd=where, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        ))
        for block, where in runs
    ]  # fmt: skip
    failed = []
    for block, where, proc in procs:
        try:
            out = proc.communicate(timeout=120)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0] + "\n(killed after 120 s)"
        # A run the block names by its folder must have ended with its model written.
        unwritten = [
            f"{folder}/model.pt was not written"
            for folder in re.findall(r"ddpkit\.Run\(out=\"([^\"]+)\"", block.code)
            if not (where / folder / "model.pt").exists()
        ]
        if proc.returncode != 0 or unwritten:
            failed.append(f"{block} exited {proc.returncode}:\n{out[-2000:]}\n" + "\n".join(unwritten))
    assert not failed, "\n\n".join(failed)


# --- bash blocks ---------------------------------------------------------------------------------


class _Parsed(Exception):
    """Raised by argparse once a command's flags parsed: the command itself is never run."""


def commands(block: Block) -> list[list[str]]:
    joined = block.code.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        argv = shlex.split(line, comments=True)
        while argv and re.fullmatch(r"\w+=.*", argv[0]):
            argv = argv[1:]  # VAR=value before the command
        if argv:
            found.append(argv)
    return found


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A folder that looks like the repository's root, with no runs in it."""
    for name in ("examples", "docs", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def check_ddpkit(argv: list[str], monkeypatch) -> str | None:
    """None when ``ddpkit ARGV`` parses, else why not. Nothing is started."""
    from ddpkit import cli
    from ddpkit.errors import ConfigError
    from ddpkit.launch.torchrun_flags import check_script, resolve_nproc, run_parser
    from ddpkit.train.command import parse

    try:
        if argv[:1] == ["train"]:
            parse(argv[1:])  # the whole job config: flags, --config, workload, task file
        elif argv[:1] == ["run"]:
            ns = run_parser().parse_args(argv[1:])
            resolve_nproc(str(ns.nproc_per_node))
            if ns.training_script not in READERS_SCRIPTS:
                check_script(ns)
        else:
            original = argparse.ArgumentParser.parse_args

            def parse_then_stop(self, args=None, namespace=None):
                raise _Parsed(original(self, args, namespace))

            with monkeypatch.context() as patch:
                patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
                code = cli.main(argv)
            return None if code == 0 and argv[0] in ("--help", "--version") else f"exit code {code}"
    except _Parsed:
        return None
    except (ConfigError, SystemExit) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def check_other(argv: list[str]) -> str | None:
    if argv[0] == "python" and argv[1:2] == ["-m"]:
        return None if importlib.util.find_spec(argv[2]) else f"no module {argv[2]}"
    if argv[0] == "python" and len(argv) > 1:
        ok = argv[1] in READERS_SCRIPTS or (ROOT / argv[1]).is_file()
        return None if ok else f"no file {argv[1]}"
    return f"{argv[0]}: unknown to this test; mark the block '{SKIP} ...'"


def test_ddpkit_commands_parse(scratch, monkeypatch, capsys):
    checked, bad = 0, []
    for page in PAGES:
        tomls = [b for b in blocks(page) if b.lang == "toml"]
        for block in (b for b in blocks(page) if b.lang == "bash" and not b.skipped):
            (scratch / "run.toml").unlink(missing_ok=True)
            if tomls:  # the page's TOML example is the run.toml its commands name
                (scratch / "run.toml").write_text(tomls[0].code, encoding="utf-8")
            for argv in commands(block):
                why = check_ddpkit(argv[1:], monkeypatch) if argv[0] == "ddpkit" else check_other(argv)
                checked += 1
                if why:
                    bad.append(f"{block}: {shlex.join(argv)}\n    {why}")
    capsys.readouterr()
    assert checked > 20 and not bad, "\n".join(bad)


def test_toml_examples_are_valid_configs(tmp_path):
    from ddpkit.train.command import launch_dests, train_parser
    from ddpkit.train.flags import read_toml

    tomls = all_blocks("toml")
    assert tomls
    for block in tomls:
        path = tmp_path / "run.toml"
        path.write_text(block.code, encoding="utf-8")
        read_toml(str(path), launch_dests(train_parser()))  # an unknown key is a ConfigError


# --- names and files -----------------------------------------------------------------------------


def resolve(dotted: str) -> object:
    obj = importlib.import_module("ddpkit")
    for i, part in enumerate(dotted.split(".")[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            obj = importlib.import_module(".".join(dotted.split(".")[: i + 1]))
    return obj


def test_ddpkit_names_resolve():
    bad = []
    for page in PAGES:
        for name in sorted(set(re.findall(r"\bddpkit(?:\.[A-Za-z_]\w*)+", page.read_text(encoding="utf-8")))):
            try:
                resolve(name)
            except (ImportError, AttributeError):
                bad.append(f"{page.name}: {name}")
    assert not bad, "names that do not exist:\n" + "\n".join(bad)


REPO_PATH = re.compile(r"(?:src|tests|examples|docs|\.ci)/[\w./-]*(?:::\w+)?")


def test_every_cited_test_exists():
    """Every `file` and `file::test` a page names is there (guarantees.md cites tests this way)."""
    bad, tests = [], 0
    for page in PAGES:
        for span in code_spans(page):
            if not REPO_PATH.fullmatch(span):
                continue
            path, _, test = span.partition("::")
            if not (ROOT / path).exists():
                bad.append(f"{page.name}: {span} (no such file)")
            elif test:
                tests += 1
                if not re.search(rf"^\s*(async )?def {test}\(", (ROOT / path).read_text(), re.M):
                    bad.append(f"{page.name}: {span} (no such test)")
    assert tests > 50 and not bad, "\n".join(bad)


def test_own_script_diffs_are_the_files_own():
    folder = ROOT / "docs" / "own-script"
    diffs = [b.code for b in blocks(ROOT / "docs" / "own-script.md") if b.lang == "diff"]
    expected = [
        "".join(
            subprocess.run(
                ["diff", "-u", "single_gpu.py", name], cwd=folder, capture_output=True, text=True
            ).stdout.splitlines(keepends=True)[2:]
        )
        for name in ("ddpkit_run.py", "torch_ddp.py")
    ]
    assert diffs == expected


def test_readme_is_short_and_keeps_the_setup_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 200
    assert '```bash\npython -m pip install -c constraints.txt -e ".[dev]"\npython -m pytest\n```' in readme
    assert "pip install ddpkit" not in readme, "nothing is published under that name"
    if "not slow" in readme:
        assert "slow" in (ROOT / "pyproject.toml").read_text(), "the README's fast layer needs the marker"
    layout = readme.split("## Layout", 1)[1]
    for folder in re.findall(r"`(\w+)/`", layout):
        assert (ROOT / "src" / "ddpkit" / folder).is_dir(), f"Layout names {folder}/, which does not exist"
    for page in PAGES:
        assert "seeds'" not in page.read_text(encoding="utf-8"), f"{page.name} speaks of 'the seeds'"


# --- the Run reference ---------------------------------------------------------------------------


def instance_attributes(cls: type) -> set[str]:
    """Names a class's methods assign on ``self`` (``self.out = ...``), read from its source."""
    tree = ast.parse(inspect.getsource(cls))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        and isinstance(node.ctx, ast.Store)
    }  # fmt: skip


def plain_signature(fn) -> str:
    sig = inspect.signature(fn)
    params = [
        p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values() if p.name != "self"
    ]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def api_headings() -> list[str]:
    return re.findall(r"^#{2,3} (.+)$", prose(ROOT / "docs" / "api.md"), re.M)


def test_api_reference_names_every_public_call_with_its_arguments():
    from ddpkit import Run
    from ddpkit.run import Loader

    documented: dict[str, str | None] = {}  # "run.setup" -> "(model, ...)", "run.rank" -> None
    for heading in api_headings():
        for item in heading.split(", ") if "(" not in heading else [heading]:
            if match := re.fullmatch(r"((?:run|loader|ddpkit)\.\w+|len\(loader\))(\(.*\))?", item):
                documented[match[1]] = match[2]
    owners = {"run": Run, "loader": Loader}
    for prefix, cls in owners.items():
        public = {n for n in dir(cls) if not n.startswith("_")}
        # What an instance sets on itself shows too (run.cfg, run.session, ... were internals):
        # every public one is documented, the rest are private.
        public |= {n for n in instance_attributes(cls) if not n.startswith("_")}
        missing = sorted(f"{prefix}.{n}" for n in public if f"{prefix}.{n}" not in documented)
        assert not missing, f"docs/api.md has no heading for {missing}"
    assert "len(loader)" in documented
    for name, args in documented.items():
        if name == "len(loader)":
            continue
        prefix, attr = name.split(".")
        if prefix == "ddpkit":
            obj = resolve(name)
            target = obj.__init__ if inspect.isclass(obj) else obj
        else:
            cls = owners[prefix]
            if not hasattr(cls, attr):
                assert attr in instance_attributes(cls), f"docs/api.md documents {name}, which does not exist"
                assert args is None, f"{name} is an attribute, not a call"
                continue
            target = inspect.getattr_static(cls, attr)
            if isinstance(target, property):
                assert args is None, f"{name} is a property: no arguments in its heading"
                continue
        if args is not None:
            assert args == plain_signature(target), (
                f"docs/api.md: {name}{args}, the code: {plain_signature(target)}"
            )


def test_api_reference_names_nothing_that_does_not_exist():
    from ddpkit import Run
    from ddpkit.run import Loader

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    for prefix, cls in (("run", Run), ("loader", Loader)):
        known = set(dir(cls)) | instance_attributes(cls)
        unknown = sorted({n for n in re.findall(rf"(?<![\w.]){prefix}\.(\w+)", text)} - known)
        assert not unknown, f"docs/api.md names {prefix}.{unknown}, which do not exist"


def test_api_reference_lists_every_option_with_its_default():
    from ddpkit.run import (
        CheckpointConfig,
        DataConfig,
        DiagnosticsConfig,
        EngineConfig,
        OptimConfig,
        RunConfig,
    )

    text = prose(ROOT / "docs" / "api.md")
    for cls in (RunConfig, DataConfig, EngineConfig, CheckpointConfig, OptimConfig, DiagnosticsConfig):
        section = re.search(rf"^### {cls.__name__}\n(.*?)(?=^#)", text, re.S | re.M)
        assert section, f"docs/api.md has no section ### {cls.__name__}"
        rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section[1], re.M))
        fields = {f.name: repr(f.default) for f in dataclasses.fields(cls)}
        assert rows == fields, f"{cls.__name__}: docs/api.md lists {rows}, the code has {fields}"
