"""Brokers, object store and process management for the embedded (single-machine) setup.

Nothing here is needed when rollstream is pointed at an existing Kafka cluster and S3
store: every module starts a service only when the config says "embedded".
"""
