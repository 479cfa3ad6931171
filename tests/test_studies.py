"""Every study runs end to end at the tiny scale; the paper's numbers are the seeds' numbers."""

import csv
import json
import re
from pathlib import Path

import pytest

from rfedray.privacy.paper import PAPER_CLIP
from rfedray.studies import STUDIES, get_study, paper

SEEDS = Path(__file__).resolve().parents[1].parent / "shared" / "seeds" / "000_85d8e755889788bd.txt"


def _numbers_in_seed() -> set[float]:
    text = SEEDS.read_text().replace("\u22c5", "*").replace("\u2212", "-")
    values = set()
    for mantissa, exponent in re.findall(r"(\d+(?:\.\d+)?)\*10(-?\d+)", text):
        values.add(round(float(mantissa) * 10 ** int(exponent), 12))
    for exponent in re.findall(r"=10(-\d+)", text):
        values.add(round(10.0 ** int(exponent), 12))
    for number in re.findall(r"\d+(?:\.\d+)?", text):
        values.add(round(float(number), 12))
    return values


def test_paper_values_are_the_seeds_values():
    seen = _numbers_in_seed()
    expected = []
    for row in paper.TABLE9:
        expected += list(row[1:])
    for eps, row in paper.TABLE10.items():
        expected += [eps, *row]
    for row in paper.TABLE15.values():
        expected += list(row.values())
    expected += list(paper.TABLE4.values())
    missing = [v for v in expected if round(float(v), 12) not in seen]
    assert not missing, f"not in the seed document: {missing}"


@pytest.mark.parametrize("name", ["noise-ratio", "aggregation-cost", "fedpca-participation", "fedpca-accounting", "fedpca-dimension"])
def test_study_runs_at_tiny_scale(tmp_path, name):
    report = get_study(name).run(tmp_path, "tiny", workers=2)
    assert report.is_file()
    text = report.read_text()
    assert "paper" in text
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload and all(table["rows"] for table in payload)
    with open(tmp_path / "results.csv") as fh:
        assert len(list(csv.reader(fh))) > 1
    for figure in re.findall(r"\]\(([^)]+\.png)\)", text):
        assert (tmp_path / figure).stat().st_size > 1000


def test_noise_ratio_reproduces_figure_4b(tmp_path):
    get_study("noise-ratio").run(tmp_path, "tiny")
    rows = json.loads((tmp_path / "results.json").read_text())[0]["rows"]
    for row in rows:
        assert 5.0 <= row["ours"]["ratio"] <= 6.0
        if row["paper"]:
            assert row["ours"]["sigma ours"] == pytest.approx(row["paper"]["sigma ours"], rel=0.01)


def test_every_study_is_listed():
    for name in STUDIES:
        study = get_study(name)
        assert study.name == name and set(study.laptop_minutes) == {"tiny", "full"}


def test_fitted_clip_is_in_the_paper_config():
    from rfedray.config import load_config

    assert load_config(None).privacy.clip == PAPER_CLIP


TINY_JOBS = [["run.engine=local", "run.rounds=3", "federation.n_clients=4", "federation.clients_per_round=2",
             "data.options.records_per_client=50", "data.options.d=6", "data.options.p=2",
             "federation.batch_size=10", "federation.local_steps=2", f"run.seed={seed}",
             f"privacy.noise_seed={seed}", "run.test_set=server"] for seed in (0, 1)]


def test_an_interrupted_study_reuses_finished_runs_and_reruns_the_others(tmp_path, capsys):
    from rfedray.studies.base import job_directory_name, run_many

    jobs = TINY_JOBS
    first = run_many(jobs, tmp_path, workers=1)
    assert [s["reused"] for s in first] == [False, False]
    # The second job was cut off mid-run: its directory holds no summary.
    (tmp_path / job_directory_name(jobs[1]) / "summary.json").unlink()
    second = run_many(jobs, tmp_path, workers=1)
    assert [s["reused"] for s in second] == [True, False]
    assert [s["final_metrics"] for s in second] == [s["final_metrics"] for s in first]
    assert "2/2 runs (1 reused" in capsys.readouterr().err


def test_settings_that_make_the_same_run_share_it(tmp_path, capsys):
    """run_grid runs each distinct override list once (two keys running the same directory at once
    in a process pool would race), and every key gets its summary."""
    from rfedray.studies.base import run_grid

    done = run_grid({"a": TINY_JOBS[0], "b": TINY_JOBS[1], "a again": list(TINY_JOBS[0])}, tmp_path, workers=1)
    assert done["a"] is done["a again"] and done["a"]["run_dir"] != done["b"]["run_dir"]
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2
    assert "2/2 runs" in capsys.readouterr().err


def test_a_study_connected_to_ray_runs_each_job_as_a_ray_task(tmp_path):
    import os

    import ray

    from rfedray.studies.base import run_many

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = run_many(TINY_JOBS, tmp_path / "ray")
    finally:
        ray.shutdown()
    here = run_many(TINY_JOBS, tmp_path / "here", workers=1)
    assert all(s["ran_on"]["pid"] != os.getpid() for s in on_ray)
    assert all(s["ran_on"]["pid"] == os.getpid() for s in here)
    assert [s["final_metrics"] for s in on_ray] == [s["final_metrics"] for s in here]


def test_config_overrides_reach_every_run_of_a_study(tmp_path):
    import yaml

    report = get_study("fedpca-participation").run(tmp_path, "tiny", workers=2, seeds=1,
                                                   overrides=["data.options.radius=0.5"])
    assert "Every run also with: `data.options.radius=0.5`" in report.read_text()
    configs = [yaml.safe_load(path.read_text()) for path in (tmp_path / "runs").glob("job-*/config.yaml")]
    assert configs and all(c["data"]["options"]["radius"] == 0.5 for c in configs)
