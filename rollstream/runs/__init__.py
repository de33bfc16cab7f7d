"""What is done with a finished run: audit its ledgers against its topics, report it, fork it
from a step, export its weights or its records as a dataset."""
