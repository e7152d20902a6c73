"""The DAG engine: how a planned pipeline runs.

Sub-packages, importing one way (runtime → execution → state → tracking; planning and
``stage_call`` below them all):

- ``planning``  — YAML → PipelineConfig → the checked step DAG (no Ray started);
- ``execution`` — the step executor and where nodes run: Ray actors/tasks or inline;
- ``state``     — what lives across steps on workers and the driver: trainer, rollout
  replica, reference, rollout service and feeder, replay buffer, data, checkpoints;
- ``tracking``  — lineage records, MLflow logging, run lookup;
- ``stage_call`` — calling one registered stage (shared by backends and the feeder);
- ``runtime``   — assembles plan, backend, observer and data for a mode.

Rollout engines themselves (embedded, vLLM, SGLang) live apart in :mod:`rlpipe.inference`.
"""
