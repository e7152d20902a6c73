"""State that lives across steps: worker roles (trainer, rollout replica, reference), the rollout service and
feeder, the replay buffer, the prompt loader and checkpoints."""
