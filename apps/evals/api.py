"""``/api/v1/teams/<team>/evals/…``: eval suites (create, list, read, update name /
description / baseline, delete), evaluating a subject with a suite, evaluation reports and
the leaderboard; ``/api/v1/teams/<team>/variants/…``: served variants of checkpoints (int8,
speculative), recorded in lineage and evaluated by a suite at creation;
``/api/v1/teams/<team>/checkpoints/<id>/gate`` and ``…/promote``: whether a
checkpoint may be promoted, and promoting it (409 while its gating suite has not passed it).
"""

from __future__ import annotations

from typing import Any, cast

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.core.exceptions import InvalidInput
from apps.core.idempotency import idempotent
from apps.evals import selectors, services
from apps.evals.models import EvalSuite, ServedVariant, SubjectKind, SuiteEvaluation
from apps.evals.serializers import (
    EvaluateSerializer,
    PromoteSerializer,
    SuiteCreateSerializer,
    SuiteSerializer,
    SuiteUpdateSerializer,
    VariantCreateSerializer,
    VariantSerializer,
)
from apps.runs.models import Checkpoint
from apps.runs.selectors import resolve_checkpoint
from apps.teams.viewsets import TeamScopedViewSet


class EvalSuiteViewSet(TeamScopedViewSet):
    queryset = EvalSuite.objects.all()
    serializer_class = SuiteSerializer
    lookup_field = "slug"
    lookup_url_kwarg = "suite"
    ordering = "slug"

    def base_queryset(self) -> Any:
        return EvalSuite.objects.select_related("project").prefetch_related(
            "entries__environment_version__environment")

    def _suite(self) -> EvalSuite:
        return cast(EvalSuite, self.get_object())

    def list(self, request: Request, team: str) -> Response:
        page = self.paginate_queryset(self.get_queryset().order_by("slug"))
        return self.get_paginated_response(SuiteSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, suite: str) -> Response:
        return Response(SuiteSerializer(self.get_object()).data)

    @extend_schema(request=SuiteCreateSerializer, responses={201: SuiteSerializer})
    def create(self, request: Request, team: str) -> Response:
        data = SuiteCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        obj = services.suite_create(actor=self.actor, team=self.team, **data.validated_data)
        obj = self.get_queryset().get(pk=obj.pk)
        return Response(SuiteSerializer(obj).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=SuiteUpdateSerializer, responses=SuiteSerializer)
    def partial_update(self, request: Request, team: str, suite: str) -> Response:
        data = SuiteUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        obj = services.suite_update(actor=self.actor, suite=self._suite(),
                                    **data.validated_data)
        return Response(SuiteSerializer(self.get_queryset().get(pk=obj.pk)).data)

    def destroy(self, request: Request, team: str, suite: str) -> Response:
        services.suite_delete(actor=self.actor, suite=self._suite())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=EvaluateSerializer, responses={201: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def evaluate(self, request: Request, team: str, suite: str) -> Response:
        """Evaluate one subject with every entry (one eval run each): a checkpoint or model
        (``base_model``) or a served variant's endpoint (``policy``)."""
        data = EvaluateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        obj = self._suite()

        def handler() -> Response:
            ref, policy = values["base_model"], values["policy"]
            ckpt = None
            if ref and ref.startswith(("checkpoint:", "run:")):
                ckpt = resolve_checkpoint(team=self.team, ref=ref)
                ref = f"checkpoint:{ckpt.pk}"
            kind = SubjectKind.CHECKPOINT if ckpt else (
                SubjectKind.VARIANT if policy is not None else SubjectKind.MODEL)
            label = values["label"] or (
                f"{ckpt.run.name or str(ckpt.run_id)[:8]} @ step {ckpt.step}" if ckpt
                else str(ref or (policy or {}).get("base_url", "endpoint")))
            evaluation = services.evaluate(actor=self.actor, suite=obj, subject_kind=kind,
                                           label=label, base_model=ref, policy=policy,
                                           checkpoint=ckpt)
            return Response(selectors.evaluation_report(evaluation),
                            status=status.HTTP_201_CREATED)

        return idempotent(request, handler)

    @extend_schema(responses=OpenApiTypes.OBJECT)
    @action(detail=True, methods=["get"], pagination_class=None)
    def evaluations(self, request: Request, team: str, suite: str) -> Response:
        """The suite's latest 50 evaluations, newest first, each with its verdict."""
        rows = selectors.suite_evaluations(self._suite())
        return Response({"results": selectors.evaluation_reports(rows)})

    @extend_schema(parameters=[OpenApiParameter("order", OpenApiTypes.STR,
                                                enum=[*selectors.ORDERS])],
                   responses=OpenApiTypes.OBJECT)
    @action(detail=True, methods=["get"], pagination_class=None)
    def leaderboard(self, request: Request, team: str, suite: str) -> Response:
        """Subjects ranked by capability, cost (GPU/CPU-seconds per task) or latency, with
        the Pareto front marked."""
        order = request.query_params.get("order", "capability")
        if order not in selectors.ORDERS:
            raise InvalidInput(f"order must be one of {', '.join(selectors.ORDERS)}.",
                               details={"order": [order[:40]]})
        return Response({"order": order,
                         "results": selectors.leaderboard(self._suite(), order)})


class SuiteEvaluationViewSet(TeamScopedViewSet):
    queryset = SuiteEvaluation.objects.all()
    lookup_url_kwarg = "evaluation"
    pagination_class = None

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def retrieve(self, request: Request, team: str, evaluation: str) -> Response:
        """One evaluation: each entry against the previous version and the baseline."""
        return Response(selectors.evaluation_report(
            selectors.access_evaluation(self.team, evaluation)))


class ServedVariantViewSet(TeamScopedViewSet):
    """Served variants: a checkpoint served with int8 weights or speculative decoding."""

    queryset = ServedVariant.objects.all()
    serializer_class = VariantSerializer
    lookup_url_kwarg = "variant"
    ordering = "-created_at"

    def base_queryset(self) -> Any:
        return ServedVariant.objects.select_related("source")

    def list(self, request: Request, team: str) -> Response:
        """The team's variants, newest first (``?checkpoint=<id>`` for one checkpoint's)."""
        rows = self.get_queryset().order_by("-created_at", "-pk")
        ckpt = request.query_params.get("checkpoint")
        if ckpt is not None:
            if not ckpt.isdigit():
                raise InvalidInput("checkpoint must be a checkpoint id (a whole number).",
                                   details={"checkpoint": [ckpt[:40]]})
            rows = rows.filter(source_id=int(ckpt))
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(VariantSerializer(page, many=True).data)

    def retrieve(self, request: Request, team: str, variant: str) -> Response:
        return Response(VariantSerializer(self.get_object()).data)

    @extend_schema(request=VariantCreateSerializer, responses={201: VariantSerializer})
    def create(self, request: Request, team: str) -> Response:
        """Record a variant of a checkpoint (lineage: checkpoint → variant); with ``suite``,
        evaluate it there now: the eval workers serve the checkpoint with the variant's
        settings."""
        data = VariantCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)

        def handler() -> Response:
            obj = services.variant_create(actor=self.actor, team=self.team,
                                          **data.validated_data)
            obj = self.get_queryset().get(pk=obj.pk)
            return Response(VariantSerializer(obj).data, status=status.HTTP_201_CREATED)

        return idempotent(request, handler)


class CheckpointGateViewSet(TeamScopedViewSet):
    """A checkpoint's promotion, gated by the eval suite its run names."""

    queryset = Checkpoint.objects.all()
    lookup_url_kwarg = "checkpoint"
    pagination_class = None

    @extend_schema(responses=OpenApiTypes.OBJECT)
    @action(detail=True, methods=["get"])
    def gate(self, request: Request, team: str, checkpoint: str) -> Response:
        """What promote would answer now (changes nothing)."""
        return Response(selectors.promotion_gate(
            selectors.access_checkpoint(self.team, checkpoint)))

    @extend_schema(request=PromoteSerializer, responses={201: OpenApiTypes.OBJECT,
                                                         409: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def promote(self, request: Request, team: str, checkpoint: str) -> Response:
        """Promote the checkpoint: 409 (``regression``, ``evaluation_pending``,
        ``evaluation_failed``, ``not_evaluated``, ``already_promoted``) unless its gating
        suite passed it."""
        data = PromoteSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        ckpt = selectors.access_checkpoint(self.team, checkpoint)
        promotion = services.promote(actor=self.actor, checkpoint=ckpt,
                                     note=data.validated_data["note"])
        return Response({"checkpoint": ckpt.pk, "run": str(ckpt.run_id), "step": ckpt.step,
                         "evaluation": promotion.evaluation_id, "note": promotion.note,
                         "promoted_at": promotion.created_at},
                        status=status.HTTP_201_CREATED)
