"""The CPU engine behind SGLang's native HTTP API, and how a worker reaches an engine
(in this process, over HTTP, or through a router).

It knows nothing of tasks, Kafka or the rollout worker: a real SGLang can take its place."""
