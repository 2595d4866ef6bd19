"""The embedded engine: policyloop's own inference server for CPU machines and CI.

It serves the subset of SGLang's native HTTP API that the rollout service uses, with SGLang's
field names and shapes (see `policyloop.engines.protocol`), on any Hugging Face causal LM
directory loaded with transformers in float32. One client (`SGLangClient`) talks to it and to a
real SGLang server alike.

    python -m policyloop.engines.embedded --model-path DIR --host 127.0.0.1 --port 30000 \\
        [--max-batch 64] [--threads 1] [--weight-version 0]

Routes: POST/PUT /generate, GET /model_info and /get_model_info, GET /health (and
/health_generate), POST /update_weights_from_disk, POST /pause_generation, POST
/continue_generation, GET/POST /flush_cache, POST /abort_request, and for the colocated weight
sync POST /init_weights_update_group, /begin_weight_update, /update_weights_from_distributed,
/end_weight_update, /destroy_weights_update_group; its own POST /stage_weights_from_disk,
/stage_weights_from_tensor and /activate_staged_weights (a version prepared beside the served one
while generating, then swapped in between two steps); GET /metrics in Prometheus' text format, with
SGLang's names for what both engines count (`sglang:num_running_reqs`, `sglang:num_queue_reqs`,
`sglang:prompt_tokens_total`, `sglang:generation_tokens_total`) and
`policyloop_engine_in_flight_output_tokens` (tokens decoded so far by the requests not yet done:
above 0 while paused, some request will straddle a weight update).

One module per concern:
- `server`: the HTTP routes and the engine's lifecycle (`EmbeddedEngine`, `start_engine`).
- `scheduler`: waves of requests decoded together, pauses, aborts, SGLang's writer lock.
- `sampling`: the next token of each row (greedy, temperature, top-k/top-p, seeded).
- `model`: the served model and what a request is checked against.
- `weight_loading`: new weights from disk, from a request or from a broadcast, all or nothing.
- `receiver`: the engine's side of the colocated broadcast (`policyloop.weights.broadcast`).

Weights. As in SGLang, an update while generation runs takes the model's writer lock: new
requests wait and the update waits until the requests in flight have finished
(`abort_all_requests` ends them first, with finish_reason abort). An update while generation is
paused applies at once: requests paused in place continue with the new weights (their
`weight_versions` spans say which tokens came from which version; the KV cache of earlier tokens
is kept), retracted ones recompute their cache with them. `flush_cache` follows SGLang's rule:
the cache cannot be flushed while any request is queued or running (paused ones included) —
SGLang's update then fails its flush assertion, so this engine refuses the update (400 naming
flush_cache), and /flush_cache answers 400.
"""

from policyloop.engines.embedded.server import EmbeddedEngine, start_engine

__all__ = ["EmbeddedEngine", "start_engine"]
