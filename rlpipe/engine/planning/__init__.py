"""Planning: a pipeline YAML read and checked (config_io) and turned into the step DAG (plan), before anything runs."""
