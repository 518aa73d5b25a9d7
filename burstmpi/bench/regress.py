"""Regression mode of burstmpi-bench: compare a run with a stored JSON baseline.

A row regresses when its time (forward+backward, or a decode call's) exceeds the baseline's by more than the
tolerance (a fraction: 0.1 allows 10 % slower), or when it has wrong values. Rows are
matched on the configuration keys (``bench.CONFIG_KEYS``); a row without a baseline is
reported as new and does not fail. ``junit_xml`` writes the same verdicts for CI systems.
"""

import json
import xml.etree.ElementTree as ET

__all__ = ["load_rows", "compare", "junit_xml", "describe"]

METRIC = "fwdbwd_ms"


def load_rows(path):
    """The rows of a JSON file written by ``burstmpi-bench -J``."""
    with open(path) as fh:
        data = json.load(fh)
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"--baseline: expected a burstmpi-bench JSON file with 'rows', got {path}")
    return rows


def _key(row, keys):
    return tuple(row.get(k) for k in keys)


def describe(row, keys):
    return " ".join(f"{k}={row.get(k)}" for k in keys)


def compare(rows, baseline, tolerance, keys, metric=METRIC):
    """One verdict per row: dict(row, base, ratio, status) with status "ok", "regressed",
    "wrong" or "new"; ``metric`` is the time compared (each bench mode has its own)."""
    base = {_key(r, keys): r for r in baseline}
    out = []
    for row in rows:
        b = base.get(_key(row, keys))
        ratio = None if b is None else row[metric] / b[metric]
        if row.get("wrong", 0) > 0:
            status = "wrong"
        elif b is None:
            status = "new"
        elif ratio > 1.0 + tolerance:
            status = "regressed"
        else:
            status = "ok"
        out.append(dict(row=row, base=b, ratio=ratio, status=status))
    return out


def junit_xml(verdicts, keys, suite="burstmpi-bench", metric=METRIC):
    """JUnit XML text: one test case per configuration, failed when wrong, regressed or
    refused (a row that did not fit in memory: its row is the configuration and ``why``),
    skipped when "not run" (the run was interrupted first: ``why`` says by what)."""
    failures = sum(v["status"] in ("wrong", "regressed", "refused") for v in verdicts)
    skipped = sum(v["status"] == "not run" for v in verdicts)
    ts = ET.Element("testsuite", name=suite, tests=str(len(verdicts)), failures=str(failures),
                    skipped=str(skipped))
    for v in verdicts:
        row = v["row"]
        case = ET.SubElement(ts, "testcase", classname=suite, name=describe(row, keys),
                             time=f"{row.get(metric, 0.0) / 1e3:.6f}")
        if v["status"] == "refused":
            ET.SubElement(case, "failure", message=row["why"])
        elif v["status"] == "not run":
            ET.SubElement(case, "skipped", message=row["why"])
        elif v["status"] == "wrong":
            ET.SubElement(case, "failure", message=f"{row['wrong']} wrong values against float64")
        elif v["status"] == "regressed":
            ET.SubElement(case, "failure", message=(
                f"{metric} {row[metric]:.3f} vs baseline {v['base'][metric]:.3f} "
                f"({100 * (v['ratio'] - 1):+.1f} %)"))
    return ET.tostring(ts, encoding="unicode")
