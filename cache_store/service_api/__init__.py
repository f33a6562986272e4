"""What the service and its clients agree on: the read-through protocol (headers, states,
how often waiters look, when a worker counts as alive) and the one HTTP client both HTTP
readers use. No FastAPI here: the service and the readers both import it."""
