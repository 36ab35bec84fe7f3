"""The worker process: intake from Redis, the engine loop, publishing, heartbeat, cancellation."""
