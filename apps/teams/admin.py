from django.contrib import admin

from apps.teams.models import ApiToken, Membership, Team


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    raw_id_fields = ["user"]


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "created_at"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ["prefix", "name", "kind", "user", "team", "expires_at", "revoked_at",
                    "last_used_at"]
    list_filter = ["kind"]
    search_fields = ["prefix", "name"]
    # Tokens are created through the API or `manage.py create_worker_token` (the secret is
    # shown once); the admin only inspects and revokes them.
    readonly_fields = ["prefix", "key_hash", "kind", "user", "team", "created_by", "created_at",
                       "last_used_at"]

    def has_add_permission(self, request) -> bool:
        return False
