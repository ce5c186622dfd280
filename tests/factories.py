"""factory-boy factories and small builders used across the suite."""

from __future__ import annotations

from typing import Any

import factory
from django.contrib.auth import get_user_model

from apps.core.actor import Actor
from apps.datasets import services as dataset_services
from apps.datasets.models import Dataset, DatasetVersion
from apps.projects.models import Project
from apps.runs.launch import run_launch
from apps.runs.models import Run
from apps.teams.models import Membership, Role, Team
from workers.protocol import ClaimedRun


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.com")
    password = factory.django.Password("pw-for-tests-1")


class TeamFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Team

    slug = factory.Sequence(lambda n: f"team-{n}")
    name = factory.LazyAttribute(lambda t: t.slug.title())


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    team = factory.SubFactory(TeamFactory)
    user = factory.SubFactory(UserFactory)
    role = Role.MEMBER


class ProjectFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Project

    team = factory.SubFactory(TeamFactory)
    slug = factory.Sequence(lambda n: f"project-{n}")
    name = factory.LazyAttribute(lambda p: p.slug)


class DatasetFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Dataset

    project = factory.SubFactory(ProjectFactory)
    team = factory.LazyAttribute(lambda d: d.project.team)
    slug = factory.Sequence(lambda n: f"dataset-{n}")


def make_version(dataset: Dataset, records: list[dict[str, Any]] | None = None) -> DatasetVersion:
    records = records or [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    version, _ = dataset_services.version_create(actor=Actor.system(), dataset=dataset,
                                                 records=records)
    return version


def make_lab(role: str) -> dict[str, Any]:
    """The browser tests' world: alice (with ``role``) in team "RL Lab", project math and a
    dataset gsm with one version of 8 records."""
    user = UserFactory(username="alice")
    team = TeamFactory(slug="lab", name="RL Lab")
    MembershipFactory(team=team, user=user, role=role)
    project = ProjectFactory(team=team, slug="math", name="Math")
    dataset = DatasetFactory(project=project, team=team, slug="gsm")
    make_version(dataset, [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)])
    dataset.refresh_from_db()
    return {"user": user, "team": team, "project": project, "dataset": dataset}


def make_run(project: Project, dataset: Dataset | None = None, **overrides: Any) -> Run:
    """A queued profile run pinned to ``dataset`` (created with a version if missing)."""
    if dataset is None:
        dataset = DatasetFactory(project=project, team=project.team)
    if dataset.current_version_id is None:
        make_version(dataset)
    document = {"project": project.slug, "kind": "profile", "config": {},
                "datasets": [dataset.slug], **overrides}
    return run_launch(actor=Actor.system(), team=project.team, document=document).run


def make_train_run(project: Project, **overrides: Any) -> Run:
    """A queued train run of the tiny preset (no pins), ``config`` merged over a small one."""
    config = {"model": {"preset": {"num_layers": 2}}, "sft": {"steps": 0},
              "trainer": {"steps": 10, "zero_stage": 0}, "checkpoint": {"every": 0},
              **overrides.pop("config", {})}
    document = {"project": project.slug, "kind": "train", "config": config,
                "base_model": "preset", **overrides}
    return run_launch(actor=Actor.system(), team=project.team, document=document).run


def put_run_object(run: Run | ClaimedRun | dict[str, Any], name: str, data: bytes = b"x") -> str:
    """Write ``data`` under the run's own object prefix (where a worker of that run writes)
    and return its URI: the only place the worker API accepts a run's reports from."""
    from apps.core.storage import store
    from apps.runs.objects import run_prefix

    if isinstance(run, ClaimedRun):
        prefix = run.object_prefix
    elif isinstance(run, dict):
        prefix = run["object_prefix"]
    else:
        prefix = run_prefix(team_id=run.team_id, run_id=run.pk)
    return store().put_bytes(f"{prefix}/{name}", data)
