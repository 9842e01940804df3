"""The README's quick start does what it says: every specgen command in it runs, as written, from a fresh folder
(the install and pytest lines are run by .ci/run itself)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def quickstart_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- quickstart[^\n]*-->\n```bash\n(.*?)```", readme, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_quickstart_names_install_default_run_and_tests():
    commands = quickstart_commands()
    assert commands[0].startswith("pip install torch==2.13.0") and commands[-1].startswith("python -m pytest")
    assert any(cmd.startswith("python -m specgen.generate") for cmd in commands)


def test_quickstart_specgen_commands_run_as_written(tmp_path):
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    for command in quickstart_commands():
        argv = shlex.split(command)
        if argv[0] == "specgen" or argv[:3] == ["python", "-m", argv[2]] and argv[2].startswith("specgen."):
            argv = [sys.executable, *argv[1:]] if argv[0] == "python" else [str(bin_dir / "specgen"), *argv[1:]]
            proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)
            assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    summary = (tmp_path / "outputs" / "quickstart" / "manifest.json")
    assert summary.is_file()
