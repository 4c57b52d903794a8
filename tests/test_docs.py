"""Documented commands are tested commands: every shell command in README.md, docs/*.md and bundles/*/docs/README.md.

What counts as a command: a line of a code block (fenced ```bash, or indented by 4 spaces) that starts with
``python``, ``torchrun``, ``srun`` or ``pip``, with its ``\\`` continuation lines joined. Where it runs: the
repository root for README.md and docs/*.md and the bundle's folder for a bundle's docs, switched by the prose before
a block (README.md and docs/*.md: "from `bundles/NAME/`"; any doc: "repository root" switches to the root, "this
folder" / "bundle's folder" back to the bundle), as the docs tell a reader; a heading switches back to the doc's home.
Every doc holds a command the suite runs, but those named in ``NO_COMMANDS`` and ``NONE_RUN`` with the reason.

Checked for every command (fast): it is valid bash; ``python -m components`` commands and flags exist;
``monai.bundle run`` config files exist where the command runs and every ``--id`` is an id of those configs;
bundle names and versions in zip names and ``--version`` equal ``configs/metadata.json``; every relative input path
(``--pretrained_path``, ``--resume``, ``--dataset_dir``, ``--datalist``, a datalist or a zip) resolves, from where the
command runs, into the repository or into a folder an earlier documented command writes.

Run (slow: minutes of CPU): every command that needs no GPU, no real dataset, no network and no cluster, in a copy
of the repository (one per doc), doc by doc and in the docs' order, as written, with these mechanical substitutions
only:

- a training, evaluation or inference run that sets no ``--max_epochs`` gets its doc's ``TINY`` settings
  appended (the docs' GPU-sized defaults would run for hours);
- a file the docs expect the reader to bring is provided: ``model_swinvit.pt`` (the CVPR release layout, feature
  size 48), and for every doc but those whose own tiny SSL run writes it (``WRITES_SSL_MODEL``) the tiny SSL model
  that run writes (feature size 12), which the finetuning docs start from;
- ``python -m components demo`` is run by tests/test_demo.py (quick budget; the default budget takes 8 minutes).

Commands that cannot run here are listed by ``not_runnable`` with the reason and are still checked above.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

from components.__main__ import COMMANDS, _unknown_flags
from components.config.overrides import defined_overrides

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted(REPO.glob("docs/*.md")), *sorted(REPO.glob("bundles/*/docs/README.md"))]
BUNDLES = sorted(p.name for p in (REPO / "bundles").iterdir() if (p / "configs" / "metadata.json").is_file())
STARTS = ("python", "torchrun", "srun", "pip")
# monai.bundle run's own options (everything else is a config id)
RUN_OPTIONS = {"config_file", "meta_file", "logging_file", "tracking", "args_file", "run_id", "init_id", "final_id"}
# tiny settings appended to a run that sets no --max_epochs, by the bundle it runs
TINY = {
    "swin_unetr_ssl_pretrain": ["--roi_size", "[64,32,32]", "--feature_size", "12"],
    "swin_unetr_btcv_finetune": ["--roi_size", "[64,32,32]", "--spacing", "[3.0,3.0,4.0]", "--feature_size", "12"],
    "swin_unetr_brats_finetune": ["--roi_size", "[64,32,32]", "--spacing", "[2.0,2.0,2.0]", "--feature_size", "12"],
    "swin_unetr_dino_pretrain": ["--roi_size", "[32,32,32]", "--feature_size", "12"],
    "swin_unetr_mim_pretrain": ["--roi_size", "[64,32,32]", "--feature_size", "12"],
}
TINY_COMMON = ["--max_epochs", "2", "--loader#num_workers", "0", "--device", "cpu", "--speed#amp", "false",
               "--speed#use_checkpoint", "false", "--network_def#window_size", "4"]  # the window of the docs' tiny runs, which later commands load
USER_FILES = {"model_swinvit.pt"}  # files the docs expect the reader to bring
COVERED_ELSEWHERE = {"python -m components demo": "tests/test_demo.py",
                     "python benchmarks/pretrain_curve.py": "tests/test_pretrain_curve.py",
                     "python benchmarks/curve_probe.py": "tests/test_curve_probe.py",
                     "python benchmarks/curve_reread.py": "tests/test_curve_reread.py",
                     "python benchmarks/demo_seeds.py": "tests/test_benchmarks.py"}
# the docs whose own tiny SSL run writes bundles/swin_unetr_ssl_pretrain/models/model.pt: every other doc is given it
WRITES_SSL_MODEL = {"docs/pretraining.md", "bundles/swin_unetr_ssl_pretrain/docs/README.md"}
# docs with no command, and docs none of whose commands the suite runs: named, so a doc whose commands stop being
# found or run fails
NO_COMMANDS = {
    "docs/components.md": "a reference of the package's modules",
    "docs/speed.md": "the speed settings and where they are measured",
}
NONE_RUN = {
    "README.md": "its commands install packages or need a GPU, a real dataset or a cluster (the demo: tests/test_demo.py)",
    "docs/demo.md": "the demo is run by tests/test_demo.py",
    "docs/testing.md": "its commands are the test suite itself",
    "docs/measuring.md": "its commands run pretrainings for hours (tests/test_pretrain_curve.py runs a small one)",
}
README_LIMIT = 8000  # characters: the README says what this is and how to pretrain on your data; the rest is in docs/


@dataclass(frozen=True)
class DocCommand:
    doc: str  # relative to the repository
    line: int
    cwd: str  # relative to the repository: "." or "bundles/NAME"
    text: str  # the command as a reader copies it (continuations joined, comments dropped)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def checkable(self) -> str:
        """The text with each ``<placeholder>`` (for the reader's release) as one word, so bash and shlex read it."""
        return re.sub(r"<[^<>]*>", "PLACEHOLDER", self.text)

    @property
    def words(self) -> list[str]:
        return shlex.split(self.checkable.replace("$PWD", "/PWD"))

    @property
    def bundle(self) -> str | None:
        return PurePosixPath(self.cwd).name if self.cwd.startswith("bundles/") else None


def _blocks(text: str) -> list[tuple[int, list[str], str]]:
    """(first line number, lines, prose since the previous block) of each fenced or indented code block."""
    blocks, prose, lines = [], [], text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            lang, start, body = line[3:].strip(), i + 2, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if lang in ("", "bash", "sh", "shell"):
                blocks.append((start, body, "\n".join(prose)))
            prose = []
        elif line.startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            start, body = i + 1, []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            blocks.append((start, body, "\n".join(prose)))
            prose = []
            continue
        else:
            prose.append(line)
        i += 1
    return blocks


def _strip_comment(line: str) -> str:
    """The line without a trailing ``# comment`` (outside quotes)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=False)
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        tokens = list(lexer)
    except ValueError:
        return line
    if not tokens:
        return ""
    hash_at = [m.start() for m in re.finditer(r"\s#", line)]
    for position in hash_at:
        try:
            if shlex.split(line[:position]) == tokens:
                return line[:position].rstrip()
        except ValueError:
            continue
    return line.rstrip()


def doc_commands(doc: Path) -> list[DocCommand]:
    rel = doc.relative_to(REPO).as_posix()
    home = "." if doc.parent == REPO else doc.parent.parent.relative_to(REPO).as_posix()
    cwd, commands, section = home, [], None
    text = doc.read_text(encoding="utf-8")
    for start, body, prose in _blocks(text):
        heading = re.findall(r"^#{1,3} .*$", prose, re.M)
        prose = " ".join(prose.split())  # phrases broken across lines
        if heading and heading[-1] != section:
            section, cwd = heading[-1], home
        # the last of these phrases in the prose says where the block runs
        said = [(m.end(), m.group(1)) for m in re.finditer(r"from `(bundles/[\w.-]+)/?`", prose)]
        said += [(m.end(), ".") for m in re.finditer(r"repository root", prose)]
        if home != ".":
            said += [(m.end(), home) for m in re.finditer(r"this folder|bundle's folder|bundle folder", prose)]
        if said:
            cwd = max(said)[1]
        logical, first = "", None
        for offset, line in enumerate(body):
            stripped = line.strip()
            if first is None:
                if not stripped.startswith(STARTS):
                    continue
                first = start + offset
            logical += " " + _strip_comment(stripped.rstrip("\\").rstrip()) if stripped.endswith("\\") else " " + _strip_comment(stripped)
            if not stripped.endswith("\\"):
                commands.append(DocCommand(rel, first, cwd, " ".join(logical.split())))
                logical, first = "", None
    return commands


ALL = [c for doc in DOCS for c in doc_commands(doc)]


def _meta(bundle: str) -> dict:
    return json.loads((REPO / "bundles" / bundle / "configs" / "metadata.json").read_text(encoding="utf-8"))


def _flag(words: list[str], name: str) -> str | None:
    for i, word in enumerate(words):
        if word == f"--{name}" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(f"--{name}="):
            return word.split("=", 1)[1]
    return None


def _after(words: list[str], module: str) -> list[str] | None:
    """The arguments after ``-m MODULE`` (``python -m``, ``torchrun -m``, ``srun torchrun -m``)."""
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == module:
            return words[i + 2 :]
    return None


def _config_files(args: list[str]) -> list[str]:
    value = _flag(args, "config_file")
    assert value, "no --config_file"
    return list(ast.literal_eval(value)) if value.startswith("[") else [value]


def not_runnable(command: DocCommand) -> str | None:
    """Why a documented command is not run by the suite (None: it is run)."""
    text = command.text
    for marker, reason in (
        ("pip install", "installs packages (the suite runs in the installed environment)"),
        ("-m pytest", "is the test suite itself"),
        ("<", "has placeholders for the reader's release (<owner>/<repo>/<tag>, <hash>)"),
        ("https://", "downloads from the network"),
        ("download_large_files", "downloads a published release's weights (tests/test_bundle_download.py runs it)"),
        ("verify_metadata", "checks a downloaded bundle (tests/test_bundle_download.py runs it)"),
        ("/data/", "needs a real dataset"),
        ("/shared/", "needs a cluster's shared file system"),
        ("srun ", "needs Slurm"),
        ("--nnodes=2", "needs two nodes"),
        ("nproc_per_node=8", "needs 8 GPUs"),
    ):
        if marker in text:
            return reason
    for prefix, test in COVERED_ELSEWHERE.items():
        if text.startswith(prefix):
            return f"is run by {test}"
    return None


# ------------------------------------------------------------------------------------------------------------
# static checks of every command


def test_the_docs_have_commands_and_every_one_is_classified():
    assert len(ALL) >= 30, [c.id for c in ALL]
    docs = {d.relative_to(REPO).as_posix() for d in DOCS}
    assert set(NO_COMMANDS) | set(NONE_RUN) <= docs, "a doc named in NO_COMMANDS or NONE_RUN does not exist"
    by_doc = {c.doc for c in ALL}
    assert by_doc == docs - set(NO_COMMANDS)
    runnable = [c for c in ALL if not_runnable(c) is None]
    assert {c.doc for c in runnable} == docs - set(NO_COMMANDS) - set(NONE_RUN)
    assert any("nproc_per_node=2" in c.text for c in runnable), "the two-process example must be run"
    for test in COVERED_ELSEWHERE.values():
        assert (REPO / test).is_file(), test


@pytest.mark.parametrize("command", ALL, ids=[c.id for c in ALL])
def test_command_is_well_formed(command):
    syntax = subprocess.run(["bash", "-n", "-c", command.checkable], capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, f"{command.id}: not valid bash: {syntax.stderr}"
    words = command.words
    assert "..." not in words, f"{command.id}: write the whole command, not '...'"
    assert not any(w.startswith("[--") for w in words), f"{command.id}: optional-flag notation is not a command"
    cwd = REPO / command.cwd

    args = _after(words, "components")
    if args is not None and args and args[0] not in ("--help", "-h"):
        assert args[0] in COMMANDS, f"{command.id}: no command {args[0]!r}"
        assert _unknown_flags(COMMANDS[args[0]], args[1:]) is None, f"{command.id}: unknown flag"

    args = _after(words, "monai.bundle")
    if args and args[0] == "run":
        files = _config_files(args)
        ids: set[str] = set()
        for name in files:
            assert (cwd / name).is_file(), f"{command.id}: {name} does not exist in {command.cwd}"
            ids |= set(json.loads((cwd / name).read_text(encoding="utf-8")))
        for option in ("meta_file", "logging_file"):
            value = _flag(args, option)
            assert value is None or (cwd / value).is_file(), f"{command.id}: {value} does not exist in {command.cwd}"
        for word in args[1:]:
            if word.startswith("--"):
                key = word[2:].split("=", 1)[0]
                assert key in RUN_OPTIONS or key.split("#")[0] in ids, f"{command.id}: {key} is no id of {files}"
    if args and args[0] == "download":
        name = _flag(args, "name")
        assert name in BUNDLES, f"{command.id}: no bundle {name!r}"
        version = _flag(args, "version")
        assert version in (None, _meta(name)["version"]), f"{command.id}: version {version} is not {name}'s"

    for name, version in re.findall(r"([\w-]+)_v(\d+\.\d+\.\d+)\.zip", command.text):
        assert name in BUNDLES and version == _meta(name)["version"], (
            f"{command.id}: {name}_v{version}.zip, but `package` writes {name}_v{_meta(name)['version']}.zip"
        )


def _written(command: DocCommand) -> list[Path]:
    """Folders a command writes (resolved against where it runs)."""
    cwd, words = REPO / command.cwd, command.words
    out: list[str] = []
    components = _after(words, "components")
    if components:
        if components[0] in ("synth", "package", "demo"):
            out.append(_flag(components, "out") or "")
        if components[0] == "fetch" and len(components) > 2 and not components[2].startswith("--"):
            out.append(components[2])
        if components[0] == "convert-checkpoint" and len(components) > 2:
            out.append(components[2])
    bundle = _after(words, "monai.bundle")
    if bundle and bundle[0] == "download":
        out.append(_flag(bundle, "bundle_dir") or "")
    if bundle and bundle[0] == "run":
        out += [_flag(bundle, "ckpt_dir") or "models", _flag(bundle, "output_dir") or "eval"]
    return [(cwd / o).resolve() for o in out if o]


def _inputs(command: DocCommand) -> list[str]:
    words = command.words
    found = [v for v in (_flag(words, k) for k in ("pretrained_path", "resume", "dataset_dir", "datalist")) if v]
    components = _after(words, "components")
    if components and components[0] in ("check-data", "convert-checkpoint") and len(components) > 1:
        found.append(components[1])
    found += [w for w in words if w.endswith(".zip") and not w.startswith(("file:", "http"))]
    return [f for f in found if not f.startswith(("/", "<")) and f.lower() not in ("none", "null")]


def test_relative_paths_resolve_where_the_commands_run():
    """A relative input path of a command, from the folder the docs run it in, lies in the repository or in a
    folder that a documented command writes (the finetuning docs once pointed at downloads/ inside the bundle)."""
    written = {path for command in ALL for path in _written(command)}
    bad = []
    for command in ALL:
        for rel in _inputs(command):
            path = (REPO / command.cwd / rel).resolve()
            if rel in USER_FILES or path.exists() or any(path == w or w in path.parents for w in written):
                continue
            bad.append(f"{command.id} (from {command.cwd}): {rel}")
    assert not bad, "relative paths that nothing documented provides:\n" + "\n".join(bad)


def test_the_multi_rank_example_has_a_validation_volume_per_rank():
    """The two-process example runs on the data its doc synthesises: every rank needs a validation volume."""
    from components.data.synthetic import split_sizes

    for doc in DOCS:
        commands = doc_commands(doc)
        for i, command in enumerate(commands):
            match = re.search(r"--nproc_per_node=(\d+)", command.text)
            data = _flag(command.words, "dataset_dir")
            if not match or not data or data.startswith("/"):
                continue
            synth = [c for c in commands[:i] if _after(c.words, "components") and _flag(c.words, "out") == data]
            assert synth, f"{command.id}: no documented synth writes {data}"
            num = int(_flag(synth[-1].words, "num"))
            assert split_sizes(num)[1] >= int(match.group(1)), (
                f"{command.id}: {match.group(1)} ranks but `synth --num {num}` gives {split_sizes(num)[1]} validation volumes"
            )


# ------------------------------------------------------------------------------------------------------------
# the README and the pages it leads to

PAGES = sorted(REPO.glob("docs/*.md"))


def test_the_readme_is_short_and_links_every_docs_page():
    """README.md holds what this is and how to pretrain on your data, within README_LIMIT characters; everything
    else is on a page under docs/, and every page is linked from it."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text) <= README_LIMIT, f"README.md has {len(text)} characters (at most {README_LIMIT}): move the rest to docs/"
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[^)\s]*)?\)", text))
    pages = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert pages <= linked, f"docs pages not linked from README.md: {sorted(pages - linked)}"


BUNDLE_READMES = [REPO / "bundles" / name / "docs" / "README.md" for name in BUNDLES]
BUNDLE_README_LIMIT = 8000  # bytes: what a bundle is, its data, how to run it, its settings and results; the rest in docs/
# the Model Zoo's order: what it does, data, how to run (then a downloaded release), settings, results, references
BUNDLE_SECTIONS = ["What it does", "Data", "How to run", "Run a downloaded bundle", "Settings", "Results", "References",
                   "Licence"]  # fmt: skip


@pytest.mark.parametrize("readme", BUNDLE_READMES, ids=BUNDLES)
def test_each_bundle_readme_is_short_and_in_the_model_zoos_order(readme):
    """A bundle's README holds what a user of that bundle needs, within BUNDLE_README_LIMIT bytes, in the same sections
    in the same order for every bundle; the details are on the repository's docs/ pages it links."""
    size = len(readme.read_bytes())
    assert size <= BUNDLE_README_LIMIT, f"{readme.relative_to(REPO)} has {size} bytes (at most {BUNDLE_README_LIMIT}): move the rest to docs/"
    assert re.findall(r"^## (.*)$", readme.read_text(encoding="utf-8"), re.M) == BUNDLE_SECTIONS


@pytest.mark.parametrize("readme", BUNDLE_READMES, ids=BUNDLES)
def test_the_settings_table_names_ids_of_the_bundles_train_json(readme):
    """Every id in the first column of a README's settings table is an id of the bundle's ``configs/train.json`` run
    (with the shared ``configs/common.json``), every ``#`` step of it a key there: a renamed or regrouped id fails here
    until the table follows."""
    from monai.bundle import ConfigParser

    from components.config.running import run_config_files

    config = ConfigParser.load_config_files([str(f) for f in run_config_files(readme.parents[1], ["train.json"])])
    section = readme.read_text(encoding="utf-8").split("\n## Settings", 1)[1].split("\n## ", 1)[0]
    ids = [i for row in re.findall(r"^\| (.+?) \|", section, re.M) for i in re.findall(r"`([^`]+)`", row)]
    assert len(ids) >= 8, ids
    missing = []
    for name in ids:
        node = config
        for key in name.split("#"):
            if not isinstance(node, dict) or key not in node:
                missing.append(name)
                break
            node = node[key]
    assert not missing, f"{readme.relative_to(REPO)}: not ids of configs/train.json: {missing}"


@pytest.mark.parametrize("readme", BUNDLE_READMES, ids=BUNDLES)
def test_a_bundle_readmes_links_resolve_and_say_when_they_leave_the_bundle(readme):
    """Every relative link of a bundle's README names a file of the repository (and its #anchor a heading there); a
    downloaded bundle holds only its own folder, so a link out of it says in its text that it leads into the
    repository."""
    bundle, bad = readme.parents[1], []
    for text, target, file, problem in _relative_links(readme):
        if problem is None and bundle not in file.parents and "repository" not in " ".join(text.split()):
            problem = f"[{text}]({target}): leaves the bundle; its text must say it is in the repository"
        bad += [problem] if problem else []
    assert not bad, f"{readme.relative_to(REPO)}:\n" + "\n".join(bad)


def _relative_links(doc: Path) -> list[tuple[str, str, Path, str | None]]:
    """Each relative link of ``doc``: its text, its target, the file it names, and what is wrong with it (no such
    file, or no heading of its #anchor there) or None."""
    links = []
    for text, target in re.findall(r"\[([^\]]*)\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file, problem = (doc.parent / path).resolve() if path else doc, None
        if not file.exists():
            problem = f"{target}: no file {file}"
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            problem = f"{target}: no heading with the anchor #{anchor} in {file.relative_to(REPO)}"
        links.append((text, target, file, problem))
    return links


def _anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (lower case, punctuation dropped, spaces to '-')."""
    titles = re.findall(r"^#{1,6} (.*)$", doc.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-") for title in titles}


@pytest.mark.parametrize("doc", [REPO / "README.md", *PAGES], ids=lambda d: d.relative_to(REPO).as_posix())
def test_the_links_of_the_readme_and_the_docs_pages_resolve(doc):
    """Every relative link of README.md and docs/*.md names a file of the repository, and its #anchor a heading there."""
    bad = [problem for _, _, _, problem in _relative_links(doc) if problem]
    assert not bad, f"{doc.relative_to(REPO)}:\n" + "\n".join(bad)


# ------------------------------------------------------------------------------------------------------------
# running them


def _model_swinvit(path: Path) -> None:
    """A file in the CVPR release layout (``model_swinvit.pt``, feature size 48): what a reader downloads."""
    import torch

    from components import SSLHead

    encoder = SSLHead(feature_size=48).swinViT.state_dict()
    state = {"module." + k.replace(".mlp.linear1.", ".mlp.fc1.").replace(".mlp.linear2.", ".mlp.fc2."): v for k, v in encoder.items()}
    state["module.norm.weight"], state["module.norm.bias"] = torch.ones(16 * 48), torch.zeros(16 * 48)
    torch.save({"state_dict": state}, path)


def _sandbox(tmp: Path) -> Path:
    """A copy of the repository's files (components, bundles, benchmarks, docs, tests, configuration), as a reader's
    clone."""
    root = tmp / "repo"
    outputs = shutil.ignore_patterns("__pycache__", "models", "eval", "data", "dist")  # what runs left in a checkout
    for name in ("components", "bundles", "benchmarks", "docs", "tests"):
        ignore = shutil.ignore_patterns("__pycache__") if name == "components" else outputs  # components.data is code
        shutil.copytree(REPO / name, root / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, root / name)
    return root


def _command_line(command: DocCommand) -> str:
    text = command.text
    bundle = _after(command.words, "monai.bundle")
    if bundle and bundle[0] == "run" and _flag(bundle, "max_epochs") is None:
        tiny = TINY[command.bundle] + TINY_COMMON
        pairs = [tiny[i : i + 2] for i in range(0, len(tiny), 2) if _flag(bundle, tiny[i][2:]) is None]  # the doc's own win
        # only ids the command's configs define (inference.json has no max_epochs; the run would stop on it)
        defined = defined_overrides({p[0][2:]: p[1] for p in pairs}, [REPO / command.cwd / f for f in _config_files(bundle)])
        pairs = [p for p in pairs if p[0][2:] in defined]
        text += " " + " ".join(shlex.quote(w) for pair in pairs for w in pair)
    return text


def _run_doc(doc: Path, tmp: Path) -> list[str]:
    root = _sandbox(tmp)
    commands = [c for c in doc_commands(doc) if not_runnable(c) is None]
    if doc.relative_to(REPO).as_posix() not in WRITES_SSL_MODEL:
        import torch

        from components import SSLHead

        # "(the SSL model must have the same feature_size and window_size)": what the SSL docs' tiny run writes
        (root / "bundles" / "swin_unetr_ssl_pretrain" / "models").mkdir(parents=True)
        torch.save(SSLHead(feature_size=12, window_size=4).state_dict(), root / "bundles" / "swin_unetr_ssl_pretrain" / "models" / "model.pt")
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1"}
    ran = []
    for command in commands:
        cwd = root / command.cwd
        if "model_swinvit.pt" in command.words and not (cwd / "model_swinvit.pt").exists():
            _model_swinvit(cwd / "model_swinvit.pt")
        line = _command_line(command)
        proc = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{command.id} (in {command.cwd}) failed:\n$ {line}\n{output[-4000:]}"
        ran.append(command.id)
    return ran


RUN_DOCS = [d for d in DOCS if d.relative_to(REPO).as_posix() not in {**NO_COMMANDS, **NONE_RUN}]


@pytest.mark.slow
@pytest.mark.parametrize("doc", RUN_DOCS, ids=[d.relative_to(REPO).as_posix() for d in RUN_DOCS])
def test_documented_commands_run(doc, tmp_path):
    ran = _run_doc(doc, tmp_path)
    assert ran, f"no runnable command in {doc}"
