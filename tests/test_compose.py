"""docker-compose.yml: valid, and the commands its containers run are real commands of our CLI."""

import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from worker.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_compose_file_is_valid():
    if not shutil.which("docker-compose"):
        pytest.skip("docker-compose is not installed")
    subprocess.run(["docker-compose", "config", "-q"], cwd=ROOT, check=True)


def test_container_commands_exist():
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("models", "worker"):
        cmd = services[name]["command"]
        assert cmd[0] == "pagedq"
        args = [a for a in cmd[1:] if not a.startswith("$")] + ["--help"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, (name, result.output)
