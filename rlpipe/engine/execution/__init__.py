"""Execution: the step executor and its compiled calls, the Ray backend (ray_runtime, ray_worker, worker_group, worker_calls) and the in-process one (inline), Arrow on the wire."""
