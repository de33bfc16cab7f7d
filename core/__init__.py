"""The small shared core below the roles: config sections, the one model loader and
log-probs, GRPO advantages, process control, the retry policy, reading a topic to its end."""
