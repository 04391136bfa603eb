"""The weights Dynamo's KV router gives to the tiers it files our blocks under: one home for the
frontend's flags (:mod:`omniprefix.fleet`) and the edge's own router (:mod:`omniprefix.speech_route`)."""

from __future__ import annotations

__all__ = ["DISK_CACHE_HIT_WEIGHT", "HOST_CACHE_HIT_WEIGHT"]

#: The KV router's weights of the tiers Dynamo files our blocks under (``KvRouterConfig``'s
#: ``host_cache_hit_weight`` / ``disk_cache_hit_weight``, the frontend's
#: ``--router-host-cache-hit-weight`` / ``--router-disk-cache-hit-weight``), for the frontend and
#: the edge's router.
#: Our CPU backend's events carry medium "CPU", which Dynamo files in its host tier: here that tier
#: is the working cache, worth as much as a device hit. "DISK" events (workers with a tier) go to
#: its disk tier, which credits the worker that announced the blocks; but the fleet's workers
#: share one tier directory and any of them loads those blocks alike, so a weight would only pull
#: load to the announcer.
HOST_CACHE_HIT_WEIGHT = 1.0
DISK_CACHE_HIT_WEIGHT = 0.0
