"""Operations endpoints: readiness (``/readyz``) and Prometheus metrics (``/metrics``).

It reads every other app (runs, scheduling, sandbox), so it sits above them all in the
import layers; nothing imports it but the URL map. No models."""
