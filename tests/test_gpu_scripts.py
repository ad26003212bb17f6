"""The GPU run scripts (scripts/gpu_*_run.sh) run when a GPU is lent, rarely and for 30 minutes: a
flag or method spec they pass that the CLI refuses would waste that session. Every `python3 -m diffspec`
command in them is parsed by the CLI's own parser, and bench methods by the bench's spec parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from diffspec.bench.specs import expand_methods
from diffspec.cli import build_parser

SCRIPTS = sorted((Path(__file__).parent.parent / "scripts").glob("gpu_*_run.sh"))


def diffspec_commands(text: str) -> list:
    """Each `python3 -m diffspec ...` command of a shell script, continuations joined, cut before its
    redirections and `||`, with ${VAR:-default} -> default, a $VAR the script assigns (`VAR=${VAR:-x}` or
    `VAR=x`) -> its value, and other $VARS -> a placeholder path."""
    assigned = {name: value for name, value in re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}\s*$", text, re.M)}
    assigned.update({name: value for name, value in re.findall(r"^(\w+)=([^\s$]+)\s*$", text, re.M)})
    joined = re.sub(r"\\\n\s*", " ", text)
    commands = []
    for match in re.finditer(r"python3 -m diffspec ([^\n]*)", joined):
        line = re.split(r"\s(?:>|2>|\|\||&&|&$)", match.group(1))[0]
        line = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", line)
        line = re.sub(r"\\?\$\{?(\w+)\}?", lambda m: assigned.get(m.group(1), f"/tmp/var_{m.group(1)}"), line)
        commands.append(shlex.split(line))
    return commands


def test_the_gpu_scripts_exist_and_name_commands():
    assert {p.name for p in SCRIPTS} >= {"gpu_drafter_run.sh", "gpu_engine_run.sh", "gpu_one_lease_run.sh"}
    for path in SCRIPTS:
        assert diffspec_commands(path.read_text()), path.name


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_diffspec_command_of_a_gpu_script_parses(path, monkeypatch):
    import diffspec.cli_options as options

    # a bench method's drafter=PATH is a folder the script trains before it runs the bench: it is not there yet, so
    # only its form is checked here (a name, or an absolute path), not the folder
    names = []
    monkeypatch.setattr(options, "check_drafter_spec", names.append)
    parser = build_parser()
    for argv in diffspec_commands(path.read_text()):
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{path.name}: the CLI refuses `diffspec {' '.join(argv)}`")
        if args.command == "bench":
            expand_methods(args.methods)  # raises DiffspecError naming a bad method or parameter
    from diffspec.defaults import DRAFTER_NAMES

    assert all(n.startswith(("/", "ar:/")) or all(p in DRAFTER_NAMES for p in n.split("+")) for n in names), names


def test_the_extractor_sees_what_a_script_passes():
    script = 'DEVICE=${DEVICE:-cuda}\nG=/root/g\n    python3 -m diffspec bench --device $DEVICE --num-prompts ${BENCH_N:-4} \\\n' \
             '        --methods plain conditioned:drafter=$G/cond/drafter,gamma=15 --out $G/bench > $G/b.log 2>&1 || fail\n'
    (argv,) = diffspec_commands(script)
    assert argv == ["bench", "--device", "cuda", "--num-prompts", "4", "--methods", "plain",
                    "conditioned:drafter=/root/g/cond/drafter,gamma=15", "--out", "/root/g/bench"]
    with pytest.raises(BaseException):
        build_parser().parse_args(["bench", "--no-such-flag"])
