"""Producers: generate rollouts with a policy version on every token, publish them to Kafka.

Four wings: ``engine`` (the CPU engine behind SGLang's API, and the clients that reach one),
``tasks`` (prompts, environments, games, rewards: the extension points), ``rollout`` (the
worker that generates groups and publishes them) and ``gateway`` (agents over an
OpenAI-compatible API). ``app`` composes a producer, ``evaluation`` scores a version.
"""
