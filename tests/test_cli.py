"""The command line through a real subprocess: help, config show, errors, a small run."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RFEDRAY = [sys.executable, "-m", "rfedray.cli"]
TINY = [
    "run.rounds=4", "federation.n_clients=4", "federation.clients_per_round=2",
    "federation.local_steps=2", "federation.batch_size=20", "data.options.d=8", "data.options.p=2",
    "data.options.records_per_client=100", "run.engine=local",
]


def rfedray(*args, cwd=ROOT, check=False):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([*RFEDRAY, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300, check=check)


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["config", "--help"], ["config", "show", "--help"],
                                  ["privacy", "--help"]])
def test_help(args):
    out = rfedray(*args)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_config_show_resolves_overrides():
    out = rfedray("config", "show", "configs/fedpca.yaml", "federation.clients_per_round=7")
    assert out.returncode == 0, out.stderr
    assert "clients_per_round: 7" in out.stdout


@pytest.mark.parametrize("args, field", [
    (["run", "federation.clients_per_round=60"], "federation.clients_per_round"),
    (["run", "privacy.delta=2"], "privacy.delta"),
    (["run", "aggregation.scheme=median"], "aggregation.scheme"),
    (["run", "nope.yaml"], "config"),
    (["config", "show", "federation.n_clent=3"], "federation.n_clent"),
])
def test_bad_config_is_one_line_and_exit_2(args, field):
    out = rfedray(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}="), out.stderr
    assert "Traceback" not in out.stderr


def test_run_writes_the_contracted_run_directory(tmp_path):
    out = rfedray("run", "configs/fedpca.yaml", *TINY, f"run.output_dir={tmp_path}", "--quiet")
    assert out.returncode == 0, out.stderr
    run_dir = Path(out.stdout.strip().splitlines()[0])
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("rounds_completed", "epsilon_spent", "epsilon_target", "delta", "sigma", "halted",
                "halt_reason", "final_metrics"):
        assert key in summary
    assert summary["rounds_completed"] == 4
    assert 0 < summary["epsilon_spent"] <= summary["epsilon_target"]
    assert isinstance(summary["final_metrics"], dict) and "oracle_gap" in summary["final_metrics"]
    assert summary["oracle_metrics"] is True
    assert (run_dir / "config.yaml").is_file()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 4
    # --quiet and a non-terminal stderr: one plain line per round
    assert sum("round" in line for line in out.stderr.splitlines()) >= 4


def test_verbose_times_the_start_up_phases(tmp_path):
    """``--verbose`` logs each start-up phase with the seconds since the process started and its
    resident memory (what benchmarks/side_by_side.py reads), in order."""
    out = rfedray("run", "configs/fedpca.yaml", *TINY, f"run.output_dir={tmp_path}", "--engine", "local", "--quiet",
                  "--verbose")
    assert out.returncode == 0, out.stderr
    phases = re.findall(r"start-up: (.+?) at ([0-9.]+) s, ([0-9]+) MiB resident$", out.stderr, flags=re.M)
    assert [name for name, _, _ in phases] == ["command line read (imports)",
                                               "federation prepared (data sizes, privacy calibration)"]
    seconds, mib = [float(t) for _, t, _ in phases], [int(m) for _, _, m in phases]
    assert 0 < seconds[0] <= seconds[1] < 300 and min(mib) > 100  # torch is imported by then


def test_unwritable_output_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = rfedray("run", *TINY, f"run.output_dir={blocker}/sub")
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error: run.output_dir=")


def test_experiment_list_names_every_study_with_its_times():
    from rfedray.studies import STUDIES

    out = rfedray("experiment", "--list")
    assert out.returncode == 0, out.stderr
    listed = [line.split()[0] for line in out.stdout.splitlines()[1:] if line.strip() and not line.startswith("expected")]
    assert listed == list(STUDIES)


@pytest.mark.parametrize("args, message", [
    (["noise-ratio", "colour=red"], "experiment option 'colour=red': allowed are scale=..., out=..."),
    (["noise-ratio", "scale=huge"], "scale='huge': must be one of tiny, full"),
    (["noise-ratio", "workers=0"], "workers='0': must be an integer >= 1"),
    (["noise-ratio", "dataset=PhysionetMI"], "dataset=: study 'noise-ratio' has no dataset to choose"),
    (["eeg-centralised", "dataset=Lee2019", "scale=tiny"], "dataset='Lee2019': the EEG studies run PhysionetMI"),
    (["no-such-study"], "experiment 'no-such-study': unknown study"),
    (["noise-ratio", "data.options.radius=0.5"], "data.options.radius=0.5: study 'noise-ratio' takes no config overrides"),
])
def test_experiment_bad_options_are_one_line_errors(args, message):
    out = rfedray("experiment", *args)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
