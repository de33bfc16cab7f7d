"""What is generated and how it is scored: prompt sources, environments, games and rewards.

These are the users' extension points; they call an engine only through what an episode
is given (an HTTP client, a peer policy), never the worker itself."""
