"""Looking into a run's records after the fact: replay, render and export a group, re-run a
stage on it, inspect one group, list the roles that were there."""
