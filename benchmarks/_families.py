"""The per-family summary of ``calibration.py``: one row per method family and situation.

A family is a regressor and a classifier of one method (exact LLA, ELLA, ...), plus the
raw net and the peers. Each cell is a mean over seeds of the per-data-set results; the
verdict joins the family's estimators' verdicts (the same paired criteria as the
verdict tables). ``calibration.py`` prints these first; docs/calibration.md opens with
them.
"""

from __future__ import annotations

import numpy as np
from _common import markdown_table

#: ``(family, regressor id, classifier id)``; peers are a family of one method.
FAMILIES = [
    ("raw net", "raw net", "raw net"),
    ("MAPIE", "MAPIE split conformal", None),
    ("laplace-torch LL-KFAC", "laplace-torch LL-KFAC marglik", "laplace-torch LL-KFAC marglik"),
    ("exact LLA", "LLARegressor", "LLAClassifier"),
    ("last-layer LLA", "LLARegressor[last_layer]", "LLAClassifier[last_layer]"),
    ("ELLA", "ELLARegressor", "ELLAClassifier"),
    ("subspace Laplace", "SubspaceLaplaceRegressor", "SubspaceLaplaceClassifier"),
    ("sampled LLA", "SampledLLARegressor", "SampledLLAClassifier"),
    ("VaLLA", "VaLLARegressor", "VaLLAClassifier"),
    ("FMGP", "FMGPRegressor", "FMGPClassifier"),
]

#: ``(header, data set, [metric, ...], format)``: ``"pair"`` prints ``a / b``,
#: ``"ratio"`` prints ``a (b)``.
COLUMNS = [
    ("diabetes NLL / CQM", "diabetes", ["NLL", "CQM"], "pair"),
    ("friedman1 NLL / CQM", "friedman1", ["NLL", "CQM"], "pair"),
    ("friedman1 shift NLL (std ratio)", "friedman1", ["shift_NLL", "std_ratio"], "ratio"),
    ("digits NLL / ECE", "digits", ["NLL", "ECE"], "pair"),
    ("digits OOD AUC (noise)", "digits", ["AUC_noise"], "one"),
    ("breast cancer NLL", "breast_cancer", ["NLL"], "one"),
    ("wine NLL", "wine", ["NLL"], "one"),
]


def _mean(records, method, ds, sit, key):
    vals = [r["metrics"][key] for r in records
            if r["method"] == method and r["dataset"] == ds and r["situation"] == sit
            and r["metrics"] is not None and key in r["metrics"]]
    return float(np.mean(vals)) if vals else None


def _digits_seconds(records, method, sit):
    t = [r["fit_s"] + r["predict_s"] for r in records
         if r["method"] == method and r["dataset"] == "digits" and r["situation"] == sit
         and r["metrics"] is not None and r["kind"] == "estimator"]
    return f"{np.mean(t):.1f}" if t else ""


def family_tables(vs, records, situations, classification):
    """Markdown: per situation, one row per family with the headline metrics and verdict.

    ``classification``: the names of the classification data sets (their columns read
    the family's classifier, the others its regressor).
    """
    out = []
    for sit in situations:
        body = []
        for family, reg, clf in FAMILIES:
            cells = []
            for _, ds, keys, fmt in COLUMNS:
                method = clf if ds in classification else reg
                vals = [_mean(records, method, ds, sit, k) if method else None for k in keys]
                if any(v is None for v in vals):
                    cells.append("")
                elif fmt == "pair":
                    cells.append(f"{vals[0]:.3f} / {vals[1]:.3f}")
                elif fmt == "ratio":
                    cells.append(f"{vals[0]:.3f} ({vals[1]:.2f})")
                else:
                    cells.append(f"{vals[0]:.3f}")
            if not any(cells):
                continue
            fails, judged = [], False
            for v in vs:
                if v["situation"] == sit and v["method"] in (reg, clf):
                    judged = True
                    if v["fails"]:
                        fails.append(f"{v['dataset']}: {', '.join(v['fails'])}")
            verdict = ("" if not judged else "pass" if not fails
                       else "FAIL (" + "; ".join(sorted(fails)) + ")")
            body.append([family, *cells, _digits_seconds(records, clf, sit), verdict])
        if body:
            out.append(markdown_table(
                [f"family ({sit})", *[c[0] for c in COLUMNS], "digits fit + predict s",
                 "verdict"], body))
    return "\n\n".join(out)
