"""The rollout worker (``rollstream produce``): when a group may start, the weight versions it
generates under, its episodes, and the crash-safe publishing of its records to Kafka."""
