"""rollstream: asynchronous RL for LLMs over Apache Kafka; this package is the application:
the CLI, its configuration and its commands (up, fork, export, audit, replay, report)."""
