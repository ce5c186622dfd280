"""Writes for alerts: rule CRUD (audited), evaluation of the rules on what the lower apps
report, firing with a cooldown, and webhook deliveries with their log.

Evaluation never raises into its caller's path (ingest, events, the beat): the receivers and
the periodic pass log a failing rule and go on.
"""

from __future__ import annotations

import base64
import logging
import secrets
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from pydantic import ValidationError
from standardwebhooks import Webhook

from apps.alerts import rules
from apps.alerts.models import Alert, AlertRule, Delivery, DeliveryAttempt, DeliveryStatus
from apps.core import audit, events
from apps.core.actor import Actor
from apps.core.exceptions import InvalidInput, NotFound
from apps.metrics.models import MetricPoint
from apps.projects.models import Project
from apps.runs.models import AttemptOutcome, Run, RunAttempt, RunStatus
from apps.scheduling.models import Allocation, NodeState, NodeTransition
from apps.teams.models import Team
from config.celery import app
from workers import egress

log = logging.getLogger(__name__)

DELIVER_TASK = "workers.tasks.deliver_webhook"
RESPONSE_SNIPPET = 500
NODE_LOST_LOOKBACK = timedelta(hours=1)


def _conf(name: str) -> Any:
    return settings.CRUCIBLE[name]


# --- rules -----------------------------------------------------------------------------

# team id -> (expires at, enabled rules): metric batches arrive many times a second, and a
# team without rules must cost ingest no query per batch. A rule written here clears its
# team's entry; other processes see it within the TTL.
_RULES: dict[int, tuple[float, list[AlertRule]]] = {}
RULE_CACHE_S = 5.0


def enabled_rules(team_id: int) -> list[AlertRule]:
    cached = _RULES.get(team_id)
    if cached is not None and cached[0] > time.monotonic():
        return cached[1]
    found = list(AlertRule.objects.filter(team_id=team_id, enabled=True).order_by("id"))
    _RULES[team_id] = (time.monotonic() + RULE_CACHE_S, found)
    return found


def _forget(team_id: int) -> None:
    transaction.on_commit(lambda: _RULES.pop(team_id, None))
    _RULES.pop(team_id, None)


def check_webhook_url(url: str) -> None:
    """InvalidInput unless the web may POST to ``url`` (public hosts only, unless
    CRUCIBLE_WEBHOOK_ALLOW_PRIVATE)."""
    try:
        egress.check_public_url(url, allow_private=_conf("WEBHOOK_ALLOW_PRIVATE"))
    except egress.EgressRefused as exc:
        raise InvalidInput(f"webhook_url refused: {exc}",
                           details={"webhook_url": [str(exc)]}) from exc


def _params(kind: str, raw: Any) -> dict[str, Any]:
    if kind not in rules.PARAMS:
        raise InvalidInput(f"kind must be one of {', '.join(sorted(rules.PARAMS))}; "
                           f"got {str(kind)[:40]!r}.", details={"kind": [str(kind)[:40]]})
    if raw is not None and not isinstance(raw, dict):
        raise InvalidInput("params must be an object.", details={"params": ["object"]})
    try:
        return rules.parse_params(kind, raw)
    except ValidationError as exc:
        problems = {f"params.{'.'.join(str(p) for p in e['loc'])}": [e["msg"]]
                    for e in exc.errors()}
        first = next(iter(problems.items()))
        raise InvalidInput(f"{first[0]}: {first[1][0]}", details=problems) from exc


def new_secret() -> str:
    """A Standard Webhooks signing secret: ``whsec_`` and 32 random bytes in base64."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


@transaction.atomic
def rule_create(*, actor: Actor, team: Team, name: str, kind: str,
                params: dict[str, Any] | None = None, project: Project | None = None,
                enabled: bool = True, cooldown_s: int = 3600,
                webhook_url: str = "") -> AlertRule:
    clean = _params(kind, params)
    if webhook_url:
        check_webhook_url(webhook_url)
    rule = AlertRule.objects.create(
        team=team, name=name, kind=kind, params=clean, project=project, enabled=enabled,
        cooldown_s=cooldown_s, webhook_url=webhook_url,
        webhook_secret=new_secret() if webhook_url else "",
        created_by=actor.user)
    audit.record(actor=actor, action="alert_rule.create", team_id=team.pk,
                 target_type="alert_rule", target_id=rule.pk,
                 data={"name": name, "kind": kind, "webhook": bool(webhook_url)})
    _forget(team.pk)
    return rule


@transaction.atomic
def rule_update(*, actor: Actor, rule: AlertRule, **fields: Any) -> AlertRule:
    """Change the given fields; ``params`` is validated against the (possibly new) kind,
    and a rule that gains a webhook gets a secret."""
    kind = fields.get("kind", rule.kind)
    if "params" in fields or "kind" in fields:
        fields["params"] = _params(kind, fields.get("params", rule.params))
    if fields.get("webhook_url"):
        check_webhook_url(fields["webhook_url"])
        if not rule.webhook_secret:
            fields["webhook_secret"] = new_secret()
    for name, value in fields.items():
        setattr(rule, name, value)
    rule.updated_at = timezone.now()
    rule.save(update_fields=[*fields, "updated_at"])
    shown = {k: v for k, v in fields.items() if k not in ("webhook_secret", "project")}
    audit.record(actor=actor, action="alert_rule.update", team_id=rule.team_id,
                 target_type="alert_rule", target_id=rule.pk, data=shown)
    _forget(rule.team_id)
    return rule


@transaction.atomic
def rule_rotate_secret(*, actor: Actor, rule: AlertRule) -> AlertRule:
    if not rule.webhook_url:
        raise InvalidInput("This rule has no webhook_url, so no signing secret.",
                           details={"webhook_url": ["blank"]})
    rule.webhook_secret = new_secret()
    rule.updated_at = timezone.now()
    rule.save(update_fields=["webhook_secret", "updated_at"])
    audit.record(actor=actor, action="alert_rule.rotate_secret", team_id=rule.team_id,
                 target_type="alert_rule", target_id=rule.pk)
    _forget(rule.team_id)
    return rule


@transaction.atomic
def rule_delete(*, actor: Actor, rule: AlertRule) -> None:
    audit.record(actor=actor, action="alert_rule.delete", team_id=rule.team_id,
                 target_type="alert_rule", target_id=rule.pk, data={"name": rule.name})
    team_id = rule.team_id
    rule.delete()
    _forget(team_id)


# --- firing ----------------------------------------------------------------------------


def fire(*, rule: AlertRule, key: str, message: str, value: float | None = None,
         run_id: Any = None, data: dict[str, Any] | None = None,
         once: bool = False) -> Alert | None:
    """Record an alert for ``rule`` and subject ``key`` unless one fired within the rule's
    cooldown (``once``: ever), and queue its webhook. The rule's row lock serialises
    concurrent evaluations, so a condition seen by two batches at once fires once."""
    now = timezone.now()
    with transaction.atomic():
        if not AlertRule.objects.select_for_update().filter(pk=rule.pk, enabled=True).exists():
            return None  # deleted or disabled since it was read
        earlier = Alert.objects.filter(rule_id=rule.pk, key=key)
        if not once:
            earlier = earlier.filter(created_at__gt=now - timedelta(seconds=rule.cooldown_s))
        if earlier.exists():
            return None
        alert = Alert.objects.create(team_id=rule.team_id, rule=rule, run_id=run_id,
                                     kind=rule.kind, key=key[:300], message=message[:5000],
                                     value=value, data=data or {}, created_at=now)
        events.publish_on_commit(events.team_group(rule.team_id), {
            "type": "alert", "id": alert.pk, "kind": alert.kind, "message": alert.message,
            "run": str(run_id) if run_id else None})
        if rule.webhook_url:
            _queue_delivery(rule, alert)
    log.info("alert %s fired: %s", alert.pk, message)
    return alert


def payload(rule: AlertRule, alert: Alert) -> dict[str, Any]:
    """The webhook body, in the Standard Webhooks shape (type, timestamp, data)."""
    team = Team.objects.only("slug").get(pk=rule.team_id)
    base = _conf("PUBLIC_URL").rstrip("/")
    return {
        "type": "alert.fired",
        "timestamp": alert.created_at.isoformat(),
        "data": {"id": alert.pk, "team": team.slug,
                 "rule": {"id": rule.pk, "name": rule.name, "kind": rule.kind},
                 "key": alert.key, "message": alert.message, "value": alert.value,
                 "run": str(alert.run_id) if alert.run_id else None, "details": alert.data,
                 "url": f"{base}/t/{team.slug}/alerts/"},
    }


def _queue_delivery(rule: AlertRule, alert: Alert) -> Delivery:
    delivery = Delivery.objects.create(team_id=rule.team_id, alert=alert, url=rule.webhook_url,
                                       msg_id=f"msg_{uuid.uuid4().hex}",
                                       payload=payload(rule, alert))
    delivery_id = delivery.pk
    transaction.on_commit(lambda: send_delivery(delivery_id))
    return delivery


def send_delivery(delivery_id: int, countdown: float = 0.0) -> None:
    """Hand the delivery to a pool's Celery task (by name: the web imports no worker code).
    A broker outage leaves it pending; the periodic pass sends it again."""
    try:
        app.send_task(DELIVER_TASK, args=[delivery_id], queue="cpu",
                      countdown=countdown or None)
    except Exception:
        log.exception("could not enqueue webhook delivery %s", delivery_id)


# --- evaluation: metrics and events (signal receivers) -----------------------------------


def _applies(rule: AlertRule, run: Run) -> bool:
    return rule.project_id is None or rule.project_id == run.project_id


def _tail(run_id: Any, name: str, n: int) -> list[float]:
    values = list(MetricPoint.objects.filter(run_id=run_id, name=name)
                  .order_by("-step", "-id").values_list("value", flat=True)[:n])
    values.reverse()
    return values


def on_metrics(*, run_id: Any, team_id: int, names: set[str]) -> list[Alert]:
    """Evaluate the team's metric rules that read a series this batch added to."""
    watching = [(r, m) for r in enabled_rules(team_id) if r.kind in rules.METRIC_KINDS
                for m in [rules.watched_metric(r.kind, r.params)] if m in names]
    if not watching:
        return []
    run = Run.objects.filter(pk=run_id).only("id", "project_id", "team_id").first()
    fired = []
    for rule, metric in watching:
        if run is None or not _applies(rule, run):
            continue
        try:
            values = _tail(run_id, metric, rules.points_needed(rule.kind, rule.params))
            finding = rules.metric_finding(rule.kind, rule.params, values)
            if finding is not None:
                alert = fire(rule=rule, key=f"run:{run_id}", message=finding.message,
                             value=finding.value, run_id=run_id, data={"metric": metric})
                fired += [alert] if alert else []
        except Exception:
            log.exception("alert rule %s failed on run %s", rule.pk, run_id)
    return fired


def on_events(*, run_id: Any, team_id: int, events: list[dict[str, Any]]) -> list[Alert]:
    """Evaluate the team's event rules on events just appended to a run's log."""
    watching = [r for r in enabled_rules(team_id) if r.kind in rules.EVENT_KINDS]
    if not watching:
        return []
    run = Run.objects.filter(pk=run_id).first()
    fired: list[Alert] = []
    for rule in watching:
        if run is None or not _applies(rule, run):
            continue
        try:
            fired += [a for a in _event_rule(rule, run, events) if a is not None]
        except Exception:
            log.exception("alert rule %s failed on run %s", rule.pk, run_id)
    return fired


def _event_rule(rule: AlertRule, run: Run, rows: list[dict[str, Any]]) -> list[Alert | None]:
    if rule.kind == "nan_streak":
        streaks = [int(e["data"]["nan_streak"]) for e in rows
                   if isinstance(e.get("data"), dict)
                   and isinstance(e["data"].get("nan_streak"), int)]
        streak = max(streaks, default=0)
        if streak < rule.params["streak"]:
            return []
        return [fire(rule=rule, key=f"run:{run.pk}", run_id=run.pk, value=float(streak),
                     message=f"{streak} consecutive non-finite training steps in run "
                             f"{run.name or run.pk} (alert at {rule.params['streak']})",
                     data={"streak": streak})]
    statuses = [e["data"].get("status") for e in rows
                if e.get("kind") == "status" and isinstance(e.get("data"), dict)]
    if rule.kind == "worker_lost" and RunStatus.PREEMPTED in statuses:
        lost = RunAttempt.objects.filter(run=run, outcome=AttemptOutcome.LOST).order_by(
            "-number").first()
        if lost is None or lost.ended_at is None or \
                lost.ended_at < timezone.now() - timedelta(minutes=10):
            return []
        return [fire(rule=rule, key=f"run:{run.pk}:attempt:{lost.number}", run_id=run.pk,
                     once=True, message=f"worker {lost.worker or '?'} lost on attempt "
                                        f"{lost.number} of run {run.name or run.pk}: "
                                        f"{lost.error[:300]}",
                     data={"attempt": lost.number, "worker": lost.worker})]
    if rule.kind == "forgery_suspect" and RunStatus.SUCCEEDED in statuses \
            and run.kind == "qc" and run.environment_version_id is not None:
        version = run.environment_version
        if version is None:
            return []
        report = version.qc_report if isinstance(version.qc_report, dict) else {}
        summary = report.get("summary") if isinstance(report.get("summary"), dict) else {}
        forgeable = summary.get("forgeable") if isinstance(summary, dict) else None
        if not forgeable or not isinstance(forgeable, list):
            return []
        names = ", ".join(str(f) for f in forgeable[:8])
        return [fire(rule=rule, key=f"environment_version:{version.pk}", run_id=run.pk,
                     once=True, value=float(len(forgeable)),
                     message=f"forgery suspect: QC run {run.pk} found {len(forgeable)} known "
                             f"forgeries earning reward in environment version "
                             f"{version.digest[:12]} ({names})",
                     data={"forgeable": forgeable[:50], "environment_version": version.pk})]
    return []


# --- evaluation: periodic (the beat, through the worker API) ------------------------------


def evaluate_periodic(*, now: datetime | None = None) -> dict[str, Any]:
    """Queue-wait and node-loss rules of every team, then a resend of deliveries whose
    task was lost. Returns what fired and what was resent."""
    now = now or timezone.now()
    fired: list[int] = []
    for rule in AlertRule.objects.filter(enabled=True, kind__in=rules.PERIODIC_KINDS):
        try:
            alerts = _queue_wait(rule, now) if rule.kind == "queue_wait" \
                else _node_lost(rule, now)
            fired += [a.pk for a in alerts if a is not None]
        except Exception:
            log.exception("alert rule %s failed in the periodic pass", rule.pk)
    return {"fired": fired, "resent": resend_stalled(now=now)}


def _queue_wait(rule: AlertRule, now: datetime) -> list[Alert | None]:
    queued = Run.objects.filter(team_id=rule.team_id, status=RunStatus.QUEUED)
    if rule.params.get("pool"):
        queued = queued.filter(pool=rule.params["pool"])
    if rule.project_id:
        queued = queued.filter(project_id=rule.project_id)
    oldest = queued.order_by("queued_at").only("id", "name", "queued_at", "pool").first()
    if oldest is None or oldest.queued_at is None:
        return []
    waited = (now - oldest.queued_at).total_seconds()
    if waited <= rule.params["seconds"]:
        return []
    pool = rule.params.get("pool") or "any"
    return [fire(rule=rule, key=f"queue:{pool}", value=waited, run_id=oldest.pk,
                 message=f"run {oldest.name or oldest.pk} has waited {waited:.0f} s in the "
                         f"{oldest.pool} queue (alert above {rule.params['seconds']:g} s)",
                 data={"pool": oldest.pool, "waited_s": round(waited, 1)})]


def _node_lost(rule: AlertRule, now: datetime) -> list[Alert | None]:
    losses = NodeTransition.objects.filter(to_state=NodeState.LOST,
                                           at__gte=now - NODE_LOST_LOOKBACK).select_related("node")
    out: list[Alert | None] = []
    for loss in losses:
        runs: list[str] = []
        if rule.params.get("scope", "mine") == "mine":
            held = Allocation.objects.filter(node_id=loss.node_id, run__team_id=rule.team_id,
                                             created_at__lte=loss.at)
            held = held.exclude(released_at__lt=loss.at)
            runs = sorted({str(r) for r in held.values_list("run_id", flat=True)})
            if not runs:
                continue
        what = f" holding run(s) {', '.join(runs[:5])}" if runs else ""
        out.append(fire(rule=rule, key=f"node:{loss.node.name}:{loss.pk}", once=True,
                        message=f"node {loss.node.name}{what} lost: {loss.reason[:300]}",
                        data={"node": loss.node.name, "runs": runs[:20]}))
    return out


def resend_stalled(*, now: datetime | None = None, grace_s: float = 60.0) -> list[int]:
    """Pending deliveries overdue by ``grace_s``: their task was lost (a broker outage, a
    worker killed between retries). Sending them again is harmless: an attempt is claimed
    under the delivery's row lock, and a task that finds it not due stops."""
    now = now or timezone.now()
    stalled = list(Delivery.objects.filter(status=DeliveryStatus.PENDING,
                                           next_attempt_at__lt=now - timedelta(seconds=grace_s))
                   .values_list("pk", flat=True)[:200])
    for delivery_id in stalled:
        send_delivery(delivery_id)
    return stalled


# --- delivery --------------------------------------------------------------------------


def attempt_delivery(*, delivery_id: int) -> dict[str, Any]:
    """Make the delivery's next attempt if it is due; record it in the delivery log.
    Returns ``{"status", "attempted", "retry_in"}``: the task retries after ``retry_in``
    seconds only when it made the attempt and the delivery is still pending."""
    timeout = float(_conf("WEBHOOK_TIMEOUT_S"))
    with transaction.atomic():
        delivery = Delivery.objects.select_for_update().filter(pk=delivery_id).first()
        if delivery is None:
            raise NotFound(f"No webhook delivery {delivery_id}.")
        now = timezone.now()
        if delivery.status != DeliveryStatus.PENDING or delivery.next_attempt_at > now:
            wait = max(0.0, (delivery.next_attempt_at - now).total_seconds())
            return {"status": delivery.status, "attempted": False,
                    "retry_in": wait if delivery.status == DeliveryStatus.PENDING else None}
        delivery.attempts += 1
        number = delivery.attempts
        # Claimed: a duplicate task finds it not due until this attempt has surely ended.
        delivery.next_attempt_at = now + timedelta(seconds=timeout + 30)
        delivery.save(update_fields=["attempts", "next_attempt_at"])
        secret = delivery.alert.rule.webhook_secret
        url, msg_id, body = delivery.url, delivery.msg_id, delivery.payload
    outcome = post_signed(url, msg_id=msg_id, body=body, secret=secret, timeout=timeout)
    with transaction.atomic():
        delivery = Delivery.objects.select_for_update().get(pk=delivery_id)
        DeliveryAttempt.objects.create(delivery=delivery, number=number, **outcome)
        now = timezone.now()
        code = outcome["status_code"]
        retry_in: float | None = None
        if code is not None and 200 <= code < 300:
            delivery.status, delivery.finished_at = DeliveryStatus.SUCCEEDED, now
        elif number >= _conf("WEBHOOK_MAX_ATTEMPTS"):
            delivery.status, delivery.finished_at = DeliveryStatus.FAILED, now
        else:
            retry_in = rules.backoff_seconds(number, base=_conf("WEBHOOK_BACKOFF_S"),
                                             cap=_conf("WEBHOOK_BACKOFF_CAP_S"))
            delivery.next_attempt_at = now + timedelta(seconds=retry_in)
        delivery.last_status_code = code
        delivery.save(update_fields=["status", "finished_at", "next_attempt_at",
                                     "last_status_code"])
    return {"status": delivery.status, "attempted": True, "retry_in": retry_in}


def signed_headers(*, secret: str, msg_id: str, body: bytes, at: datetime) -> dict[str, str]:
    """The Standard Webhooks headers for ``body`` (signed by the standardwebhooks package)."""
    signature = Webhook(secret).sign(msg_id=msg_id, timestamp=at, data=body)
    return {"webhook-id": msg_id, "webhook-timestamp": str(int(at.timestamp())),
            "webhook-signature": signature}


def post_signed(url: str, *, msg_id: str, body: dict[str, Any], secret: str,
                timeout: float) -> dict[str, Any]:
    """One signed POST: the attempt's log fields. The host is checked again right before
    connecting (it may resolve elsewhere than when the rule was saved) and the connection
    goes to the addresses that check saw (`egress.pinned_targets`); redirects are not
    followed (a redirect to an internal host would bypass that check)."""
    import json

    raw = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    started = time.perf_counter()
    out: dict[str, Any] = {"status_code": None, "error": "", "response": ""}
    try:
        addresses = egress.check_public_url(url, allow_private=_conf("WEBHOOK_ALLOW_PRIVATE"))
        headers = {"content-type": "application/json", "user-agent": "Crucible-Webhooks/1",
                   **signed_headers(secret=secret, msg_id=msg_id, body=raw,
                                    at=timezone.now())}
        # Connect to the addresses just checked, never to the name again (DNS rebinding);
        # the next address is tried only when one refuses the connection.
        targets = egress.pinned_targets(url, addresses)
        with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client:
            for i, (target, host_header, server_name) in enumerate(targets):
                try:
                    with client.stream("POST", target, content=raw,
                                       headers={**headers, "host": host_header},
                                       extensions={"sni_hostname": server_name}) as response:
                        out["status_code"] = response.status_code
                        snippet = b""
                        for chunk in response.iter_bytes():
                            snippet += chunk
                            if len(snippet) >= RESPONSE_SNIPPET:
                                break
                        out["response"] = snippet[:RESPONSE_SNIPPET].decode("utf-8",
                                                                            "replace")
                    break
                except httpx.ConnectError:
                    if i == len(targets) - 1:
                        raise
    except egress.EgressRefused as exc:
        out["error"] = f"refused: {exc}"[:500]
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:500]
    out["duration_ms"] = round((time.perf_counter() - started) * 1000, 2)
    return out
