"""The ``privacy`` command (rfedray.privacy.commands): calibrate, epsilon, table, one-line errors."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rfedray.errors import RfedrayError
from rfedray.privacy import commands, paper
from rfedray.privacy.accountants import ACCOUNTANTS, UPPER_BOUNDS, calibrate_sigma

ROOT = Path(__file__).resolve().parents[1]
MECHANISM = ["--delta", "1e-5", "--rounds", "200", "--local-steps", "10", "--batch-size", "500",
             "--records", "5000", "--clip", "0.3548"]


def cli(argv):
    """Parse and run like a top-level CLI that calls ``register``; return the exit status."""
    parser = argparse.ArgumentParser(prog="rfedray")
    commands.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except RfedrayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


@pytest.mark.parametrize("accountant", UPPER_BOUNDS)
def test_calibrate_then_epsilon_round_trip(accountant, capsys):
    assert cli(["privacy", "calibrate", "--epsilon", "2", *MECHANISM, "--accountant", accountant, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"sigma", "epsilon", "delta", "accountant"}
    assert out["accountant"] == accountant and out["epsilon"] == 2.0 and out["delta"] == 1e-5
    expected = calibrate_sigma(ACCOUNTANTS[accountant](), epsilon=2.0, delta=1e-5, rounds=200, local_steps=10,
                               batch_size=500, records=5000, clip=0.3548)
    assert out["sigma"] == pytest.approx(expected, rel=1e-12)

    assert cli(["privacy", "epsilon", "--sigma", repr(out["sigma"]), *MECHANISM, "--accountant", accountant,
                "--json"]) == 0
    back = json.loads(capsys.readouterr().out)
    assert back["epsilon"] <= 2.0 and back["epsilon"] == pytest.approx(2.0, rel=1e-5)


def test_plain_output_is_one_number(capsys):
    assert cli(["privacy", "calibrate", "--epsilon", "1", *MECHANISM]) == 0
    sigma = float(capsys.readouterr().out.strip())
    assert sigma == pytest.approx(paper.SIGMA_OURS[1], rel=0.01)
    assert cli(["privacy", "epsilon", "--sigma", "0.0242", *MECHANISM]) == 0
    assert float(capsys.readouterr().out.strip()) == pytest.approx(1.0, rel=0.05)
    assert cli(["privacy", "epsilon", "--sigma", "0.0242", *MECHANISM, "--accountant", "clt"]) == 0
    value, label = capsys.readouterr().out.strip().split(" ", 1)
    assert float(value) == pytest.approx(1.0, rel=0.05) and label.startswith("(approximation")


@pytest.mark.parametrize("argv, message", [
    (["calibrate", "--epsilon", "-1", *MECHANISM], "--epsilon=-1: must be > 0"),
    (["calibrate", "--epsilon", "0", *MECHANISM], "--epsilon=0: must be > 0"),
    (["calibrate", "--epsilon", "abc", *MECHANISM], "--epsilon=abc: must be a number"),
    (["calibrate", "--epsilon", "1", *MECHANISM, "--accountant", "rdp"],
     "--accountant=rdp: must be one of exact, clt, prirfed"),
    (["calibrate", "--epsilon", "1", *MECHANISM, "--delta", "1"], "--delta=1: must be in (0, 1)"),
    (["calibrate", "--epsilon", "1", *MECHANISM, "--rounds", "0"], "--rounds=0: must be an integer >= 1"),
    (["calibrate", "--epsilon", "1", *MECHANISM, "--rounds", "1.5"], "--rounds=1.5: must be an integer"),
    (["calibrate", "--epsilon", "1", *MECHANISM, "--batch-size", "6000"],
     "--batch-size=6000: must be an integer in [1, records=5000]"),
    (["epsilon", "--sigma", "-0.1", *MECHANISM], "--sigma=-0.1: must be > 0"),
    (["epsilon", "--sigma", "0.1", *MECHANISM, "--local-steps", "-1"], "--local-steps=-1: must be an integer >= 0"),
    (["epsilon", "--sigma", "0.1", *MECHANISM, "--clip", "nan"], "--clip=nan: must be a real number"),
])
def test_bad_arguments_print_one_line_and_exit_2(argv, message, capsys):
    assert cli(["privacy", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1
    assert captured.err.startswith(f"error: {message}")


def test_module_entry_point_and_exit_status():
    run = subprocess.run(
        [sys.executable, "-m", "rfedray.cli", "privacy", "calibrate", "--epsilon", "-1", *MECHANISM],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 2
    assert run.stderr == "error: --epsilon=-1: must be > 0\n"


def test_format_table_shows_both_rows_their_differences_and_the_clip():
    rows = [paper.Table10Row(e, o * 1.001, o, p * 0.998, p)
            for e, o, p in zip(paper.EPSILONS, paper.SIGMA_OURS, paper.SIGMA_PRIRFED)]
    text = commands.format_table(rows, 0.3548)
    assert "C=0.3548" in text
    assert "+0.10%" in text and "-0.20%" in text
    assert "within 1%" in text
    for o, p in zip(paper.SIGMA_OURS, paper.SIGMA_PRIRFED):
        assert f"{o:g}" in text and f"{p:g}" in text
    assert f"{0.998 * 0.247 / (1.001 * 0.0452):.2f}" in text


def test_table_reproduces_the_paper_within_one_percent(capsys):
    assert cli(["privacy", "table", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["clip"] == paper.PAPER_CLIP
    assert [r["epsilon"] for r in out["rows"]] == list(paper.EPSILONS)
    for row in out["rows"]:
        assert abs(row["diff_ours"]) < 0.01 and abs(row["diff_prirfed"]) < 0.01
        assert 5.0 <= row["ratio"] <= 6.0
    assert out["max_abs_diff"] < 0.01
