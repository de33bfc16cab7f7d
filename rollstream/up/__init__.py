"""``rollstream up``: one run on one machine, planned from the config, its roles started,
supervised and shown as one display."""
