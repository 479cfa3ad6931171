"""The EEG studies: their paper values are the seeds' tables, their configurations follow Table 11 and 13,
and every study runs end to end at the tiny scale on the real PhysionetMI files."""

import csv
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from rfedray.config import load_config
from rfedray.data.eeg import DATASETS
from rfedray.errors import RfedrayError
from rfedray.studies import eeg, get_study
from rfedray.studies.base import Row, Table

SEEDS = Path(__file__).resolve().parents[1].parent / "shared" / "seeds" / "000_85d8e755889788bd.txt"
PAPER_DATASETS = ("BNCI2014_001", "Cho2017", "Weibo2014")
needs_physionet = pytest.mark.skipif(not DATASETS["PhysionetMI"].default_path.is_dir(), reason="the shared EEG files are not there")


@pytest.fixture(scope="module")
def seeds() -> str:
    return SEEDS.read_text()


def pair(value: tuple[float, float]) -> str:
    """A mean and std as the seeds print them: ``56.5±1.8``."""
    return f"{value[0]:.1f}±{value[1]:.1f}"


def power_of_ten(value: float) -> str:
    """``1e-2`` -> ``10−2``, ``3e-3`` -> ``3⋅10−3``, as the seeds print Table 11's learning rates."""
    exponent = math.floor(math.log10(value))
    mantissa = round(value / 10 ** exponent, 6)
    return ("" if mantissa == 1 else f"{mantissa:g}\u22c5") + f"10\u2212{-exponent}"


def between(text: str, start: str, end: str) -> str:
    """The text from the first ``start`` to the next ``end``."""
    head = text.index(start)
    return text[head:text.index(end, head)]


def table_blocks(text: str, caption: str, previous_caption: str) -> dict[str, str]:
    """The rows of a Table 7/8-like table of the seeds, by dataset (``<name> chance <c>`` headings)."""
    body = between(text, previous_caption, caption)
    parts = re.split(r"\n(\w+) chance ([\d.]+)\n", body)
    return {parts[i]: f"chance {parts[i + 1]}\n{parts[i + 2]}\n" for i in range(1, len(parts) - 1, 3)}


def test_table6_values_are_the_seeds(seeds):
    body = between(seeds, "Dataset\nChance\nSPDNet\nEEGNet", "Table 6:")
    for dataset, models in eeg.TABLE6.items():
        assert f"{dataset}\n{eeg.CHANCE[dataset]}\n{pair(models['SPDNet'])}\n{pair(models['EEGNet'])}\n" in body


@pytest.mark.parametrize("table, caption, previous", [
    (eeg.TABLE7, "Table 7:", "Table 6:"),
    (eeg.TABLE8, "Table 8:", "Table 7:"),
])
def test_tables_7_and_8_values_are_the_seeds(seeds, table, caption, previous):
    blocks = table_blocks(seeds, caption, previous)
    for dataset, arms in table.items():
        block = blocks[dataset]
        assert block.startswith(f"chance {eeg.CHANCE[dataset]}\n")
        for arm, values in arms.items():
            assert f"{arm}\n" + "\n".join(pair(v) for v in values) + "\n" in block, (dataset, arm)


def test_table11_and_13_values_are_the_seeds(seeds):
    table11 = between(seeds, "Dataset\nModel\n", "Table 11:")
    for dataset in PAPER_DATASETS:
        rows = "".join(f"{model}\n{power_of_ten(lr)}\n{b}\n{t}\n" for model in ("SPDNet", "EEGNet")
                       for lr, b, t in [eeg.TABLE11[(dataset, model)]])
        assert f"{dataset}\n{rows}" in table11
    table13 = between(seeds, "Parameters\nDataset\n", "Table 13:")
    for dataset, values in eeg.TABLE13.items():
        assert dataset + "".join(f"\n{v:,}" for v in values) + "\n" in table13


@pytest.mark.parametrize("dataset", PAPER_DATASETS)
@pytest.mark.parametrize("model", ["spdnet", "eegnet"])
def test_paper_configs_follow_tables_11_and_13(dataset, model):
    """Table 11's eta0, B, T; Table 13's n; full participation; one local epoch of a typical client per round."""
    data, cfg = eeg.EEGStudy(dataset).base(model)
    lr, batch, rounds = eeg.TABLE11[(dataset, eeg.MODELS[model].label)]
    n, smallest, largest = eeg.TABLE13[dataset][:3]
    assert cfg.data.options["dataset"] == dataset and cfg.model.name == model
    assert {group["lr"] for group in data["optim"].values()} == {lr}
    assert (cfg.federation.batch_size, cfg.run.rounds) == (batch, rounds)
    assert cfg.federation.n_clients == cfg.federation.clients_per_round == n
    assert cfg.federation.local_steps == round((smallest + largest) / 2 / batch)
    assert cfg.privacy.enabled and cfg.privacy.epsilon == 20 and cfg.privacy.delta == 1e-5


def test_chance_levels():
    assert eeg.chance("PhysionetMI") == 50.0
    for dataset in PAPER_DATASETS:
        assert eeg.chance(dataset) == pytest.approx(100 / len(DATASETS[dataset].events), abs=0.05)


def test_flatten_round_trips_a_config():
    study = eeg.EEGStudy()
    data, cfg = study.base("spdnet")
    assert load_config(None, eeg.flatten(data)) == cfg
    assert eeg.flatten({"a": {"b": [1, 2], "c": None, "d": 1e-5, "e": True}}) == ["a.b=[1, 2]", "a.c=null", "a.d=1.0e-05", "a.e=true"]


def test_smoothing_is_a_trailing_mean_over_five_rounds():
    values = np.arange(1.0, 9.0)[None, :]
    expected = [np.mean(values[0, max(0, i - 4):i + 1]) for i in range(8)]
    np.testing.assert_allclose(eeg.smoothed(values)[0], expected)


def test_values_print_as_the_papers():
    assert str(eeg.MeanStd((55.14, 1.76))) == "55.1 ± 1.8"
    paper = eeg.PaperValue(55.1, 1.8)
    assert f"{paper:.4g}" == "55.1 ± 1.8" and float(paper) == 55.1


def test_unknown_dataset_is_refused():
    with pytest.raises(RfedrayError, match="dataset='BNCI2015_001'"):
        eeg.EEGFederated("BNCI2015_001")


def check_outputs(out: Path, report: Path) -> str:
    """report.md, results.json and results.csv are there and full, and every figure is a real PNG."""
    assert report == out / "report.md" and report.is_file()
    text = report.read_text()
    payload = json.loads((out / "results.json").read_text())
    assert payload and all(table["rows"] for table in payload)
    with open(out / "results.csv") as fh:
        assert len(list(csv.reader(fh))) > 1
    figures = re.findall(r"\]\(([^)]+\.png)\)", text)
    assert figures
    for figure in figures:
        assert (out / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / figure).stat().st_size > 5000
    assert "The paper has no PhysionetMI column" in text and "chance 50.0 %" in text
    return text


def accuracy_cells(payload: list[dict]) -> list[float]:
    return [v[0] for table in payload for row in table["rows"] for k, v in row["ours"].items() if k.startswith("accuracy") or k in eeg.PRIVACY_COLUMNS]


@needs_physionet
def test_prirfed_study_at_tiny_scale(tmp_path):
    text = check_outputs(tmp_path, get_study("eeg-prirfed").run(tmp_path, "tiny", workers=2))
    rows = json.loads((tmp_path / "results.json").read_text())[0]["rows"]
    assert [r["label"]["accounting"] for r in rows] == ["exact", "exact", "exact", "prirfed"]
    assert rows[-1]["ours"]["sigma"] > 3 * rows[0]["ours"]["sigma"]
    assert all(r["ours"]["max epsilon spent"] <= 20 for r in rows)
    assert "sigma PriRFed / sigma ours" in text


@needs_physionet
def test_centralised_study_at_tiny_scale(tmp_path):
    text = check_outputs(tmp_path, get_study("eeg-centralised").run(tmp_path, "tiny", workers=2))
    assert "N = 379 training trials, B = 12, local_steps = round(N / B) = 32" in text  # the 17 subjects, half held out
    assert all(0 <= a <= 100 for a in accuracy_cells(json.loads((tmp_path / "results.json").read_text())))


@needs_physionet
@pytest.mark.slow
def test_curves_study_at_tiny_scale(tmp_path):
    check_outputs(tmp_path, get_study("eeg-curves").run(tmp_path, "tiny", workers=2))
    rows = json.loads((tmp_path / "results.json").read_text())[0]["rows"]
    assert [(r["label"]["arm"], r["label"]["T"]) for r in rows] == [(a, t) for a in ("SPDNet ProjAvg", "EEGNet") for t in (2, 4, 8)]
    sigmas = [r["ours"]["sigma"] for r in rows[:3]]
    assert sigmas == sorted(sigmas)


@needs_physionet
@pytest.mark.slow
def test_federated_study_at_tiny_scale(tmp_path):
    text = check_outputs(tmp_path, get_study("eeg-federated").run(tmp_path, "tiny", workers=2))
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [len(t["rows"]) for t in payload[:2]] == [4, 2]
    assert all(r["ours"]["max epsilon spent"] <= float(r["label"]["target"][2:]) for r in payload[2]["rows"])
    assert payload[3]["rows"][0]["ours"] == {"n": 17, "smallest m": 22, "largest m": 23}
    assert "Qualitative comparison" in text and "paper, BNCI2014_001" in text


def test_report_puts_the_paper_values_beside_ours():
    """For a paper dataset the rows carry Table 7's values and print them as the paper does."""
    table = Table("t", [Row(label={"arm": "SPDNet ProjAvg"}, ours={"ε=20": eeg.MeanStd((44.0, 1.0))},
                                    paper={"ε=20": eeg.PaperValue(*eeg.TABLE7["BNCI2014_001"]["SPDNet ProjAvg"][1])})])
    assert "| SPDNet ProjAvg | 44.0 ± 1.0 | 43.3 ± 1.9 | +1.6% |" in table.markdown()


def test_physionet_study_searches_on_validation_splits_and_tests_on_one_fixed_split():
    """Issue 20's search: every search run evaluates the validation split cut from the training
    trials, no test run does, and every run (search or test) holds out the same test split."""
    from rfedray.studies.eeg_physionet import SCALES as PHYSIONET_SCALES
    from rfedray.studies.eeg_physionet import SEARCH_SEED0, HyperparameterSearch

    study, scale = get_study("eeg-physionet"), PHYSIONET_SCALES["tiny"]
    search = HyperparameterSearch(study, scale)
    settings = study.settings(scale)
    jobs = search.jobs(settings)
    chosen = {(n, arm.label, column): {"candidate": search.candidates(arm, column)[0]} for n, arm, column in settings}
    plan = study.plan(scale, chosen)

    def last(overrides, key):
        return [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")][-1]

    assert all(last(o, "data.options.evaluate_on") == "validation" and int(last(o, "run.seed")) >= SEARCH_SEED0 for o in jobs.values())
    assert not any(any(x.startswith("data.options.evaluate_on=") for x in o) for o in plan.values())
    assert {int(last(o, "run.seed")) for o in plan.values()} == set(range(scale.seeds))
    assert {last(o, "data.options.split_seed") for o in [*jobs.values(), *plan.values()]} == {"0"}
