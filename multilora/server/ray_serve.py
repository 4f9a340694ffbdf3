"""Data-parallel replicas on Ray Serve: R multilora engines behind one OpenAI-compatible endpoint,
each request routed by its adapter (`multilora serve-ray`, or `serve run
multilora.cli.serve_ray:build ...`). See docs/ray.md.

The code is in multilora.server.ray: config (RayServeConfig, the headers, pure helpers),
directory (the adapter directory actor), replica (EngineReplica), ingress (Ingress, the
retries, build_application), start (init_ray, start_serve: Ray and Serve started without
failing on a busy host); this module gathers their public names.

Three pieces, one Serve application:

* **EngineReplica** (R replicas): an Engine, its AsyncEngine and the very FastAPI app of `multilora
  serve` (build_app), run in process. Each HTTP request the ingress forwards goes through that
  ASGI app, so every route, validation and OpenAI error JSON is the single-node server's; the
  response comes back as a stream of items: first `{"accepted": replica}` (the request has
  started here), then the whole response, or for SSE its head and then one item per body chunk.
  `serve.multiplexed(max_num_models_per_replica=N)` keeps the N adapters this replica served last:
  that set is what Serve's router reads to send an adapter's requests to a replica that holds it.
  Underneath, the engine's own tiers (device slots, host copies, disk) decide what is resident;
  the multiplexed set is the routing view, not a memory bound (give --max-loaded-loras >= N so
  that the adapters a replica advertises keep their host copies).
* **AdapterDirectory** (one named Ray actor): the source of truth for adapters, name -> {path,
  pinned}, with a version that every change bumps. It starts with --lora-modules. Before it
  serves any request a replica compares its version with the directory's (one small actor call)
  and, when it moved, unloads what the directory no longer has (or has under another path). New
  adapters are registered lazily, by the first request for them on each replica. So a runtime
  load or unload reaches every replica: after /v1/unload_lora_adapter returns, no replica starts
  a request for that adapter; after /v1/load_lora_adapter returns, every replica serves it
  (vLLM's /v1/load_lora_adapter reaches one data-parallel replica only).
* **Ingress** (the HTTP endpoint): checks the API key and the body size, answers the cluster's
  routes itself (/v1/models from the directory; load: validated by the app on one replica, then
  recorded in the directory; unload: removed from the directory) and forwards everything else
  to a replica through the handle, `.options(multiplexed_model_id=<the body's model>)` for an
  adapter (none for the base model), streamed.

A replica that dies is replaced by Serve. A request that the ingress sent to it but that had not
started there (no "accepted" item yet: routed just before the death, or queued in the dead
actor) is sent again, to another replica, up to `max_attempts` times; one that had started fails
cleanly: a 503 OpenAI error JSON when nothing was sent to the client yet, or an SSE error event
that ends the stream. Started requests are not retried: the request might be what killed the
replica, and a retry would take the next one down too.

Ray is imported lazily: `import multilora` and `multilora --help` never need it.
"""

from __future__ import annotations

from multilora.server.ray.config import (ATTEMPTS_HEADER, DIRECTORY_NAMESPACE, HELD_HEADER,
                                         REPLICA_HEADER, WARM_HEADER, RayServeConfig, bearer_ok, check_config,
                                         decode_names, encode_names, error_json, is_event_stream, mix_parts,
                                         multiplexed_id, relayed_headers, replica_gone, request_model, sse_error,
                                         stale_adapters)
from multilora.server.ray.directory import AdapterDirectory, create_directory, get_directory
from multilora.server.ray.ingress import (Ingress, NoReplicaError, build_application, died_message,
                                          open_on_replica, relay_stream)
from multilora.server.ray.replica import EngineReplica, run_asgi
from multilora.server.ray.start import START_TIMEOUT_S, controller_env, init_ray, start_serve, wait_for_proxies

__all__ = ["ATTEMPTS_HEADER", "AdapterDirectory", "DIRECTORY_NAMESPACE", "EngineReplica", "HELD_HEADER", "Ingress", "NoReplicaError", "REPLICA_HEADER", "RayServeConfig", "START_TIMEOUT_S", "WARM_HEADER", "bearer_ok", "build_application", "check_config", "controller_env", "create_directory", "decode_names", "died_message", "encode_names", "error_json", "get_directory", "init_ray", "is_event_stream", "mix_parts", "multiplexed_id", "open_on_replica", "relay_stream", "relayed_headers", "replica_gone", "request_model", "run_asgi", "sse_error", "stale_adapters", "start_serve", "wait_for_proxies"]
