"""Execution: running planned nodes on Ray (ray_runtime) or in-process (inline), the step executor, Arrow on the wire."""
