"""Tracking: node-execution records (observer), lineage tables, MLflow logging and run lookup."""
