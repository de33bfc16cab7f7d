"""The OpenAI-compatible gateway (``rollstream gateway``): agents call the policy over HTTP and
their episodes become the worker's groups, played through the worker's ``Desk``."""
