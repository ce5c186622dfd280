"""Files lent read-only to an agent program's sandbox session (see workers.envs.agent_proxy)."""
