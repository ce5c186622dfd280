"""Multi-node runs: a train run whose allocation spans nodes runs as one Ray job
(``ray_job``); ``plan`` (pure, no Ray) decides whether a claimed run needs one and what it asks
for, and ``progress`` checks that an attempt trained what it had left. Ray is an optional
dependency (``.[cluster]``), imported only by ``ray_job``: single-host runs never load it."""
