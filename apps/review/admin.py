"""Django admin for batches and review items: operators see every team's queue; a verdict
given here goes through the same service as the dashboard and API (lock, transition row,
batch decision, audit)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.http import HttpRequest

from apps.core.actor import Actor
from apps.core.exceptions import DomainError
from apps.review import services
from apps.review.models import Batch, BatchTransition, ItemStatus, ReviewItem, ReviewTransition


class _ReadOnlyInline(admin.TabularInline):
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class BatchTransitionInline(_ReadOnlyInline):
    model = BatchTransition
    fields = ["created_at", "from_status", "to_status", "reason", "actor_label"]
    readonly_fields = fields


class ReviewTransitionInline(_ReadOnlyInline):
    model = ReviewTransition
    fields = ["created_at", "from_status", "to_status", "reason", "actor_label"]
    readonly_fields = fields


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ["__str__", "team", "dataset", "status", "record_count", "sample_size",
                    "created_at", "decided_at"]
    list_filter = ["status", "team"]
    search_fields = ["name", "id", "digest", "dataset__slug"]
    inlines = [BatchTransitionInline]
    readonly_fields = [f.name for f in Batch._meta.fields] + ["parents"]

    # Batches change state only through verdicts (services); the admin shows them.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class VerdictForm(forms.ModelForm):
    verdict = forms.ChoiceField(choices=[("", "—"), ("accept", "Accept"), ("reject", "Reject")],
                                required=False, help_text="Judge an open item.")
    verdict_reason = forms.CharField(required=False, max_length=services.MAX_REASON,
                                     help_text="Required to reject.")

    class Meta:
        model = ReviewItem
        fields: list[str] = []

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("verdict") == "reject" and not (data.get("verdict_reason") or "").strip():
            self.add_error("verdict_reason", "Say why the record is rejected.")
        if data.get("verdict") and self.instance.status != ItemStatus.OPEN:
            self.add_error("verdict", f"This item was already {self.instance.status}.")
        return data


@admin.register(ReviewItem)
class ReviewItemAdmin(admin.ModelAdmin):
    form = VerdictForm
    list_display = ["__str__", "team", "batch", "index", "round", "status", "reason",
                    "reviewed_by", "locked_by", "lock_expires_at"]
    list_filter = ["status", "team", "batch__status"]
    search_fields = ["reason", "batch__name", "batch__id"]
    list_select_related = ["team", "batch", "reviewed_by", "locked_by"]
    inlines = [ReviewTransitionInline]
    readonly_fields = ["team", "batch", "index", "round", "record", "trail", "status", "reason",
                       "reviewed_by", "reviewed_at", "locked_by", "lock_expires_at",
                       "created_at"]
    fieldsets = [
        (None, {"fields": readonly_fields}),
        ("Verdict", {"fields": ["verdict", "verdict_reason"]}),
    ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: ReviewItem, form: Any, change: bool) -> None:
        verdict = form.cleaned_data.get("verdict")
        if not verdict:
            return
        try:
            services.verdict(actor=Actor.of_user(request.user), item=obj, verdict=verdict,
                             reason=form.cleaned_data.get("verdict_reason", ""))
        except DomainError as exc:
            self.message_user(request, exc.message, level=messages.ERROR)
