"""``qc`` runs: the QC engine over the pinned environment version; its verdict sets the
version's QC status through the API."""

from __future__ import annotations

from workers.adapters.common import (
    ApiReporter,
    dataset_resolver,
    dump,
    pinned_environment,
)
from workers.client import WorkerSession
from workers.jsonsafe import json_safe
from workers.qc.spec import QcRunConfig
from workers.storage import default_store, run_key


def run(session: WorkerSession) -> None:
    """QC the pinned version; the report goes to the object store, its summary to the version
    (passed, or failed with block reasons) and the run's metrics."""
    from workers.qc.run import run_qc_spec

    store = default_store()
    reporter = ApiReporter(session, store)
    env = pinned_environment(session)
    qc = QcRunConfig.model_validate(session.run.config).qc
    reporter.event("info", f"QC of {env.label} started", {"config": qc.model_dump()})
    report = run_qc_spec(env.spec, qc, resolve_dataset=dataset_resolver(env, store))
    uri = store.put_bytes(run_key(session.run, "qc-report.json"), dump(report))
    summary = report.get("summary") or {}
    reporter.log(0, {
        "qc/tasks": summary.get("tasks"), "qc/quarantined": summary.get("quarantined"),
        "qc/quarantine_rate": summary.get("quarantine_rate"),
        "qc/passed": 1.0 if report.get("passed") else 0.0,
        "qc/total_s": (report.get("timings") or {}).get("total_s"),
    })
    brief = {k: v for k, v in report.items() if k != "tasks"}
    result = session.report_qc(json_safe(brief), uri)
    if report.get("passed"):
        reporter.event("info", f"QC passed: {env.label} is {result['qc_status']} "
                       f"({summary.get('quarantined', 0)} of {summary.get('tasks', 0)} tasks "
                       "quarantined)", {"summary": summary})
    else:
        reporter.event("warning", f"QC blocked {env.label}: "
                       + "; ".join(report.get("block_reasons") or []),
                       {"block_reasons": report.get("block_reasons")})
    session.set_report(uri)
