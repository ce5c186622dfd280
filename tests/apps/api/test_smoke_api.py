from tests.factories import DatasetFactory, make_run


def test_member_launches_profile_run_and_worker_reports(member, project, worker):
    dataset = DatasetFactory(project=project, team=project.team, slug="qa")
    run = make_run(project, dataset)
    got = member.client.get(f"/api/v1/teams/acme/runs/{run.pk}").json()
    assert got["status"] == "queued" and got["datasets"][0]["alias"] == "qa"

    claim = worker.post("/api/v1/worker/claim", {"pool": "cpu", "worker_id": "w1"}).json()
    assert claim["id"] == str(run.pk)
    lease = {"HTTP_X_CRUCIBLE_LEASE": claim["lease_id"]}
    assert worker.post(f"/api/v1/worker/runs/{run.pk}/status", {"status": "running"},
                       **lease).status_code == 200
    points = [{"name": "loss", "step": s, "value": 1.0 / (s + 1)} for s in range(100)]
    r = worker.post(f"/api/v1/worker/runs/{run.pk}/metrics", {"seq": 1, "points": points},
                    **lease)
    assert r.json() == {"stored": 100, "duplicate": False}
    series = member.client.get(f"/api/v1/teams/acme/runs/{run.pk}/metrics?max_points=10").json()
    pts = series["series"][0]["points"]
    assert len(pts) == 10 and pts[0]["max"] == 1.0 and pts[-1]["last"] == 1.0 / 100
