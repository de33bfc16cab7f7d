"""rollstream: asynchronous RL for LLMs over Apache Kafka (shared config, CLI and model code)."""
