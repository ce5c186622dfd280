"""Several pinned environments as one objective: multi-turn ones are still played as episodes."""

from workers.envs.adapter import as_objective
from workers.envs.load import load_environment
from workers.envs.mixed import MixedObjective


def test_mixed_objective_plays_only_its_multi_turn_environment_as_episodes():
    arith = as_objective(load_environment({"env": {"source": "builtin", "name": "arithmetic"}}))
    repair = as_objective(load_environment({"env": {"source": "builtin", "name": "code_repair"}}))
    mixed = MixedObjective([arith, repair], ["arith@v1", "repair@v1"])

    assert mixed.interaction == "multi_turn"
    assert mixed.episode_max_tokens == max(arith.episode_max_tokens, repair.episode_max_tokens)
    one_shot = next(e for e in mixed.train if e.meta["env"] == "0")
    episode = next(e for e in mixed.train if e.meta["env"] == "1")
    assert mixed.episode_env(one_shot) is None
    env, task = mixed.episode_env(episode)
    assert env is repair.env
    assert task.id == episode.meta["task_id"].split(":", 1)[1]


def test_single_turn_environments_stay_single_turn():
    a = as_objective(load_environment({"env": {"source": "builtin", "name": "arithmetic"}}))
    mixed = MixedObjective([a, a], ["a@v1", "a@v2"])
    assert mixed.interaction == "single_turn"
    assert all(mixed.episode_env(e) is None for e in mixed.train[:5])
