#!/bin/sh
# Starts one Celery worker of a Crucible pool in a container (PID 1, so SIGTERM reaches celery
# itself and it shuts down warm: the running task finishes, then it exits).
#
#   CRUCIBLE_WORKER_QUEUES       the pool queues to consume: gpu, sandbox or cpu (comma-separated)
#   CRUCIBLE_WORKER_CONCURRENCY  task processes (default 1; a GPU worker runs one run at a time)
#   CRUCIBLE_SCHEDULER           when on (true/on/ok/y/yes/1, as config/env.py reads it), also the
#                                node's own queue node.<CRUCIBLE_NODE_NAME or host name>, where the
#                                admission loop sends the runs it placed on this node
set -eu
: "${CRUCIBLE_WORKER_TOKEN:?set CRUCIBLE_WORKER_TOKEN: python manage.py create_worker_token prints one}"
: "${CRUCIBLE_API_URL:?set CRUCIBLE_API_URL: where this pool reaches the web (the API)}"
queues=${CRUCIBLE_WORKER_QUEUES:?set CRUCIBLE_WORKER_QUEUES to gpu, sandbox or cpu}
case "$(printf '%s' "${CRUCIBLE_SCHEDULER:-}" | tr '[:upper:]' '[:lower:]')" in
    true|on|ok|y|yes|1) queues="$queues,node.${CRUCIBLE_NODE_NAME:-$(hostname)}" ;;
esac
exec celery -A config.celery worker -Q "$queues" -c "${CRUCIBLE_WORKER_CONCURRENCY:-1}" \
    --loglevel "${LOG_LEVEL:-INFO}" "$@"
