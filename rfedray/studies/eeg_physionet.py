"""The 17-subject PhysionetMI federation: where privacy costs accuracy, and why (issue 20).

``rfedray experiment eeg-physionet`` runs, over 10 seeds, the arms of the paper's EEG tables on the
17 real PhysioNet subjects of ``shared/data/eegmmidb`` (imagined left vs right fist, half of every
subject's trials held out for testing, one test split for every seed):

- groupings: 17 clients of one subject each, and 6 clients of 2-3 subjects (as the paper groups
  Cho2017's 52 subjects into 26 clients of 2); for the accuracy against records per client also 3
  clients of 5-6 subjects and one client holding everything (the centralised run of Table 6);
- arms: SPDNet with ProjAvg, RLAvg and RetAvg, EEGNet, and PriRFed (RetAvg at the noise of its own
  round-level accounting), non-private and at epsilon 20, 10, 5 (delta 1e-5), at full participation;
  ProjAvg and EEGNet (Table 8's arms) at half participation, with the hyperparameters of full
  participation (as Table 8's caption says);
- the pyriemann reference (shrinkage covariances, tangent space at the training mean, logistic
  regression) fitted on the pooled training trials of the same split;
- Figure 7's horizons T/2, T, 2T at epsilon 5 (SPDNet ProjAvg and EEGNet, 17 clients).

Hyperparameters are chosen honestly (:class:`HyperparameterSearch`): for every grouping, arm and
budget, each candidate of a small grid (step sizes, clip C, local steps tau, rounds T; batch size B
and the head's weight decay where the grid varies them) runs on validation splits cut from each
subject's *training* trials (``data.options.evaluate_on=validation``, :class:`rfedray.data.eeg.Holdout`),
over several search seeds that also re-cut the validation split; the candidate with the best mean
validation accuracy is the one the 10 test seeds run. The test split is fixed for all seeds
(``split_seed``), so that no validation record of the search is a test record of any run. The
search's cost (runs, CPU seconds) is part of the report. The tuning is not charged to the privacy
budget (as in the paper): the reported epsilon covers one training run with the chosen values, not
the choice among the candidates.

The report also measures what limits the private runs: for the chosen configurations, the records
per client ``m``, the sampling rate ``q = B/m``, the steps ``T tau``, the noise ``sigma`` per
coordinate of one client's step and of the cohort's average, and the signal, the norm of the mean
clipped per-record gradient over the clients' training records, at the start and the end of a run.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from rfedray.studies.base import Row, Table, mean_std, pyplot, run_grid, save_figure, write_outputs
from rfedray.studies.eeg import (
    EEGNET, PRIRFED, PROJAVG, RETAVG, RLAVG, Arm, EEGStudy, MeanStd, PRIVACY_COLUMNS, TABLE6, TABLE7,
    TABLE8, accuracies, accuracy_curve, accuracy_row, curves_panel, half,
)

SUBJECTS = tuple(range(1, 18))
"""The subjects of the offline copy (S001-S017)."""
SUBJECTS_OVERRIDE = f"data.options.subjects=[{','.join(map(str, SUBJECTS))}]"


@dataclass(frozen=True)
class Candidate:
    """One point of a hyperparameter grid: configuration values by dotted key.

    Attributes
    ----------
    values : tuple of (key, value)
        E.g. ``(("optim.head.lr", 0.3), ("privacy.clip", 1.0), ("run.rounds", 30))``.
    """

    values: tuple[tuple[str, Any], ...]

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.values).get(key, default)

    def overrides(self, drop: Sequence[str] = ()) -> list[str]:
        return [f"{k}={v}" for k, v in self.values if k not in drop]

    def describe(self) -> str:
        return ", ".join(f"{k.split('.', 1)[1] if k.startswith(('optim.', 'federation.', 'privacy.', 'run.')) else k}={v:g}"
                         if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}" for k, v in self.values)

    @classmethod
    def grid(cls, **axes: Sequence[Any]) -> list["Candidate"]:
        """Every combination of the axes; an axis name is a dotted key with ``__`` for ``.``."""
        keys = [k.replace("__", ".") for k in axes]
        return [cls(tuple(zip(keys, combo))) for combo in itertools.product(*axes.values())]


NONPRIVATE_ONLY_IRRELEVANT = ("privacy.clip",)
"""Keys that do not act without privacy: candidates differing only there are one non-private candidate."""


@dataclass(frozen=True)
class Scale:
    """How much of the study runs.

    Attributes
    ----------
    seeds : int
        Test seeds 0..seeds-1.
    search_seeds : int
        Validation seeds per candidate.
    groupings, record_groupings : tuple of int
        Client counts of the main tables, and of the accuracy against records per client.
    max_rounds, max_local_steps : int or None
        Caps (tiny scale), else the grid's values.
    max_candidates : int or None
        Only the first candidates of each grid (tiny scale).
    note : str
    """

    seeds: int
    search_seeds: int
    groupings: tuple[int, ...]
    record_groupings: tuple[int, ...]
    max_rounds: Optional[int]
    max_local_steps: Optional[int]
    max_candidates: Optional[int]
    note: str


SCALES = {
    "full": Scale(10, 3, (17, 6), (17, 6, 3, 1), None, None, None,
                  "the searched horizon T and local steps, 3 validation seeds per candidate"),
    "tiny": Scale(2, 1, (6,), (6, 3), 2, 1, 2,
                  "2 rounds of one local step, the first 2 candidates of each grid on 1 validation seed: "
                  "a smoke test of the pipeline, not a result"),
}

SEARCH_SEED0 = 1000
"""Search runs use seeds 1000, 1001, ... (they also cut the validation splits); test runs 0..9."""

GRIDS: dict[str, list[Candidate]] = {
    "spdnet": Candidate.grid(
        optim__head__lr=(0.1, 0.3),
        optim__bimap__lr=(0.003,),
        privacy__clip=(1.0, 2.0),
        federation__local_steps=(5,),
        run__rounds=(60,),
    ),
    "eegnet": Candidate.grid(
        optim__default__lr=(1e-3, 3e-3),
        privacy__clip=(1.0,),
        federation__local_steps=(2,),
        run__rounds=(30,),
    ),
}
"""The candidates of every search. SPDNet (BiMap at the C3/C4 Laplacians, scale-free features of
norm about 0.4, group-wise clipping with the configuration's shares, head 0.7 and BiMap 0.71 of C):
the head's step size (0.1 and 0.3 were the best on validation with these shares,
docs/results/eeg-physionet/analysis.md), and a clip at or above the median per-record tangent norm
(about 2 at the start, 1.9 of it the BiMap's); the BiMap's step size stays small (it starts at the
public filters). EEGNet has its own, smaller grid: its private step costs about 60 times SPDNet's."""


def grouping_label(n: int) -> str:
    sizes = sorted({len(g) for g in np.array_split(np.asarray(SUBJECTS), n)})
    return f"{n} client{'s' if n > 1 else ''} of {'-'.join(map(str, sizes))} subject{'s' if sizes[-1] > 1 else ''}"


class HyperparameterSearch:
    """Chooses, per (grouping, arm, budget), the candidate with the best mean validation accuracy.

    Parameters
    ----------
    study : EEGPhysionet
    scale : Scale
    """

    def __init__(self, study: "EEGPhysionet", scale: Scale):
        self.study, self.scale = study, scale

    def candidates(self, arm: Arm, column: str) -> list[Candidate]:
        """The arm's grid; without privacy the clip does not act, so candidates that differ only
        there are run once."""
        grid = GRIDS[arm.model][: self.scale.max_candidates]
        if column != "non-private":
            return grid
        first: dict[tuple[str, ...], Candidate] = {}
        for c in grid:
            first.setdefault(tuple(c.overrides(drop=NONPRIVATE_ONLY_IRRELEVANT)), c)
        return list(first.values())

    def jobs(self, settings: Sequence[tuple[int, Arm, str]]) -> dict[tuple, list[str]]:
        """Search runs of every (grouping, arm, column): ``key -> overrides``."""
        return {
            (n, arm.label, column, i, s): self.study.job(arm, n, candidate, column, SEARCH_SEED0 + s, self.scale, search=True)
            for n, arm, column in settings for i, candidate in enumerate(self.candidates(arm, column))
            for s in range(self.scale.search_seeds)
        }

    def choose(self, settings: Sequence[tuple[int, Arm, str]], summaries: dict) -> dict[tuple[int, str, str], dict]:
        """``(grouping, arm label, column) -> {"candidate", "validation" (mean, std), "table"}``."""
        chosen = {}
        for n, arm, column in settings:
            scores = []
            for i, candidate in enumerate(self.candidates(arm, column)):
                runs = [summaries[(n, arm.label, column, i, s)] for s in range(self.scale.search_seeds)]
                scores.append((mean_std([100.0 * r["final_metrics"]["accuracy"] for r in runs]), i, candidate))
            best, i, candidate = max(scores, key=lambda item: (item[0][0], -item[1]))
            chosen[(n, arm.label, column)] = {"candidate": candidate, "validation": best,
                                              "scores": [(c.describe(), m) for (m, _), _, c in scores]}
        return chosen

    @staticmethod
    def cost(summaries: dict) -> dict[str, float]:
        """Distinct runs, their hours (each run is one process on one thread: the federation loop's
        wall time, set-up excluded) and how many an earlier start of the study had finished."""
        distinct = {s["run_dir"]: s for s in summaries.values()}.values()
        seconds = sum(s.get("wall_seconds", 0.0) for s in distinct)
        return {"runs": len(distinct), "cpu_hours": seconds / 3600.0, "reused": sum(bool(s.get("reused")) for s in distinct)}


class EEGPhysionet(EEGStudy):
    """Issue 20: the 17-subject PhysionetMI federation, its honest hyperparameters, and what limits
    the private runs (see the module docstring)."""

    name = "eeg-physionet"
    description = ("17-subject PhysionetMI federation (17 and 6 clients): SPDNet ProjAvg/RLAvg/RetAvg, EEGNet, PriRFed; "
                   "non-private and epsilon 20/10/5; full and half participation; validation search; pyriemann reference")
    laptop_minutes = {"tiny": 11, "full": 250}  # full: 8.3 CPU hours measured (3.0 search, 5.3 test runs), workers=2

    full_arms = (PROJAVG, RLAVG, RETAVG, EEGNET, PRIRFED)
    half_arms = (PROJAVG, EEGNET)
    curve_arms = (PROJAVG, EEGNET)

    def __init__(self, dataset: str = "PhysionetMI"):
        super().__init__(dataset)
        if dataset != "PhysionetMI":
            raise ValueError(f"dataset={dataset!r}: the {self.name} study runs the 17 PhysionetMI subjects only")

    # -- runs ---------------------------------------------------------------------------------

    @staticmethod
    def columns(arm: Arm) -> list[str]:
        """PriRFed is an accounting: it has no non-private column."""
        return [c for c in PRIVACY_COLUMNS if not (arm is PRIRFED and c == "non-private")]

    def job(self, arm: Arm, n: int, candidate: Candidate, column: str, seed: int, scale: Scale, *,
            cohort: Optional[int] = None, search: bool = False, rounds: Optional[int] = None) -> list[str]:
        """Overrides of one run: the arm's configuration file on ``n`` clients, the candidate's values
        (capped by the scale), the budget, the cohort size, the seed. Test runs evaluate every round
        (Figure 7's curves come with them); search runs evaluate the validation split at the end."""
        horizon = rounds or candidate.get("run.rounds")
        if scale.max_rounds is not None:
            horizon = min(horizon, scale.max_rounds) if rounds is None else rounds
        steps = candidate.get("federation.local_steps")
        if scale.max_local_steps is not None:
            steps = min(steps, scale.max_local_steps)
        drop = ("run.rounds", "federation.local_steps", *(NONPRIVATE_ONLY_IRRELEVANT if column == "non-private" else ()))
        setting = (SUBJECTS_OVERRIDE, f"federation.n_clients={n}", f"federation.clients_per_round={cohort or n}", *candidate.overrides(drop))
        overrides = self.run_overrides(arm, seed, horizon, steps, horizon if search else 1, setting, PRIVACY_COLUMNS[column])
        if n == 1:  # one client holding everything: the server evaluates (a secure sum needs two clients)
            overrides.append("run.test_set=server")
        return overrides + (["data.options.evaluate_on=validation"] if search else [])

    def settings(self, scale: Scale) -> list[tuple[int, Arm, str]]:
        """Every (grouping, arm, column) that gets its own search."""
        settings = [(n, arm, column) for n in scale.groupings for arm in self.full_arms for column in self.columns(arm)]
        settings += [(n, PROJAVG, column) for n in scale.record_groupings if n not in scale.groupings for column in PRIVACY_COLUMNS]
        if 1 in scale.record_groupings:
            settings.append((1, EEGNET, "non-private"))  # Table 6: the centralised EEGNet
        return settings

    def plan(self, scale: Scale, chosen: dict) -> dict[tuple, list[str]]:
        """The test runs: ``(grouping, k, arm label, column, T, seed) -> overrides``."""
        jobs = {}

        def add(n, k, arm, column, seed, rounds=None):
            candidate = chosen[(n, arm.label, column)]["candidate"]
            horizon = rounds or min(candidate.get("run.rounds"), scale.max_rounds or candidate.get("run.rounds"))
            jobs[(n, k, arm.label, column, horizon, seed)] = self.job(arm, n, candidate, column, seed, scale, cohort=k, rounds=rounds)

        for seed in range(scale.seeds):
            for n, arm, column in self.settings(scale):
                add(n, n, arm, column, seed)
            for n in scale.groupings:
                for arm in self.half_arms:
                    for column in PRIVACY_COLUMNS:
                        add(n, half(n), arm, column, seed)
            n = scale.groupings[0]
            for arm in self.curve_arms:
                horizon = self.horizon(chosen, n, arm, "ε=5", scale)
                for rounds in (max(1, horizon // 2), 2 * horizon):
                    add(n, n, arm, "ε=5", seed, rounds)
        return jobs

    @staticmethod
    def horizon(chosen: dict, n: int, arm: Arm, column: str, scale: Scale) -> int:
        rounds = chosen[(n, arm.label, column)]["candidate"].get("run.rounds")
        return min(rounds, scale.max_rounds or rounds)

    # -- the study ----------------------------------------------------------------------------

    def run(self, out: Path, scale: str, workers=None, seeds=None) -> Path:
        sc = SCALES[scale] if seeds is None else replace(SCALES[scale], seeds=seeds)
        started = time.perf_counter()
        search = HyperparameterSearch(self, sc)
        settings = self.settings(sc)
        search_runs = run_grid(search.jobs(settings), out / "search", workers)
        chosen = search.choose(settings, search_runs)
        (out / "search.json").write_text(json.dumps(
            {f"{n} clients | {arm} | {column}": {"chosen": c["candidate"].describe(), "validation accuracy": c["validation"],
                                                "candidates": c["scores"]}
             for (n, arm, column), c in chosen.items()}, indent=1))
        runs = run_grid(self.plan(sc, chosen), out / "runs", workers)
        reference = self.reference()
        elapsed = time.perf_counter() - started
        report = Report(self, sc, chosen, runs, reference, search.cost(search_runs), search.cost(runs), elapsed)
        return report.write(out)

    def dataset_of(self, n: int, *overrides: str):
        """The SPDNet configuration's dataset on the 17 subjects, cut into ``n`` clients (all taking part;
        its client sizes come from the cache)."""
        from rfedray.federated.setup import build_dataset

        return build_dataset(self.base("spdnet", [SUBJECTS_OVERRIDE, f"federation.n_clients={n}",
                                                  f"federation.clients_per_round={n}", *overrides])[1])

    def reference(self) -> dict[str, float]:
        """The pyriemann reference on the fixed split, fitted on the pooled training trials of all
        subjects, tested on the pooled test trials: shrinkage covariances (the models' inputs,
        each divided by its mean eigenvalue), tangent space at their Riemannian mean, logistic
        regression. On the configurations' channels and on all 64."""
        from pyriemann.tangentspace import TangentSpace
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline

        found = {}
        for label, channels in (("configured channels", []), ("all 64 channels", ["data.options.channels=null"])):
            dataset = self.dataset_of(1, *channels)
            x, y = (t.double().numpy() if t.is_floating_point() else t.numpy() for t in dataset.client_data(0).train)
            xt, yt = (t.double().numpy() if t.is_floating_point() else t.numpy() for t in dataset.eval_data().tensors)
            pipeline = make_pipeline(TangentSpace(metric="riemann"), LogisticRegression(C=1.0, max_iter=5000)).fit(x, y)
            found[label] = 100.0 * float((pipeline.predict(xt) == yt).mean())
            found[f"{label}: channels"] = dataset.info["channels"]
        found["test trials"] = int(yt.shape[0])
        found["training trials"] = int(y.shape[0])
        return found


def one_sided_t(values: Sequence[float], baseline: float | Sequence[float]) -> float:
    """p-value of the one-sided t-test that ``values`` exceed ``baseline`` (a number, or paired values)."""
    from scipy import stats

    diffs = np.asarray(values, dtype=float) - np.asarray(baseline, dtype=float)
    if len(diffs) < 2 or np.allclose(diffs, diffs[0]):
        return 0.0 if diffs.mean() > 0 else 1.0
    return float(stats.ttest_1samp(diffs, 0.0, alternative="greater").pvalue)


def signal_and_noise(run_dir: str) -> dict[str, Any]:
    """What a private run's steps carry: the signal against the noise, at the start and the end.

    The signal is the norm of the mean clipped tangent gradient over every client's training
    records (what an aggregated step moves towards, without noise; clipped as the run clips, jointly
    or by ``privacy.clip_shares``), per parameter group; the noise
    is that of the cohort's averaged step, ``sigma sqrt(dim / k)`` per group (``dim`` the intrinsic
    dimension, that of the tangent space the noise is projected on; ``k`` the cohort). Over ``S = T tau`` steps the signal adds up as ``S`` and the noise
    as ``sqrt(S)``, so ``snr_run = signal sqrt(S k / dim) / sigma``.
    """
    import torch

    from rfedray.config import load_config
    from rfedray.federated.rundir import RunDirectory
    from rfedray.federated.setup import build_dataset, build_model, clip_shares, initial_params
    from rfedray.privacy.mechanism import per_sample_gradients

    cfg = load_config(Path(run_dir) / "config.yaml")
    dataset = build_dataset(cfg)
    model = build_model(cfg, dataset.info)
    x, y = (torch.cat(t) for t in zip(*(dataset.client_data(i).train for i in range(cfg.federation.n_clients))))
    k, sigma, clip = cfg.federation.clients_per_round, cfg.privacy.sigma, cfg.privacy.clip
    steps = cfg.run.rounds * cfg.federation.local_steps
    points = {"start": initial_params(cfg, model), "end": torch.load(RunDirectory(run_dir).final_model)}
    found = {"m (smallest client)": min(dataset.client_sizes()), "B": cfg.federation.batch_size,
             "q = B/m": cfg.federation.batch_size / min(dataset.client_sizes()), "k": k, "steps T tau": steps,
             "sigma": sigma, "C": clip, "noise per coordinate of the cohort's step": sigma / math.sqrt(k)}
    for name, params in points.items():
        per_record = per_sample_gradients(model.per_sample_loss, params, (x, y))
        coords = {g: m.tangent_coordinates(params[g]).coordinates(per_record[g]).flatten(1) for g, m in model.groups.items()}
        norms = torch.sqrt(sum(c.pow(2).sum(1) for c in coords.values()))
        shares = clip_shares(cfg)
        scales = ({g: torch.clamp(clip / norms, max=1.0) for g in coords} if shares is None
                  else shares.scales({g: c.norm(dim=1) for g, c in coords.items()}, clip))
        for g, c in coords.items():
            signal = float((c * scales[g][:, None]).mean(0).norm())
            noise = sigma * math.sqrt(model.groups[g].dim / k)
            found[f"{name}: {g} signal"] = signal
            found[f"{name}: {g} noise per step"] = noise
            found[f"{name}: {g} snr over the run"] = signal * math.sqrt(steps) / noise
        found[f"{name}: median per-record norm / C"] = float(norms.median()) / clip
    return found


class Report:
    """Tables, goal tests, figures and the analysis of an :class:`EEGPhysionet` study."""

    def __init__(self, study: EEGPhysionet, scale: Scale, chosen: dict, runs: dict, reference: dict,
                 search_cost: dict, run_cost: dict, elapsed: float):
        self.study, self.scale, self.chosen, self.runs = study, scale, chosen, runs
        self.reference, self.search_cost, self.run_cost, self.elapsed = reference, search_cost, run_cost, elapsed

    def summaries(self, n: int, k: int, arm: Arm, column: str) -> list[dict]:
        """The test runs of a setting at its chosen horizon, in seed order."""
        rounds = self.study.horizon(self.chosen, n, arm, column, self.scale)
        return [self.runs[(n, k, arm.label, column, rounds, seed)] for seed in range(self.scale.seeds)]

    def values(self, n: int, k: int, arm: Arm, column: str) -> list[float]:
        """Last-round test accuracies (%) of a setting, in seed order."""
        return accuracies(self.summaries(n, k, arm, column))

    # -- tables -------------------------------------------------------------------------------

    def federated_table(self, n: int, k: int, arms: Sequence[Arm], title: str, paper: dict) -> Table:
        rows = [accuracy_row({"clients": grouping_label(n), "k": k, "arm": arm.label},
                             {c: self.values(n, k, arm, c) if c in EEGPhysionet.columns(arm) else None for c in PRIVACY_COLUMNS},
                             paper.get(arm.label)) for arm in arms]
        return Table(title, rows, note=(
            f"Chance 50.0 %. pyriemann reference on the same split (covariances, tangent space, logistic regression, "
            f"non-private, pooled): {self.reference['configured channels']:.1f} % on the configured "
            f"{self.reference['configured channels: channels']} channels, {self.reference['all 64 channels']:.1f} % on all 64. "
            "The paper's values are Cho2017's (two classes, 64 channels), the closest of its datasets; it has no PhysionetMI column."))

    def centralised_table(self) -> Table:
        rows = [accuracy_row({"model": label, "clients": grouping_label(1)}, {"accuracy": self.values(1, 1, arm, "non-private")},
                             [TABLE6["Cho2017"][label]]) for arm, label in ((PROJAVG, "SPDNet"), (EEGNET, "EEGNet"))]
        rows.append(Row(label={"model": "pyriemann reference", "clients": "pooled"},
                        ours={"accuracy": round(self.reference["configured channels"], 1)}))
        return Table("Table 6: centralised non-private test accuracy (%), one client holding every training trial", rows,
                     note="Paper: Cho2017.")

    def records_table(self) -> Table:
        rows = []
        for n in self.scale.record_groupings:
            m = self.study.dataset_of(n).client_sizes()
            rows.append(accuracy_row({"clients": grouping_label(n), "smallest m": min(m), "largest m": max(m)},
                                     {c: self.values(n, n, PROJAVG, c) for c in PRIVACY_COLUMNS}))
        return Table("SPDNet ProjAvg test accuracy (%) against records per client (full participation)", rows,
                     note="The smallest client sets sigma for every client (calibration assumes the worst client).")

    def goals(self) -> Table:
        """The issue's goals, over the test seeds, with one-sided tests (the goals are not loosened)."""
        from scipy.stats import binomtest

        rows = []
        spdnet_arms = (PROJAVG, RLAVG, RETAVG)
        private = [c for c in PRIVACY_COLUMNS if c != "non-private"]
        test_trials = self.reference["test trials"]
        for n in self.scale.groupings:
            for arm in spdnet_arms:
                for column in private:
                    v = self.values(n, n, arm, column)
                    p = one_sided_t(v, 50.0)
                    binomial = sum(binomtest(round(a / 100 * test_trials), test_trials, 0.5, alternative="greater").pvalue < 0.01 for a in v)
                    rows.append(Row(label={"goal": "private SPDNet above chance (p < 0.01)", "clients": n, "arm": arm.label, "budget": column},
                                    ours={"mean ± std": MeanStd(mean_std(v)), "p": p, "met": p < 0.01,
                                          "seeds with binomial p < 0.01": f"{binomial}/{len(v)}"}))
            for column in private:
                eegnet = self.values(n, n, EEGNET, column)
                for arm in spdnet_arms:
                    v = self.values(n, n, arm, column)
                    p = one_sided_t(v, eegnet)
                    rows.append(Row(label={"goal": "SPDNet above EEGNet (paired by seed, p < 0.05)", "clients": n, "arm": arm.label, "budget": column},
                                    ours={"mean ± std": MeanStd(mean_std(list(np.subtract(v, eegnet)))), "p": p, "met": p < 0.05}))
            for arm in spdnet_arms:
                gap = mean_std(self.values(n, n, arm, "ε=20"))[0] - mean_std(self.values(n, n, arm, "non-private"))[0]
                rows.append(Row(label={"goal": "a Riemannian scheme within 5 points of non-private at ε=20", "clients": n, "arm": arm.label,
                                       "budget": "ε=20"}, ours={"mean ± std": f"{gap:+.1f} points", "p": None, "met": gap >= -5.0}))
        return Table("Goals (issue 20) over the test seeds: one-sided t-tests over seeds; the binomial count is per seed on the pooled test set",
                     rows, note="Every test reads the last round of each seed. 'mean ± std' is the accuracy (%), or the paired "
                                "difference SPDNet - EEGNet in points, or the difference of the means ε=20 - non-private.")

    def hyperparameters(self) -> Table:
        rows = []
        for (n, arm, column), c in self.chosen.items():
            label = next(a for a in EEGPhysionet.full_arms if a.label == arm)
            runs = self.summaries(n, n, label, column)
            rows.append(Row(label={"clients": n, "arm": arm, "budget": column},
                            ours={"chosen": c["candidate"].describe(), "validation accuracy": MeanStd(c["validation"]),
                                  "candidates": len(c["scores"]), "sigma": runs[0]["sigma"],
                                  "max epsilon spent": max((r["epsilon_spent"] or 0.0) for r in runs) if runs[0]["private"] else None}))
        return Table("Hyperparameters chosen on the validation splits (best mean validation accuracy over the search seeds)", rows,
                     note=f"Search: {self.search_cost['runs']} runs, {self.search_cost['cpu_hours']:.2f} CPU hours "
                          f"({self.search_cost['reused']} reused from an earlier run of the study); test runs: {self.run_cost['runs']} runs, "
                          f"{self.run_cost['cpu_hours']:.2f} CPU hours. The search is not charged to the privacy budget (as in the paper).")

    def limits(self) -> Table:
        rows = []
        for n in self.scale.groupings:
            for arm in (PROJAVG, PRIRFED, EEGNET):
                for column in [c for c in PRIVACY_COLUMNS if c != "non-private"]:
                    if arm is not PROJAVG and column != "ε=20":
                        continue
                    found = signal_and_noise(self.summaries(n, n, arm, column)[0]["run_dir"])
                    rows.append(Row(label={"clients": n, "arm": arm.label, "budget": column},
                                    ours={k: (round(v, 4) if isinstance(v, float) else v) for k, v in found.items()}))
        return Table("What limits the private runs (seed 0): signal of an aggregated step against its noise", rows, note=(
            "signal: norm of the mean clipped per-record tangent gradient over all training records; noise per step: "
            "sigma sqrt(dim / k), the norm of the cohort's averaged noise on the group; snr over the run: "
            "signal sqrt(T tau k / dim) / sigma (signal adds up as T tau, noise as its square root)."))

    # -- figures ------------------------------------------------------------------------------

    def epsilon_figure(self, path: Path) -> str:
        panels = [(n, k) for n in self.scale.groupings for k in (n, half(n))]
        fig, axes = pyplot().subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), sharey=True, squeeze=False)
        xs = np.arange(4)
        order = ["ε=5", "ε=10", "ε=20", "non-private"]
        for ax, (n, k) in zip(axes[0], panels):
            arms = EEGPhysionet.full_arms if k == n else EEGPhysionet.half_arms
            for offset, arm in enumerate(arms):
                cols = [c for c in order if c in EEGPhysionet.columns(arm)]
                stats = [mean_std(self.values(n, k, arm, c)) for c in cols]
                shift = np.array([order.index(c) for c in cols]) + 0.06 * (offset - (len(arms) - 1) / 2)
                ax.errorbar(shift, [m for m, _ in stats], yerr=[s for _, s in stats], marker="o", capsize=3, color=arm.colour, label=arm.label)
            ax.axhline(self.reference["configured channels"], color="k", ls=":", label="pyriemann reference (non-private)")
            ax.axhline(50.0, color="0.4", ls="--", label="chance")
            ax.set_xticks(xs, order)
            ax.set_title(f"{grouping_label(n)}, k = {k}", fontsize=9)
            ax.set_ylabel("test accuracy (%)")
        axes[0][0].legend(fontsize=7)
        return save_figure(fig, path)

    def records_figure(self, path: Path) -> str:
        fig, ax = pyplot().subplots(figsize=(5.2, 3.8))
        sizes = [min(self.study.dataset_of(n).client_sizes()) for n in self.scale.record_groupings]
        for column, colour in zip(PRIVACY_COLUMNS, ("k", "tab:green", "tab:blue", "tab:red")):
            stats = [mean_std(self.values(n, n, PROJAVG, column)) for n in self.scale.record_groupings]
            ax.errorbar(sizes, [m for m, _ in stats], yerr=[s for _, s in stats], marker="o", capsize=3, color=colour, label=column)
        ax.axhline(self.reference["configured channels"], color="k", ls=":", label="pyriemann reference")
        ax.axhline(50.0, color="0.4", ls="--", label="chance")
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{m}\n({n} cl.)" for m, n in zip(sizes, self.scale.record_groupings)])
        ax.set_xlabel("training records of the smallest client (clients)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title("SPDNet ProjAvg against records per client", fontsize=10)
        ax.legend(fontsize=7)
        return save_figure(fig, path)

    def figure4a(self, path: Path) -> str:
        arms = (PROJAVG, RLAVG, RETAVG, PRIRFED)
        fig, axes = pyplot().subplots(1, len(self.scale.groupings), figsize=(4.6 * len(self.scale.groupings), 3.6), squeeze=False)
        for ax, n in zip(axes[0], self.scale.groupings):
            stats = [mean_std(self.values(n, n, arm, "ε=20")) for arm in arms]
            ax.bar(range(len(arms)), [m for m, _ in stats], yerr=[s for _, s in stats], capsize=4, color=[a.colour for a in arms])
            ax.set_xticks(range(len(arms)), [a.label.replace(" (", "\n(").replace("SPDNet ", "") for a in arms], fontsize=8)
            ax.axhline(50.0, color="0.4", ls="--")
            ax.set_ylim(40, 75)
            ax.set_title(f"Figure 4(a): ε = 20, {grouping_label(n)}", fontsize=9)
            ax.set_ylabel("test accuracy (%)")
        return save_figure(fig, path)

    def figure7(self, path: Path) -> str:
        n = self.scale.groupings[0]
        fig, axes = pyplot().subplots(1, len(EEGPhysionet.curve_arms), figsize=(4.6 * len(EEGPhysionet.curve_arms), 3.5), sharey=True)
        for ax, arm in zip(axes, EEGPhysionet.curve_arms):
            horizon = self.study.horizon(self.chosen, n, arm, "ε=5", self.scale)
            curves = {rounds: [accuracy_curve(self.runs[(n, n, arm.label, "ε=5", rounds, seed)]) for seed in range(self.scale.seeds)]
                      for rounds in (max(1, horizon // 2), horizon, 2 * horizon)}
            curves_panel(ax, curves, 50.0, f"Figure 7: {arm.label}, ε = 5, {n} clients")
        return save_figure(fig, path)

    # -- output -------------------------------------------------------------------------------

    def write(self, out: Path) -> Path:
        tables = [self.centralised_table()] if 1 in self.scale.record_groupings else []
        for n in self.scale.groupings:
            tables.append(self.federated_table(n, n, EEGPhysionet.full_arms,
                                               f"Table 7: federated test accuracy (%), {grouping_label(n)}, full participation (k = {n}), "
                                               "last round, delta = 1e-5", TABLE7.get("Cho2017", {})))
            tables.append(self.federated_table(n, half(n), EEGPhysionet.half_arms,
                                               f"Table 8: federated test accuracy (%), {grouping_label(n)}, half participation (k = {half(n)}), "
                                               "hyperparameters of full participation", TABLE8.get("Cho2017", {})))
        tables += [self.records_table(), self.goals(), self.hyperparameters(), self.limits()]
        figures = [self.epsilon_figure(out / "accuracy_vs_epsilon.png"), self.records_figure(out / "accuracy_vs_records.png"),
                   self.figure4a(out / "figure4a.png"), self.figure7(out / "figure7.png")]
        preface = (
            f"PhysionetMI, the 17 subjects S001-S017 (imagined left vs right fist), half of every subject's trials held out; "
            f"one test split ({self.reference['test trials']} trials) for every seed, {self.reference['training trials']} training trials. "
            f"{self.scale.seeds} seeds (initial model, minibatches, noise, cohorts), {self.scale.note}. Test accuracy in %, "
            f"mean ± standard deviation over seeds, last round; chance 50 %.\n\n"
            f"Wall time of this study: {self.elapsed / 3600:.2f} h (search {self.search_cost['cpu_hours']:.2f} CPU h over "
            f"{self.search_cost['runs']} runs, test runs {self.run_cost['cpu_hours']:.2f} CPU h over {self.run_cost['runs']} runs; "
            f"runs reused from an earlier start: {self.search_cost['reused'] + self.run_cost['reused']}).\n"
        )
        return write_outputs(out, self.study.name, tables, figures, preface=preface)
